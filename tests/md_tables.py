"""Reading the Markdown tables the benchmarks print (for their tests)."""

from __future__ import annotations


def md_rows(out: str, head: str) -> list[list[str]]:
    """The cells of the rows of the table whose header line starts with `head` (its separator line skipped)."""
    lines = out.splitlines()
    i = next(k for k, r in enumerate(lines) if r.startswith(head))
    rows = []
    for r in lines[i + 2:]:
        if not r.startswith("| "):
            break
        rows.append([c.strip() for c in r.strip("|").split("|")])
    return rows

"""The project documents itself: its docs/ are in the repository, every relative link of the README and docs/ resolves
to a tracked file (and heading), nothing points at notes outside the checkout, and every default is named where a
user looks for it: each command's --help and the docstrings of Engine.load, Engine.make_request and Scheduler."""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "architecture.md", "numerics.md", "gguf-qwen35.md", "sm20.md", "benchmarks.md", "vision.md")
# the notes that lived beside the checkout; split so that this file does not name them itself
OUTSIDE = ("../" + "shared", "shared/" + "DESIGN.md", "shared/" + "spec")


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    return [p for p in out.decode().split("\0") if p]


def test_no_tracked_file_points_outside_the_repository():
    bad = []
    for rel in _tracked():
        p = ROOT / rel
        if not p.is_file():  # deleted in the working tree, not yet committed
            continue
        data = p.read_bytes()
        bad += [f"{rel}: {needle}" for needle in OUTSIDE if needle.encode() in data]
    assert not bad, "files that point at notes outside the repository:\n" + "\n".join(bad)


def _prose(text: str) -> str:
    """Markdown without its fenced code blocks and code spans (their brackets are no links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", md.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+?)\s*$", text, flags=re.M)}


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_markdown_links_resolve_inside_the_repository():
    tracked = set(_tracked())
    pages = [ROOT / "README.md"] + [ROOT / "docs" / n for n in DOCS]
    assert all(p.is_file() for p in pages), [str(p) for p in pages if not p.is_file()]
    bad, n = [], 0
    for md in pages:
        for target in _LINK.findall(_prose(md.read_text(encoding="utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            n += 1
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(ROOT)}: ({target})"
            try:
                rel = dest.relative_to(ROOT).as_posix()
            except ValueError:
                bad.append(f"{where} leaves the repository")
                continue
            if not dest.is_file() or rel not in tracked:
                bad.append(f"{where} is no tracked file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{where}: {dest.name} has no heading #{anchor}")
    assert n >= 8, f"only {n} relative links found: is the link pattern broken?"
    assert not bad, "\n".join(bad)


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert set(DOCS[1:]) <= set(pages)
    missing = [p for p in pages if f"]({p})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"
    assert "](docs/README.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_cited_doc_and_section_exists():
    """Comments cite docs/<page>.md and the Qwen3.5 page's sections as "§N": each must exist (and none cites the old
    notes by their old name)."""
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "gguf-qwen35.md").read_text(encoding="utf-8"),
                              flags=re.M))
    assert sections == {str(i) for i in range(1, 11)}
    bad, n = [], 0
    for rel in _tracked():
        p = ROOT / rel
        if not p.is_file() or p.suffix not in (".py", ".md", ".c", ".h", ".cu", ".cuh", ".sh", ""):
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        bad += [f"{rel}: cites the old notes as '{o}'" for o in ("spec " + "§", "spec qwen35 " + "§") if o in text]
        for page, sec in re.findall(r"docs/([\w.-]+\.md)(?: §(\d+))?", text):
            n += 1
            if not (ROOT / "docs" / page).is_file():
                bad.append(f"{rel}: docs/{page} does not exist")
            elif sec and (page != "gguf-qwen35.md" or sec not in sections):
                bad.append(f"{rel}: docs/{page} §{sec} does not exist")
    assert n >= 10, n
    assert not bad, "\n".join(bad)


# --help ------------------------------------------------------------------------------------------------------------


def _commands(parser, path=()):
    """(command path, its parser) of every command and subcommand."""
    yield path, parser
    for act in parser._actions:
        if isinstance(act, argparse._SubParsersAction):
            for name, sub in act.choices.items():
                yield from _commands(sub, path + (name,))


def _entry(help_text: str, option: str) -> str:
    """The help entry of `option` (its invocation line and the lines under it), whitespace collapsed."""
    lines = help_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(rf"  {re.escape(option)}(?:[ ,]|$)", ln))
    out = [lines[start]]
    for ln in lines[start + 1:]:
        if not ln.startswith("   "):  # the next option, a blank line or a section title
            break
        out.append(ln)
    return " ".join(" ".join(out).split())


def _has_default(act) -> bool:
    d = act.default
    return bool(act.option_strings) and not (d is None or d is False or d is argparse.SUPPRESS
                                             or (isinstance(d, list | tuple) and not d))


def _same(written: str, value) -> bool:
    """Whether a default written in a help text ("2GiB", "0:", "auto") is the option's value."""
    from hybridinfer.cli.args import parse_size

    written = written.rstrip(":.")
    if written == str(value):
        return True
    if isinstance(value, int | float) and not isinstance(value, bool):
        for read in (float, parse_size):
            try:
                if read(written) == value:
                    return True
            except (ValueError, argparse.ArgumentTypeError):
                pass
    return False


def test_every_command_help_names_its_defaults(monkeypatch, capsys):
    from hybridinfer.cli import build_parser, main
    from hybridinfer.cli.args import parse_size, size_text

    for var in ("HYBRIDINFER_BACKEND", "HYBRIDINFER_ISA", "HYBRIDINFER_PREFIX_CACHE_DIR"):  # defaults as written
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", "120")
    commands = list(_commands(build_parser()))
    assert {("run",), ("serve",), ("batch",), ("bench", "serve"), ("plan",)} <= {p for p, _ in commands}
    checked, bad = 0, []
    for path, parser in commands:
        with pytest.raises(SystemExit) as e:
            main([*path, "--help"])
        assert e.value.code == 0, path
        out = capsys.readouterr().out
        for act in parser._actions:
            if not _has_default(act) or act.help == argparse.SUPPRESS:
                continue
            checked += 1
            entry = _entry(out, act.option_strings[0])
            where = f"hybridinfer {' '.join(path)} {'/'.join(act.option_strings)} (default {act.default!r})"
            if "default" not in (act.help or "").lower():  # the formatter names it
                shown = size_text(act.default) if act.type is parse_size else str(act.default)
                if f"(default: {shown})" not in entry:
                    bad.append(f"{where}: --help says {entry!r}")
                continue
            for written in re.findall(r"\bdefault:?\s+([^\s,;)]+)", act.help):  # written by hand: it must be true
                if not _same(written, act.default):
                    bad.append(f"{where}: its help says 'default {written}'")
    assert checked > 80, checked
    assert not bad, "\n".join(bad)


def test_help_formatter_shows_sizes_as_typed_and_skips_unset_options(capsys):
    from hybridinfer.cli.args import _Parser, parse_size

    p = _Parser(prog="x")
    p.add_argument("--body", type=parse_size, default=parse_size("16MiB"), help="largest body")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--key", default=None, help="a key")
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--n", type=int, default=4, help="n (default 4)")
    text = " ".join(p.format_help().split())
    assert "largest body (default: 16MiB)" in text
    assert "--port PORT (default: 8080)" in text
    assert "a key --flag" in text and "a flag --n" in text  # nothing added to unset or off options
    assert "n (default 4)" in text and "(default: 4)" not in text


# docstrings ------------------------------------------------------------------------------------------------------


def _documented(fn, doc: str, skip=("self", "engine", "prompt")) -> list[str]:
    """The keyword parameters of `fn` whose default `doc` does not state as "name (default VALUE"."""
    missing = []
    for name, prm in inspect.signature(fn).parameters.items():
        if name in skip or prm.default is inspect.Parameter.empty:
            continue
        d = prm.default
        value = f'"{d}"' if isinstance(d, str) else str(d)
        if not re.search(rf"\b{name} \(default {re.escape(value)}[:;),.]", doc):
            missing.append(f"{name} (default {value}")
    return missing


def test_engine_and_scheduler_docstrings_state_their_defaults():
    from hybridinfer.engine.api import Engine
    from hybridinfer.engine.scheduler import Scheduler

    for fn, doc in ((Engine.load, Engine.load.__doc__), (Engine.make_request, Engine.make_request.__doc__),
                    (Scheduler.__init__, Scheduler.__doc__)):
        missing = _documented(fn, doc or "")
        assert not missing, f"{fn.__qualname__}'s docstring does not state: {missing}"
    # and the check can fail: a docstring that leaves a default out is caught
    assert _documented(Scheduler.__init__, "max_seqs (default 8): ...") == ["state_budget (default None",
                                                                           "worker (default True",
                                                                           "step_tokens (default 256"]

"""The order a batch job runs its requests in: prompts that share a prefix next to each other.

Within a window of requests the order is the depth-first order of a token trie over their prompts, which is the
prompts sorted by their token ids. Requests that share a prefix then reach the scheduler together: the first of them
snapshots its state where the prompts part ways (`prefix/index.shared_points`) and the others restore that snapshot
instead of prefilling the prefix again. A prefix shared across windows is found in the prefix cache, where the
window before left it.

Why windows and not the whole file: sorting a whole input needs every prompt's tokens (or a key of them) at once,
memory that grows with the job; a window of some thousand requests holds the grouping that matters (a system
prompt shared by a job is in every window) in memory that does not."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def trie_order(keys: list[list[int]]) -> list[int]:
    """Indices of `keys` (token id lists) in the depth-first order of their trie: sorted, ties in input order."""
    return sorted(range(len(keys)), key=keys.__getitem__)


def shared_prefix_tokens(keys: list[list[int]]) -> int:
    """Tokens a run in this order need not prefill: for each prompt, its common prefix with the one before it (what
    a restored snapshot saves at best). A measure of how well an order groups prompts, for tests and reports."""
    saved = 0
    for a, b in zip(keys, keys[1:], strict=False):
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        saved += n
    return saved


def windows(items: Iterable, size: int) -> Iterator[list]:
    """`items` in lists of `size` (the last one shorter)."""
    out = []
    for it in items:
        out.append(it)
        if len(out) >= size:
            yield out
            out = []
    if out:
        yield out

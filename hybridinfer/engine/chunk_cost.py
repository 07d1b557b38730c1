"""What a step's prompt chunks cost, priced by where they sit in their prompts: the scheduler's time model.

A chunk of c tokens starting at position p costs products for c tokens and attention over c * (p + c/2) token
positions (every row attends to the context before it and to the rows of its chunk before it). On a long prompt the
second term grows past the first, so a per-token average learned early in the prompts under-prices the late chunks
and running streams stall longer than the budget meant (issue 30's ITL p99). The model here is

    seconds = a * N + b * Q + c * K,    N = sum of c,    Q = sum of c * (p + c/2),    K = the chunks

over a pass's chunks, with a, b and c fitted by least squares over the recent passes (older ones fade), and a step's
chunks sized so the predicted time stays within what running streams may wait."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def work_of(chunks) -> tuple[float, float]:
    """(N, Q) of chunks given as (start position p, tokens c)."""
    n = q = 0.0
    for p, c in chunks:
        n += c
        q += c * (p + c / 2.0)
    return n, q


@dataclass
class ChunkCost:
    """Least squares of seconds = a N + b Q + c K over observed passes (K: the pass's chunks, each one's own work
    outside the shared products: its rows' attention call, its snapshot bookkeeping, the drafter's catch-up), each
    pass weighing `keep` times the one after it.

    With passes all alike in Q/N or in chunks a pass, the terms cannot be told apart: then c stays 0, and with
    passes all at one context length b stays 0 too and a is the per-token average (what the scheduler used before
    this model). a, b and c are never negative."""

    keep: float = 0.8
    _m: np.ndarray = field(default_factory=lambda: np.zeros((3, 4)))  # w * [N Q K]^T [N Q K S], summed
    a: float | None = None
    b: float = 0.0
    c: float = 0.0

    def observe(self, chunks, seconds: float) -> None:
        n, q = work_of(chunks)
        if n <= 0 or seconds <= 0:
            return
        x = np.array([n, q, float(len(chunks))])
        self._m = self.keep * self._m + np.outer(x, np.append(x, seconds))
        if self._fit3():
            return
        self.c = 0.0
        m = self._m  # the two-term fit from the same sums
        nn, nq, qq, ns, qs = (float(v) for v in (m[0, 0], m[0, 1], m[1, 1], m[0, 3], m[1, 3]))
        det = nn * qq - nq * nq
        # a fit with two unknowns only when the passes differ enough in Q/N (else the system is near singular)
        if det > 1e-6 * nn * qq:
            a, b = (ns * qq - qs * nq) / det, (nn * qs - nq * ns) / det
            if a > 0 and b >= 0:
                self.a, self.b = a, b
                return
            if a <= 0 < qs:  # attention-bound as far as the data says: all of it on b
                self.a, self.b = 1e-12, qs / qq
                return
        self.a, self.b = ns / nn, 0.0

    def _fit3(self) -> bool:
        """The fit with the per-chunk term, where the passes tell all three apart and none comes out negative."""
        g, y = self._m[:, :3], self._m[:, 3]
        scale = np.sqrt(np.maximum(np.diag(g), 1e-300))
        gn = g / np.outer(scale, scale)
        if np.linalg.cond(gn) > 1e8:
            return False
        a, b, c = np.linalg.solve(gn, y / scale) / scale
        if a > 0 and b >= 0 and c > 0:
            self.a, self.b, self.c = float(a), float(b), float(c)
            return True
        return False

    def seconds(self, chunks) -> float | None:
        if self.a is None:
            return None
        n, q = work_of(chunks)
        return self.a * n + self.b * q + self.c * len(chunks)

    def tokens_within(self, pos: int, limit_s: float) -> int | None:
        """The most tokens a chunk starting at `pos` may take to cost at most limit_s (None before any pass was
        measured): the root x of (b/2) x^2 + (a + b pos) x + c = limit_s."""
        if self.a is None:
            return None
        limit_s -= self.c  # the chunk's own cost, whatever its length
        if limit_s <= 0:
            return 0
        lin = self.a + self.b * pos
        if self.b <= 0:
            return int(limit_s / lin) if lin > 0 else 1 << 30
        h = self.b / 2.0
        return int((-lin + math.sqrt(lin * lin + 4 * h * limit_s)) / (2 * h))


def size_chunk(cost: ChunkCost, pos: int, left: int, secs: float | None, least: int, snap_s: float, cut, at
               ) -> tuple[int, int, float | None]:
    """A prompt chunk from position `pos` within `left` tokens and `secs` seconds (None: no limit, as before any
    measure): (its budget, the tokens it takes, the seconds left after it). `cut(budget)` gives the tokens a
    budget takes (the engine cuts a chunk at the next snapshot position); a chunk that ends at one of `at` (the
    snapshot positions) also pays a snapshot's copy, `snap_s`. At least `least` tokens (a step's first chunk:
    prefill always advances), else 0 budget when nothing fits."""
    if secs is None:
        return left, cut(left), None
    for snap in (0.0, snap_s):
        fit = cost.tokens_within(pos, secs - snap)
        want = left if fit is None else min(left, max(fit, least))
        if want <= 0:
            return 0, 0, secs
        took = cut(want)
        price = cost.seconds([(pos, took)]) or 0.0
        if pos + took not in at:
            return want, took, secs - price
    return want, took, secs - price - snap_s

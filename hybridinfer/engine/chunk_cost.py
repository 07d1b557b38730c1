"""What a step's prompt chunks cost, priced by where they sit in their prompts: the scheduler's time model.

A chunk of c tokens starting at position p costs products for c tokens and attention over c * (p + c/2) token
positions (every row attends to the context before it and to the rows of its chunk before it). On a long prompt the
second term grows past the first, so a per-token average learned early in the prompts under-prices the late chunks
and running streams stall longer than the budget meant (issue 30's ITL p99). The model here is

    seconds = a * N + b * Q,    N = sum of c,    Q = sum of c * (p + c/2)

over a pass's chunks, with a and b fitted by least squares over the recent passes (older ones fade), and a step's
chunks sized so the predicted time stays within what running streams may wait."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def work_of(chunks) -> tuple[float, float]:
    """(N, Q) of chunks given as (start position p, tokens c)."""
    n = q = 0.0
    for p, c in chunks:
        n += c
        q += c * (p + c / 2.0)
    return n, q


@dataclass
class ChunkCost:
    """Least squares of seconds = a N + b Q over observed passes, each weighing `keep` times the one after it.

    With passes all at one context length, a and b cannot be told apart: b stays 0 and a is the per-token average
    (what the scheduler used before this model). a and b are never negative."""

    keep: float = 0.8
    _s: list = field(default_factory=lambda: [0.0] * 5)  # sums of w*N*N, w*N*Q, w*Q*Q, w*N*S, w*Q*S
    a: float | None = None
    b: float = 0.0

    def observe(self, chunks, seconds: float) -> None:
        n, q = work_of(chunks)
        if n <= 0 or seconds <= 0:
            return
        s = self._s
        for i, v in enumerate((n * n, n * q, q * q, n * seconds, q * seconds)):
            s[i] = self.keep * s[i] + v
        nn, nq, qq, ns, qs = s
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

    def seconds(self, chunks) -> float | None:
        if self.a is None:
            return None
        n, q = work_of(chunks)
        return self.a * n + self.b * q

    def tokens_within(self, pos: int, limit_s: float) -> int | None:
        """The most tokens a chunk starting at `pos` may take to cost at most limit_s (None before any pass was
        measured): the root of (b/2) c^2 + (a + b pos) c = limit_s."""
        if self.a is None:
            return None
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

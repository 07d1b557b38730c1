"""What drafting costs and when it pays (engine/spec.py's decision, pure functions of measured step times).

A step either decodes one row per running sequence (plain) or verifies every sequence's [token, drafts] (a verify
step: the drafter's proposals, one pass over all rows, the rollback of rejected rows, the acceptance). The two are
priced apart, each as t0 + r * rows fitted over recent steps of its kind (`SpecCost`): a verify step has costs of
its own (per-sequence calls, recurrent-state copies and the rollback, the drafter), so on a small model or a busy
batch it costs more than a plain step of as many rows, and one fit over both would price drafts too low. A step
that recorded its native calls (the first of its shape: on a small model several times its replays) is not taken at
its seconds: recorded plain steps (once per set of sequences) give record_x, what a recording takes over its
replays, a recorded verify step counts as its seconds over record_x, and a verify step of a split of rows not
replayed lately is charged record_x, spread over the steps the split may be replayed in.

The draft length is decided for the whole batch (`plan_k`): every sequence that may draft takes the same k (each
capped by its room), since all rows go through one verify step whose time every sequence waits for, and since a
repeated split of rows replays its recorded step where a new one records it again. The k chosen maximizes expected
tokens per second of the whole step, and drafting happens only where that exceeds a plain step's rows per second:
under the cost model, drafts never lower the batch's throughput.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

VERIFY_FADE = 0.999  # a plain step fades the verify steps' evidence, so after a while without drafts one is probed
MIN_EVIDENCE = 0.5  # verify evidence weighing less than this (one step's is 1): priced as a plain step (a probe)


@dataclass
class StepCost:
    """A step's seconds as t0 + r * rows, fitted by least squares over recent steps (older ones fade)."""

    keep: float = 0.9
    s: list = field(default_factory=lambda: [0.0] * 5)  # weights of: 1, x, x^2, y, x*y

    def add(self, rows: int, seconds: float, weight: float = 1.0) -> None:
        x, y = float(rows), float(seconds)
        for i, v in enumerate((1.0, x, x * x, y, x * y)):
            self.s[i] = self.keep * self.s[i] + weight * v

    def fade(self, keep: float) -> None:
        self.s = [keep * v for v in self.s]

    @property
    def weight(self) -> float:
        return self.s[0]

    def fit(self, anchor: tuple[float, float] | None = None, slope: float = 0.0) -> tuple[float, float] | None:
        """(t0, r), or None before any step. With one row count seen so far the slope is unknown: the line through
        `anchor` (rows, seconds) and that point where given, its slope at least `slope` (a row of another kind of
        step: verify steps seen only at B = 1, below a plain step of B = 8 rows that costs less, made that line fall
        and priced 8 sequences' drafts at one sequence's verify step), else a memory-bound step (t0 nine tenths of
        it)."""
        n, sx, sxx, sy, sxy = self.s
        if n < 1e-9:
            return None
        var = n * sxx - sx * sx
        if var <= 1e-9 * max(n * sxx, 1.0):
            t, rows = sy / n, max(sx / n, 1.0)
            if anchor is not None and abs(rows - anchor[0]) >= 0.5:
                r = max((t - anchor[1]) / (rows - anchor[0]), slope, 0.0)
                return max(t - r * rows, 0.0), r
            return 0.9 * t, 0.1 * t / rows
        r = (n * sxy - sx * sy) / var
        t0 = (sy - r * sx) / n
        return max(t0, 0.0), max(r, 0.0)


def line(fit: tuple[float, float]) -> Callable[[float], float]:
    t0, r = fit
    return lambda rows: t0 + r * rows


@dataclass
class SpecCost:
    """Plain and verify steps' fits, and how many times its replays a recorded step takes (module docstring)."""

    plain: StepCost = field(default_factory=StepCost)
    verify: StepCost = field(default_factory=StepCost)
    record_x: float | None = None  # a recorded plain step's seconds over the fit's price of it (a running estimate)
    _unpriced: list = field(default_factory=list)  # recorded plain steps (rows, seconds) not yet priced
    _recorded_verify: list = field(default_factory=list)  # recorded verify steps (rows, seconds) not yet counted
    steps: int = 0  # steps measured

    def add(self, rows: int, seconds: float, drafted: bool, recorded: bool = False) -> None:
        """A step's seconds. A recorded plain step, once plain steps are priced, gives record_x; a recorded verify
        step counts as a verify step of its seconds over record_x (what its replays should take), once record_x is
        known: else every new split of rows (each k's first step records) would be priced as a plain step, and a
        model whose verify steps cost several plain ones (a MoE's rows each read their own experts) drafted k after
        k before one was measured."""
        self.steps += 1
        if not drafted:
            self.verify.fade(VERIFY_FADE)
        if not recorded:
            (self.verify if drafted else self.plain).add(rows, seconds)
        else:
            (self._recorded_verify if drafted else self._unpriced).append((rows, seconds))
        p = self.plain.fit()
        while p is not None and self._unpriced:
            rows, seconds = self._unpriced.pop()
            x = max(seconds / max(line(p)(rows), 1e-12), 1.0)
            self.record_x = x if self.record_x is None else 0.5 * (self.record_x + x)
        while self.record_x is not None and self._recorded_verify:
            rows, seconds = self._recorded_verify.pop()
            self.verify.add(rows, seconds / self.record_x)

    def model(self, batch: int) -> tuple[float, Callable[[float], float], float] | None:
        """(a plain step's seconds at `batch` rows, a verify step's seconds by its rows, record_x or 1), or None
        before a plain step was measured. Verify steps unseen, or not for long: priced as plain steps of as many
        rows (drafting then looks as cheap as a memory-bound step makes it, so it is tried and measured)."""
        p = self.plain.fit()
        if p is None:
            return None
        plain = line(p)(batch)
        verify = line(p) if self.verify.weight < MIN_EVIDENCE else \
            line(self.verify.fit(anchor=(batch, plain), slope=p[1]))
        return plain, verify, self.record_x or 1.0


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify of k drafts yields when each is accepted with probability a: 1 + a + ... + a^k."""
    return float(sum(a**j for j in range(k + 1)))


def plan_k(accepts: list[float], caps: list[int], plain: float, verify: Callable[[float], float],
           record_x: float = 1.0, replayed=(), left: int = 1) -> int:
    """The draft length of a step of len(accepts) sequences, sequence i drafting min(k, caps[i]) tokens (caps[i] 0:
    it does not draft) with acceptance estimate accepts[i]: the k of most expected tokens per second, counted over
    the whole verify step, if that beats a plain step's len(accepts) / plain; else 0. A verify step of R rows takes
    verify(R) seconds, and record_x times that where k is not in `replayed` (its split of rows is new, so the step
    records it), the extra spread over the steps that split may serve again: until the sequence with fewest
    tokens `left` ends."""
    B = len(accepts)
    best_k, best = 0, B / max(plain, 1e-12)
    for k in range(1, max(caps, default=0) + 1):
        ks = [min(k, c) for c in caps]
        tokens = B + sum(expected_tokens(a, j) - 1 for a, j in zip(accepts, ks, strict=True))
        steps = max(1.0, left * B / tokens)
        t = verify(B + sum(ks))
        rate = tokens / max(t if k in replayed else t * (1 + (record_x - 1) / steps), 1e-12)
        if rate > best:
            best_k, best = k, rate
    return best_k

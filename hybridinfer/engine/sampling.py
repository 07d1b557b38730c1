"""Token sampling: the settings (SamplingParams, stop strings, their checks) and the sampler in use, in numba,
llama.cpp's order: penalties, top-k, top-p, min-p, temperature, draw. No allocation per call: the caller owns the
scratch (`SampleScratch`) and the generator state (`rng_new`), a splitmix64 stream per sequence, so a seed
reproduces the tokens. Top-k is a heap selection (O(V log k)), not a sort of the vocabulary; with top_k = 0, only
the tokens that survive min-p enter a heap, and it is popped only as far as top-p needs. tests/oracles/sampler.py
is the plain-numpy twin it is tested against.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import numpy as np
from numba import njit

from ..errors import ParameterError


def check_number(name: str, value, *, integer: bool = False):
    """`value` as given, after checking it is a finite real number (an integer with `integer`); bools are not
    numbers here (True as a temperature is a mistake, not 1.0)."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ParameterError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise ParameterError(f"{name} must be a finite number, got {value!r}")
    return value


INT64_MAX = 2**63 - 1  # the numba sampler takes int64 arguments: a larger Python int cannot cross into it


def check_int(name: str, value, lo: int, hi: int = INT64_MAX) -> int:
    """`value` as an int, after checking it is an integer in [lo, hi] (by default at most int64's maximum: every
    integer setting ends in native code or numpy, where a larger one overflows)."""
    check_number(name, value, integer=True)
    if value < lo:
        raise ParameterError(f"{name} must be >= {lo}, got {value!r}")
    if value > hi:
        raise ParameterError(f"{name} must be <= {hi}, got {value!r}")
    return int(value)


def check_stop(stop) -> list[str]:
    """Stop strings as a list: None, one string or a sequence of them, none empty (an empty one would match
    before the first token)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ParameterError(f"a stop string must be a non-empty str, got {s!r}")
    return stops


@dataclass(frozen=True)
class SamplingParams:
    """Every field is checked here, where it enters, so the sampler never sees a value it cannot take: floats
    finite (temperature >= 0, top_p in (0, 1], min_p in [0, 1), repeat_penalty > 0), integers in int64 (top_k and
    repeat_last_n in [0, 2**63 - 1]; seed in [-2**63, 2**64 - 1], either signed or unsigned 64-bit, taken mod
    2**64). top_k at or above the vocabulary size keeps every token, as top_k = 0 does (llama.cpp clamps it the same
    way); the vocabulary is not known here, so a large top_k is no error."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name))
        if self.temperature < 0:
            raise ParameterError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p < 1.0:
            raise ParameterError(f"min_p must be in [0, 1), got {self.min_p!r}")
        check_int("top_k", self.top_k, 0)  # 0: off
        if self.repeat_penalty <= 0:
            raise ParameterError(f"repeat_penalty must be > 0, got {self.repeat_penalty!r}")
        check_int("repeat_last_n", self.repeat_last_n, 0)
        if self.seed is not None:
            check_int("seed", self.seed, -(2**63), 2**64 - 1)


# the sampler ---------------------------------------------------------------------------------------------------------
_jit = dict(cache=True, fastmath=False)

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


def rng_new(seed: int | None = None) -> np.ndarray:
    """Generator state (uint64[1]) for `sample`; seed None draws one from the OS."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    return np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)


@njit(**_jit)
def rng_uniform(state):
    """Next float64 in [0, 1) of the splitmix64 stream in state[0] (53 random bits)."""
    s = state[0] + _GAMMA
    state[0] = s
    z = s
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    z = z ^ (z >> _S31)
    return np.float64(z >> _S11) * (1.0 / 9007199254740992.0)


class SampleScratch:
    """Per-vocabulary work buffers: xs (V,) float64 (penalised logits), idx (V,) int32 (candidates)."""

    def __init__(self, n_vocab: int):
        self.xs = np.zeros(n_vocab, np.float64)
        self.idx = np.zeros(n_vocab, np.int32)


@njit(**_jit)
def _better(xs, a, b):
    """Does token a rank before token b? Higher logit first, lower id first on ties (stable sort)."""
    return xs[a] > xs[b] or (xs[a] == xs[b] and a < b)


@njit(**_jit)
def _sift_down(xs, h, i, n, best_root):
    """Restore the heap h[0:n] below i; best_root: the best token at the root, else the worst."""
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and (_better(xs, h[c + 1], h[c]) == best_root):
            c += 1
        if _better(xs, h[c], h[i]) == best_root:
            h[i], h[c] = h[c], h[i]
            i = c
        else:
            return


@njit(**_jit)
def _apply_penalties(xs, history, n_hist, last_n, repeat_penalty, presence_penalty, frequency_penalty, idx):
    """Each distinct token of the window is penalised once, as llama.cpp's penalties sampler does:
    x/rp if x > 0 else x*rp, then - count * frequency - presence (count: its occurrences in the window).
    idx serves as the count array (only window entries are touched); ids outside [0, V) are ignored."""
    V = xs.shape[0]
    lo = max(0, n_hist - last_n) if last_n > 0 else 0
    for i in range(lo, n_hist):
        if 0 <= history[i] < V:
            idx[history[i]] = 0
    for i in range(lo, n_hist):
        if 0 <= history[i] < V:
            idx[history[i]] += 1
    for i in range(lo, n_hist):
        tok = history[i]
        if 0 <= tok < V and idx[tok] > 0:
            c = idx[tok]
            idx[tok] = 0  # done: a later occurrence is not penalised again
            r = xs[tok]
            r = r / repeat_penalty if r > 0 else r * repeat_penalty
            xs[tok] = r - c * frequency_penalty - presence_penalty


@njit(**_jit)
def _penalises(n_hist, repeat_penalty, presence_penalty, frequency_penalty):
    """Whether the penalties change any logit: a history to penalise and a penalty that is not neutral."""
    return n_hist > 0 and (repeat_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0)


@njit(**_jit)
def sample(logits, temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty, history,
           n_hist, last_n, rng, xs, idx):
    """One token id from logits (V,) float32.

    Penalties on the distinct tokens of history[n_hist-last_n:n_hist] (all of history[:n_hist] when
    last_n <= 0) if repeat_penalty != 1 or presence_penalty or frequency_penalty != 0; temperature == 0:
    the arg max (lowest id on ties). Otherwise candidates ranked by logit (ties: lower id), top_k (0 = off), top_p
    (smallest prefix with cumulative probability >= top_p; 1 = off), min_p (p >= min_p * p_max; 0 =
    off), softmax of logit/temperature over the survivors, one uniform from rng (uint64[1], advanced).
    xs (V,) float64 and idx (V,) int32 are scratch. Arithmetic in float64, as sampling.py.
    """
    V = logits.shape[0]
    penalise = _penalises(n_hist, repeat_penalty, presence_penalty, frequency_penalty)
    if temperature == 0.0 and not penalise:
        best, bv = 0, logits[0]
        for i in range(1, V):
            if logits[i] > bv:
                best, bv = i, logits[i]
        return best
    for i in range(V):
        xs[i] = logits[i]
    if penalise:
        _apply_penalties(xs, history, n_hist, last_n, repeat_penalty, presence_penalty, frequency_penalty, idx)
    if temperature == 0.0:
        best, bv = 0, xs[0]
        for i in range(1, V):
            if xs[i] > bv:
                best, bv = i, xs[i]
        return best
    if 0 < top_k < V:
        # heap of the k best with the worst at the root, then heapsort: best first in idx[0:k]
        k = top_k
        for i in range(k):
            idx[i] = i
        for i in range(k // 2 - 1, -1, -1):
            _sift_down(xs, idx, i, k, False)
        thr = xs[idx[0]]  # the worst kept; a later id never beats it on a tie
        for i in range(k, V):
            if xs[i] > thr:
                idx[0] = i
                _sift_down(xs, idx, 0, k, False)
                thr = xs[idx[0]]
        for end in range(k - 1, 0, -1):
            idx[0], idx[end] = idx[end], idx[0]
            _sift_down(xs, idx, 0, end, False)
        base, n = 0, k
        x0 = xs[idx[0]]
        z = 0.0
        for i in range(k):
            z += math.exp(xs[idx[i]] - x0)
        if top_p < 1.0:
            cum = 0.0
            for i in range(k):
                cum += math.exp(xs[idx[i]] - x0) / z
                if cum >= top_p:
                    n = i + 1
                    break
        if min_p > 0.0:
            m = 1
            while m < n and math.exp(xs[idx[m]] - x0) >= min_p:
                m += 1
            n = m
    else:
        # all V are candidates: normaliser over V, then only min-p survivors enter a heap
        x0 = xs[0]
        for i in range(1, V):
            if xs[i] > x0:
                x0 = xs[i]
        z = 0.0
        m = 0
        for i in range(V):
            e = math.exp(xs[i] - x0)
            z += e
            if e >= min_p:
                idx[m] = i
                m += 1
        base, n = 0, m
        if top_p < 1.0:
            # best-root heap over idx[0:m]; pop into idx[m-1], idx[m-2], ... until top_p is reached
            for i in range(m // 2 - 1, -1, -1):
                _sift_down(xs, idx, i, m, True)
            cum = 0.0
            r = 0
            while r < m:
                end = m - 1 - r
                idx[0], idx[end] = idx[end], idx[0]
                _sift_down(xs, idx, 0, end, True)
                r += 1
                cum += math.exp(xs[idx[end]] - x0) / z
                if cum >= top_p:
                    break
            base, n = m - r, r
            lo, hi = base, m - 1
            while lo < hi:
                idx[lo], idx[hi] = idx[hi], idx[lo]
                lo += 1
                hi -= 1
    # temperature and draw over idx[base:base+n] (best first unless no ranking was needed)
    zmax = xs[idx[base]] / temperature
    for i in range(base + 1, base + n):
        zi = xs[idx[i]] / temperature
        if zi > zmax:
            zmax = zi
    tot = 0.0
    for i in range(base, base + n):
        tot += math.exp(xs[idx[i]] / temperature - zmax)
    target = rng_uniform(rng) * tot
    cum = 0.0
    for i in range(base, base + n):
        cum += math.exp(xs[idx[i]] / temperature - zmax)
        if cum > target:
            return idx[i]
    return idx[base + n - 1]


def choose(logits, p: SamplingParams, history, n_hist: int, rng, scratch: SampleScratch) -> int:
    """The token `sample` picks under `p`, the plain greedy case (temperature 0, no penalty) through numpy's
    vectorised arg max, which returns the first of the maxima as sample's loop does: over Qwen's 248,320 logits 0.034
    ms against 0.23 on the 2-core VM, most of a token's sampling, a step's sampling being one per sequence. Logits
    with a NaN go through `sample` (its loop passes NaN by; numpy's arg max would pick the first)."""
    if p.temperature == 0.0 and not _penalises(n_hist, p.repeat_penalty, p.presence_penalty, p.frequency_penalty):
        t = int(np.argmax(logits))
        if not np.isnan(logits[t]):
            return t
    return int(sample(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.presence_penalty,
                      p.frequency_penalty, history, n_hist, p.repeat_last_n, rng, scratch.xs, scratch.idx))


def warmup() -> None:
    V = 16
    sc = SampleScratch(V)
    lg = np.linspace(-1, 1, V).astype(np.float32)
    hist = np.arange(4, dtype=np.int32)
    rng = rng_new(0)
    for tk in (0, 4):
        sample(lg, 0.8, tk, 0.9, 0.05, 1.1, 0.1, 0.2, hist, 4, 64, rng, sc.xs, sc.idx)

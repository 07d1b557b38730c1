"""The vision tower's row-wise work on the CPU (backends/cpu/vision.py): LayerNorm, the two GELUs, the attention's
softmax and the rotary embedding, as numba kernels over a range of rows, run on `RowPool`'s threads. The tower now
runs all but the softmax in the SIMD library's C twins of these kernels (native/simd/vrows.c, on its own pool, whose
hand-over costs microseconds where RowPool's cost a millisecond on 16 threads); the kernels here stay as the
definition those twins are held to bit for bit (tests/test_simd_vrows.py).

Why not numpy or numba's own `parallel=True`: numpy's ufuncs run on one core and make a pass (and often a
temporary) per operation; numba's OpenMP threads spin for milliseconds after each kernel, and the tower alternates
kernels with OpenBLAS products (whose idle threads spin too), so on a machine with as many cores as threads each
hand-over stalled for a scheduler slice (2026-11-28, 2-core EPYC: attention in blocks ran 10x slower). The kernels
here release the GIL and the pool's threads sleep between calls.

Numerics are the reference's (backends/vision.py) to float32 rounding: LayerNorm's statistics in float64, the erf
GELU in float64. exp is a vectorizable float32 exp (Cephes' expf: range reduction by ln 2, a degree-6 polynomial,
the power of two built in the exponent bits; within 2 ulp), since libm's scalar expf made the softmax the tower's
largest non-product cost; the tanh GELU is written with it as x·sigmoid(2u), the same function as 0.5x(1+tanh u).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_F = np.float32
_LOG2E, _LN2_HI, _LN2_LO = _F(1.44269504088896341), _F(0.693359375), _F(-2.12194440e-4)
_EXP_LO, _EXP_HI = _F(-87.0), _F(88.0)  # 2^n stays a normal float32 (n in [-126, 127])
_P0, _P1, _P2 = _F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3)
_P3, _P4, _P5 = _F(4.1665795894e-2), _F(1.6666665459e-1), _F(5.0000001201e-1)
_ONE, _HALF, _TWO, _ZERO = _F(1), _F(0.5), _F(2), _F(0)
_GELU_C, _GELU_A = _F(math.sqrt(2.0 / math.pi)), _F(0.044715)
_KW = {"nogil": True, "cache": True, "error_model": "numpy"}


@intrinsic
def _f32_from_bits(typingctx, bits):
    if bits != types.int32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@numba.njit(inline="always", error_model="numpy")  # IEEE division: no zero check to stop vectorizing
def exp32(x):
    """e^x in float32 for x in [-87, 88] (clamped outside: e^-87 ~ 1.6e-38 stands in for smaller values)."""
    x = min(max(x, _EXP_LO), _EXP_HI)
    n = np.floor(x * _LOG2E + _HALF)
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO
    p = (((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5) * (r * r) + r + _ONE
    return p * _f32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


@numba.njit(fastmath={"reassoc"}, **_KW)
def _sum32(row):  # reassociated: vectorized partial sums (the order is rounding-level, as any BLAS's)
    t = _ZERO
    for j in range(row.shape[0]):
        t += row[j]
    return t


@numba.njit(**_KW)
def exp_vec(x, out):
    """out = exp32(x) (what the tests hold to float64's exp)."""
    for j in range(x.shape[0]):
        out[j] = exp32(x[j])


@numba.njit(**_KW)
def softmax_rows(sc, scale):
    """Each row in place: softmax(row · scale), max-subtracted (max(row)·scale is the max of the scaled row:
    rounding is monotonic)."""
    for r in range(sc.shape[0]):
        row = sc[r]
        m = row[0]
        for j in range(1, row.shape[0]):
            m = max(m, row[j])
        m = m * scale
        for j in range(row.shape[0]):
            row[j] = exp32(row[j] * scale - m)
        t = _sum32(row)
        for j in range(row.shape[0]):
            row[j] = row[j] / t


@numba.njit(**_KW)
def layer_norm_rows(x, out, w, b, eps):
    """out = (x - mean) / sqrt(var + eps) with the statistics in float64, rounded, then · w + b in float32."""
    c = x.shape[1]
    for r in range(x.shape[0]):
        row, o = x[r], out[r]
        s = 0.0
        for j in range(c):
            s += row[j]
        mu = s / c
        v = 0.0
        for j in range(c):
            d = row[j] - mu
            v += d * d
        sd = math.sqrt(v / c + eps)
        for j in range(c):
            o[j] = np.float32((row[j] - mu) / sd) * w[j] + b[j]


@numba.njit(**_KW)
def gelu_tanh_rows(x, out, bias):
    """out = gelu(x + bias) (out may be x): 0.5 v (1 + tanh(u)), u = sqrt(2/pi) (v + 0.044715 v³), computed as
    v / (1 + e^(-2u))."""
    for r in range(x.shape[0]):
        row, o = x[r], out[r]
        for j in range(row.shape[0]):
            v = row[j] + bias[j]
            u = (_GELU_A * v * v * v + v) * _GELU_C
            o[j] = v / (_ONE + exp32(-_TWO * u))


@numba.njit(**_KW)
def gelu_erf_rows(x, out, bias):
    """out = v/2 (1 + erf(v/sqrt 2)), v = x + bias, in float64, rounded (the reference's, torch's nn.GELU())."""
    for r in range(x.shape[0]):
        row, o = x[r], out[r]
        for j in range(row.shape[0]):
            xd = np.float64(row[j] + bias[j])
            o[j] = np.float32(0.5 * xd * (1.0 + math.erf(xd * 0.7071067811865476)))


@numba.njit(**_KW)
def rope_heads(start, stop, qkv, cos, sin, qh, kt, vh):
    """Rows [start, stop) of qkv [rows, 3, heads, head_dim] laid out for the attention's products: qh, vh [heads,
    rows, head_dim] and kt [heads, head_dim, rows], q and k rotated: x · cos + rotate_half(x) · sin (NeoX halves;
    the model's `rotate`, op for op)."""
    half = qkv.shape[3] // 2
    for i in range(start, stop):
        c, s = cos[i], sin[i]
        for h in range(qkv.shape[2]):
            a, b, o = qkv[i, 0, h], qkv[i, 1, h], qh[h, i]
            for d in range(half):
                o[d] = a[d] * c[d] + -a[d + half] * s[d]
                kt[h, d, i] = b[d] * c[d] + -b[d + half] * s[d]
            for d in range(half, a.shape[0]):
                o[d] = a[d] * c[d] + a[d - half] * s[d]
                kt[h, d, i] = b[d] * c[d] + b[d - half] * s[d]
            vh[h, i, :] = qkv[i, 2, h]


class RowPool:
    """Runs a kernel over ranges of rows on `n_threads` threads: the caller's and n_threads - 1 others (which sleep
    between calls). `chunks` ranges (default: one a thread) are taken in turn by whichever thread is free, so a
    thread the machine's other work holds back takes fewer (the attention's products ask for two a thread)."""

    def __init__(self, n_threads: int):
        self.n = max(1, int(n_threads))
        self._ex = ThreadPoolExecutor(self.n - 1, thread_name_prefix="vision-rows") if self.n > 1 else None

    def run(self, kernel, rows: tuple, *args, chunks: int | None = None) -> None:
        """kernel(*(a[s:e] for a in rows), *args) for row ranges [s, e) covering rows[0]'s first axis."""
        self._split(rows[0].shape[0], lambda s, e: kernel(*(a[s:e] for a in rows), *args), chunks)

    def run_ranges(self, kernel, n: int, *args, chunks: int | None = None) -> None:
        """kernel(s, e, *args) for ranges [s, e) covering [0, n)."""
        self._split(n, lambda s, e: kernel(s, e, *args), chunks)

    def _split(self, n: int, call, chunks: int | None) -> None:
        k = min(chunks or self.n, n)
        if self._ex is None or k < 2:
            call(0, n)
            return
        cuts = [n * i // k for i in range(k + 1)]
        todo = iter(list(zip(cuts[:-1], cuts[1:], strict=True)))
        lock = threading.Lock()

        def drain():
            while True:
                with lock:
                    r = next(todo, None)
                if r is None:
                    return
                call(*r)

        jobs = [self._ex.submit(drain) for _ in range(min(self.n, k) - 1)]
        try:
            drain()
        finally:
            for j in jobs:
                j.result()

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True)
            self._ex = None

"""llama.cpp's activation quantization for 32-wide weight blocks, as a numpy reference.

llama.cpp multiplies a quantized weight row by an activation row that it first quantizes to its
`vec_dot_type`: Q8_0 for Q4_0/Q5_0/Q8_0 weights, Q8_1 for Q4_1/Q5_1 weights, Q8_K for K-quants, fp16 for
F16 weights. Per 32-value block, as llama.cpp's x86 (AVX/AVX2) build quantizes:
    amax = max |x_i|,  d = amax / 127,  id = 127 / amax (0 if amax = 0)   (float32, two divisions)
    q_i = round_half_even(x_i * id)       (_mm256_round_ps; not roundf: ties go to even)
    stored d = fp16(d) (round to nearest even); Q8_1 also s = fp16(d * sum_i q_i) (d unrounded).
Q8_K (256-value blocks, the rule of every x86 build) is `quantize_q8_K`, shared with actquant_k.
The dot product of weight block (d_w, m_w, q_w) with an activation block is
    Q8_0: d_w * d_a * sum_i q_w,i q_a,i
    Q8_1: d_w * d_a * sum_i q_w,i q_a,i + m_w * s_a
with the integer sums exact. `qmatmul` computes x @ W.T this way; the per-block integer sums are formed
by float32 matmuls of integer-valued arrays, exact because |sum| <= 32 * 31 * 127 < 2^24; its float sum
over blocks is numpy's. `qmatmul_ggml` adds the block terms in the order of ggml's AVX2 kernels (8 lanes
of 4 values, one fused multiply-add per lane and block, emulated exactly), which reproduces llama.cpp's
float32 results bit for bit; the native kernels (native/simd) are tested against both.
"""

from __future__ import annotations

import numpy as np

from ..format.quant import SUPPORTED_TYPES
from ..format.quant_types import ACT_FORMATS, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TYPES  # noqa: F401
from .actquant_k import fma32, quantize_q8_K  # noqa: F401  (Q8_K: one implementation, re-exported here)

QK = 32
# the 32-wide weight types, multiplied by Q8_0 or Q8_1 activations: type -> (bytes per block, activation format)
LEGACY = {q: (t.nbytes, t.act) for q, t in TYPES.items() if t.act in ("q8_0", "q8_1")}


def quantize_q8(x: np.ndarray, with_sum: bool, ref: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """x (T, D) float32, D % 32 == 0 -> (q (T, D/32, 32) float32 holding int8 values, d (T, D/32) float32
    (fp16-rounded), s (T, D/32) float32 (fp16-rounded d*sum q) or None). ref: as ggml built without AVX
    (quantize_row_q8_0_ref / q8_1_ref): id = 1 / d and roundf (half away from zero)."""
    T, D = x.shape
    xb = x.reshape(T, D // QK, QK).astype(np.float32)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        if ref:
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        else:
            inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    v = (xb * inv[..., None]).astype(np.float32)
    if ref:  # roundf: |v| + 0.5 is exact in float64
        q = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.float32)
    else:
        q = np.rint(v).astype(np.float32)  # round half to even, as _mm256_round_ps
    s = None
    if with_sum:
        s = (q.sum(axis=-1) * d).astype(np.float16).astype(np.float32)
    return q, d.astype(np.float16).astype(np.float32), s


_ACT_BLOCK = {k: (a.block, a.nbytes) for k, a in ACT_FORMATS.items() if k.startswith("q8")}


def quantize_act(x: np.ndarray, kind: str, ref: bool = False) -> np.ndarray:
    """Activation rows x (T, n) float32 -> their bytes (T, row bytes) in ggml's layout for `kind`:
    "q8_0" / "q8_1" (block_q8_0 / block_q8_1), "q8_K", "f16" (fp16, round to nearest even) or "f32".
    ref: Q8_0 / Q8_1 as ggml built without AVX quantizes them (`quantize_q8`)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None]
    T, n = x.shape
    if kind == "f32":
        return np.ascontiguousarray(x).view(np.uint8).reshape(T, 4 * n)
    if kind == "f16":
        return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(T, 2 * n)
    if kind == "q8_K":
        return quantize_q8_K(x)
    if kind not in ("q8_0", "q8_1"):
        raise ValueError(f"unknown activation kind {kind!r}")
    q, d, s = quantize_q8(x, with_sum=kind == "q8_1", ref=ref)
    nb = n // QK
    bb = _ACT_BLOCK[kind][1]
    out = np.empty((T, nb, bb), np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    if s is not None:
        out[..., 2:4] = s.astype(np.float16)[..., None].view(np.uint8)
    out[..., bb - 32:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(T, nb * bb)


def unpack_act(xq: np.ndarray, kind: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q8_0 / Q8_1 activation bytes (T, row bytes) -> q (T, n/32, 32) float32 (int values), d (T, n/32)
    float32, s (T, n/32) float32 or None."""
    bb = _ACT_BLOCK[kind][1]
    b = np.ascontiguousarray(xq, dtype=np.uint8).reshape(-1, n // QK, bb)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    s = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "q8_1" else None
    q = b[..., bb - 32:].copy().view(np.int8).astype(np.float32)
    return q, d, s


def weight_ints(raw: np.ndarray, qtype: int, rows: int, cols: int):
    """Integer quants (rows, cols/32, 32) float32 and block scale d, min m (rows, cols/32) float32 (m None
    for symmetric types), decoded from raw blocks."""
    bb = LEGACY[qtype][0]
    nb = cols // QK
    b = raw.reshape(rows, nb, bb)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = None
    if qtype in (Q4_1, Q5_1):
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == Q8_0:
        return b[..., 2:].copy().view(np.int8).astype(np.float32), d, None
    off = 4 if qtype in (Q4_1, Q5_1) else 2
    if qtype in (Q5_0, Q5_1):
        qh = b[..., off : off + 4].copy().view(np.uint32)[..., 0]
        off += 4
    qs = b[..., off : off + 16]
    lo, hi = (qs & 0x0F).astype(np.int32), (qs >> 4).astype(np.int32)
    q = np.concatenate([lo, hi], axis=-1)  # element j < 16 from low nibbles, j >= 16 from high
    if qtype in (Q5_0, Q5_1):
        bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        q = q | (bits.astype(np.int32) << 4)
    if qtype == Q4_0:
        q = q - 8
    elif qtype == Q5_0:
        q = q - 16
    return q.astype(np.float32), d, m


def supports(qtype: int) -> bool:
    return qtype in LEGACY


def qmatmul(x: np.ndarray, raw: np.ndarray, qtype: int, rows: int, cols: int, row_chunk: int = 4096) -> np.ndarray:
    """x (T, cols) @ W.T for a weight W (rows, cols) stored as `qtype` blocks, with llama.cpp's
    activation quantization. Returns (T, rows) float32."""
    if qtype not in LEGACY:
        raise ValueError(f"qmatmul has no activation-quantized path for ggml type {qtype} "
                         f"(supported: {sorted(LEGACY)}; others in {sorted(SUPPORTED_TYPES)})")
    xq, xd, xs = quantize_q8(x, with_sum=LEGACY[qtype][1] == "q8_1")
    T, nb = xd.shape
    xq_b = np.ascontiguousarray(xq.transpose(1, 0, 2))  # (nb, T, 32)
    out = np.empty((T, rows), np.float32)
    bb = LEGACY[qtype][0]
    flat = raw.reshape(rows, nb * bb)
    for r0 in range(0, rows, row_chunk):
        r1 = min(rows, r0 + row_chunk)
        wq, wd, wm = weight_ints(flat[r0:r1], qtype, r1 - r0, cols)
        sumi = np.matmul(xq_b, wq.transpose(1, 2, 0))  # (nb, T, R) exact integers
        acc = np.einsum("btr,rb,tb->tr", sumi, wd, xd, dtype=np.float32)
        if wm is not None:
            acc += xs @ wm.T
        out[:, r0:r1] = acc
    return out


def qmatmul_ggml(xq: np.ndarray, raw: np.ndarray, qtype: int, rows: int, cols: int) -> np.ndarray:
    """x @ W.T from activation rows already quantized (xq: (T, row bytes) Q8_0/Q8_1 as `quantize_act`
    gives), with the float operations of ggml's AVX2 vec_dot kernels, so the float32 result equals
    llama.cpp's bit for bit:
        lane_k = sum_{j=4k}^{4k+3} q_w,j q_a,j   (exact; k = 0..7 over the 32 values of a block)
        acc_k = fma(d_w * d_a, lane_k, acc_k)    over the blocks of the row, in order
        summs = fma(m_w, s_a, summs)             (Q4_1 / Q5_1)
        row = ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7)) [+ summs]
    Vectorized over rows, tokens and lanes; one Python step per block. Returns (T, rows) float32."""
    if qtype not in LEGACY:
        raise ValueError(f"qmatmul_ggml has no path for ggml type {qtype} (supported: {sorted(LEGACY)})")
    kind = LEGACY[qtype][1]
    qa, da, sa = unpack_act(xq, kind, cols)
    wq, wd, wm = weight_ints(np.ascontiguousarray(raw).reshape(-1), qtype, rows, cols)
    T, nb = da.shape
    lanes = np.einsum("tbkj,rbkj->btrk", qa.reshape(T, nb, 8, 4).astype(np.float64),
                      wq.reshape(rows, nb, 8, 4).astype(np.float64)).astype(np.float32)  # exact integers
    acc = np.zeros((T, rows, 8), np.float32)
    summs = np.zeros((T, rows), np.float32)
    for b in range(nb):
        dd = (wd[None, :, b] * da[:, b, None]).astype(np.float32)  # (T, rows), one float product
        acc = fma32(dd[..., None], lanes[b], acc)
        if wm is not None:
            summs = fma32(wm[None, :, b], sa[:, b, None], summs)
    a = acc
    r = ((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + ((a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7]))
    if wm is not None:
        r = r + summs
    return r.astype(np.float32)


def qmatmul_generic(xq: np.ndarray, raw: np.ndarray, qtype: int, rows: int, cols: int,
                    ssse3: bool = False) -> np.ndarray:
    """x @ W.T with the float operations of ggml built without AVX (the generic loops of quants.c, one float
    sum per row, a product then a sum, no FMA):
        Q4_0  sumf += (isum * dx) * dy      Q5_0  sumf += (dx * dy) * isum      Q8_0  sumf += isum * (dx * dy)
        Q4_1, Q5_1  sumf += (dx * dy) * isum + mx * sy
    ssse3: Q4_0 as its SSSE3 path (pairs of blocks, 4 accumulators of 4 lanes of 4 values, hsum_float_4x4,
    an odd last block generic). Returns (T, rows) float32."""
    if qtype not in LEGACY:
        raise ValueError(f"qmatmul_generic has no path for ggml type {qtype} (supported: {sorted(LEGACY)})")
    f = np.float32
    qa, da, sa = unpack_act(xq, LEGACY[qtype][1], cols)
    wq, wd, wm = weight_ints(np.ascontiguousarray(raw).reshape(-1), qtype, rows, cols)
    T, nb = da.shape
    isum = np.einsum("tbj,rbj->btr", qa.astype(np.float64), wq.astype(np.float64)).astype(f)  # exact
    out = np.zeros((T, rows), f)
    b0 = 0
    if qtype == Q4_0 and ssse3:
        lanes = np.einsum("tbhkj,rbhkj->bthrk", qa.reshape(T, nb, 2, 4, 4).astype(np.float64),
                          wq.reshape(rows, nb, 2, 4, 4).astype(np.float64)).astype(f)  # (nb, T, 2, rows, 4)
        acc = np.zeros((4, T, rows, 4), f)
        for b in range(0, nb - 1, 2):
            for k in range(2):
                dd = (wd[None, :, b + k] * da[:, b + k, None]).astype(f)[..., None]
                for h in range(2):
                    acc[2 * k + h] = (dd * lanes[b + k, :, h] + acc[2 * k + h]).astype(f)
        # hsum_float_4x4: hadd(a, b), hadd(c, d), hadd of those, then hadd twice more
        p = [((a[..., 0] + a[..., 1]).astype(f), (a[..., 2] + a[..., 3]).astype(f)) for a in acc]
        s = [(x0 + x1).astype(f) for x0, x1 in p]
        out = ((s[0] + s[1]).astype(f) + (s[2] + s[3]).astype(f)).astype(f)
        b0 = nb - nb % 2
    for b in range(b0, nb):
        dx, dy = wd[None, :, b], da[:, b, None]
        if qtype == Q4_0:
            t = ((isum[b] * dx).astype(f) * dy).astype(f)
        elif qtype == Q5_0:
            t = ((dx * dy).astype(f) * isum[b]).astype(f)
        elif qtype == Q8_0:
            t = (isum[b] * (dx * dy).astype(f)).astype(f)
        else:
            t = (((dx * dy).astype(f) * isum[b]).astype(f) + (wm[None, :, b] * sa[:, b, None]).astype(f)).astype(f)
        out = (out + t).astype(f)
    return out

"""llama.cpp's K-quant matrix-vector arithmetic (Q4_K, Q5_K, Q6_K weights x Q8_K activations) in numpy.

The reference for the C kernels of native/simd/dot_kquants.h, and through them for llama.cpp itself.

Activations. llama.cpp quantizes each 256-value block of an activation row to Q8_K
(`quantize_row_q8_K_ref`): with `max` the first value of largest magnitude,
    iscale = -127 / max (float32),  q_j = round_half_even(iscale * x_j) (at most 127; ggml's
    magic-number rounding, which also fixes what blocks of subnormals or non-finite values give),
    d = 1 / iscale (float32),       bsums[g] = sum of q over the 16 values of group g;
an all-zero block stores d = 0 and q = 0 (ggml leaves its bsums unwritten; here they are 0).
Bytes per block: d (float32), q (256 int8), bsums (16 int16) = 292.

Dot products. Per super-block the integer sums are exact; their float treatment follows ggml's AVX2
kernels (what llama.cpp runs on x86 hosts with AVX2 or better), so this reference reproduces their
float32 result bit for bit:
  - the block's weighted integer sum is kept in 8 lanes: lane k = sum over the block's eight 32-value
    groups of sc * (sum of the 4 products q * q8 at positions 4k..4k+3 of the group), sc the scale of the
    sub-block those 4 values belong to (32 wide in Q4_K/Q5_K, 16 wide in Q6_K). Q6_K's quants enter
    unsigned (0..63); the -32 offset is taken out per lane afterwards through the activation sums:
    lane k -= 32 * (sc[2k] bsums[2k] + sc[2k+1] bsums[2k+1]);
  - acc[k] = fma(D*d, lane k, acc[k]) over the blocks of the row, D*d rounded to float32 first;
  - Q4_K mins: 4 lanes, lane k = m[2k] B[2k] + m[2k+1] B[2k+1] with B[s] = bsums[2s] + bsums[2s+1],
    accm[k] = fma(-D*dmin, lane k, accm[k]); Q5_K mins: one sum, summs = fma(-D*dmin, sum_s m[s] B[s], summs);
  - result = ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7))  [+ (accm0+accm2) + (accm1+accm3)
    for Q4_K | + summs for Q5_K].
The fused multiply-adds are emulated exactly (float64 product, error-free sum, round-to-odd, then one
rounding to float32). The lane sums are formed for all rows, tokens and blocks at once by float64
matrix products of integer-valued arrays (exact: every partial sum is an integer below 2^53); the one
Python loop runs along the row (n/256 steps, each over all rows, tokens and lanes), because the
order of the float accumulation over a row's blocks is part of the result.

`kquant_matmul_q8_generic` is the same product in the float order of ggml's generic kernels (llama.cpp
built without AVX; no fused multiply-adds), the reference of the SSSE3 and scalar C paths.
"""

from __future__ import annotations

import numpy as np

Q4_K, Q5_K, Q6_K = 12, 13, 14
QK_K = 256
Q8K_BYTES = 292
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}

_Q8K = np.dtype([("d", "<f4"), ("qs", "i1", (QK_K,)), ("bsums", "<i2", (QK_K // 16,))])
assert _Q8K.itemsize == Q8K_BYTES


# ------------------------------------------------------------------------------------------------
# activations


def quantize_q8_K(x: np.ndarray) -> np.ndarray:
    """x (T, n) float32, n % 256 == 0 -> Q8_K blocks as raw bytes (T, n/256*292), as ggml's
    `quantize_row_q8_K` writes them (the bsums of an all-zero block are 0)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None]
    T, n = x.shape
    if n % QK_K:
        raise ValueError(f"Q8_K rows must hold whole 256-value blocks, not {n} values")
    nb = n // QK_K
    xb = x.reshape(T, nb, QK_K)
    ax = np.abs(xb)
    ax[np.isnan(ax)] = 0  # ggml's strict `>` scan never picks a NaN
    idx = ax.argmax(axis=-1)  # the first index of the largest magnitude, as that scan finds it
    mx = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]
    zero = mx == 0
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        iscale = np.float32(-127.0) / np.where(zero, np.float32(1), mx)  # -inf for subnormal blocks, as in ggml
        d = np.float32(1.0) / iscale
        # ggml's nearest_int: the float32 sum with 1.5 * 2^23 leaves round-half-even(v) in the low mantissa bits
        # (and the same garbage as ggml for inf / nan); MIN(127, .) and the store to int8 as in C
        v = (xb * iscale[..., None]) + np.float32(12582912.0)
    i = (v.view(np.int32) & 0x007FFFFF) - 0x00400000
    q = np.minimum(i, 127).astype(np.int8)
    q[zero] = 0
    d[zero] = 0
    out = np.empty((T, nb), dtype=_Q8K)
    out["d"] = d
    out["qs"] = q
    out["bsums"] = q.reshape(T, nb, 16, 16).sum(axis=-1, dtype=np.int16)
    return out.view(np.uint8).reshape(T, nb * Q8K_BYTES)


def unpack_q8_K(raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_K bytes (T, n/256*292) -> d (T, nb) float32, q (T, nb, 256) int8, bsums (T, nb, 16) int16."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, n // QK_K * Q8K_BYTES)
    b = raw.view(_Q8K)
    return b["d"].copy(), b["qs"].copy(), b["bsums"].copy()


# ------------------------------------------------------------------------------------------------
# weights: integer quants, per-value scales, block scales


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    return b[..., off:off + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _scales_mins_k4(s12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., 12) packed bytes -> six-bit scales and mins (..., 8) int32 (ggml's get_scale_min_k4)."""
    s = s12.astype(np.int32)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def weight_terms(raw: np.ndarray, qtype: int, rows: int, cols: int):
    """Decode K-quant blocks: (A, d, dmin, aux) with
    A (rows, nb, 256) int32: scale * quant of every value (Q6_K: the unsigned quant 0..63), so that the
        block's weighted sum against activation quants q8 is sum_j A[j] q8[j] (Q6_K: minus the offset term);
    d, dmin (rows, nb) float32 (dmin None for Q6_K);
    aux (rows, nb, 8) int32 mins for Q4_K/Q5_K, (rows, nb, 16) int32 sub-block scales for Q6_K."""
    bb = BLOCK_BYTES[qtype]
    nb = cols // QK_K
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, nb, bb)
    if qtype == Q6_K:
        ql = b[..., 0:128].reshape(rows, nb, 2, 1, 64)
        qh = b[..., 128:192].reshape(rows, nb, 2, 1, 32)
        sc = b[..., 192:208].view(np.int8).astype(np.int32)
        lo = (ql >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15  # (r, nb, 2 halves, 2, 64)
        hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3  # (r, nb, 2, 4, 32)
        q = lo.reshape(rows, nb, 2, 4, 32).astype(np.int32) | (hi.astype(np.int32) << 4)
        A = q.reshape(rows, nb, 16, 16) * sc[..., None]
        return A.reshape(rows, nb, QK_K), _f16(b, 208), None, sc
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scales_mins_k4(b[..., 4:16])
    qs = b[..., 16:144] if qtype == Q4_K else b[..., 48:176]
    qs = qs.reshape(rows, nb, 4, 1, 32)
    q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15).astype(np.int32).reshape(rows, nb, 8, 32)
    if qtype == Q5_K:
        qh = b[..., 16:48].reshape(rows, nb, 1, 32)
        q |= ((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1).astype(np.int32) << 4
    A = q * sc[..., None]
    return A.reshape(rows, nb, QK_K), d, dmin, mn


# ------------------------------------------------------------------------------------------------
# exact float32 fused multiply-add


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c) = round(a*b + c) with one rounding, for float32 a, b, c (broadcasting).

    a*b is exact in float64; s = a*b + c rounded to float64 with its exact error e (TwoSum); where e != 0,
    s is moved to the float64 neighbour of odd significand on the side of the exact sum (round to odd),
    after which rounding to float32 is correct (53 >= 24 + 2)."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    bv = s - p
    e = (p - (s - bv)) + (c - bv)
    bits = s.view(np.int64)
    inexact = e != 0
    toward_zero = inexact & ((e < 0) != (s < 0))  # exact sum smaller in magnitude than s
    bits = bits - toward_zero.astype(np.int64)
    bits |= inexact.astype(np.int64)
    return bits.view(np.float64).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# matrix product


def kquant_matmul(x: np.ndarray, raw: np.ndarray, qtype: int, rows: int, cols: int,
                  row_chunk: int | None = None) -> np.ndarray:
    """x (T, cols) @ W.T for W (rows, cols) stored as Q4_K / Q5_K / Q6_K blocks in `raw`, as llama.cpp
    computes it: x quantized to Q8_K, then ggml's per-block formula. Returns (T, rows) float32."""
    x = np.asarray(x, np.float32)
    if x.ndim == 1:
        x = x[None]
    if x.shape[1] != cols:
        raise ValueError(f"x has {x.shape[1]} columns; the weight has {cols}")
    _check(qtype, cols)
    return kquant_matmul_q8(quantize_q8_K(x), raw, qtype, rows, cols, row_chunk)


def _check(qtype: int, cols: int) -> None:
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"kquant_matmul handles ggml types {sorted(BLOCK_BYTES)} (Q4_K, Q5_K, Q6_K), not {qtype}")
    if cols % QK_K:
        raise ValueError(f"K-quant rows hold whole 256-value blocks, not {cols} values")


def kquant_matmul_q8(y: np.ndarray, raw: np.ndarray, qtype: int, rows: int, cols: int,
                     row_chunk: int | None = None) -> np.ndarray:
    """As `kquant_matmul`, from activations already quantized: y (T, cols/256*292) Q8_K bytes."""
    _check(qtype, cols)
    nb = cols // QK_K
    D, q8, bs = unpack_q8_K(y, cols)
    T = D.shape[0]
    # (nb, 8 lanes, 32 = group x position-in-quad, T): the activation quants grouped by lane
    q8l = np.ascontiguousarray(q8.reshape(T, nb, 8, 8, 4).transpose(1, 3, 2, 4, 0).reshape(nb, 8, 32, T),
                               dtype=np.float64)
    B = (bs[..., 0::2].astype(np.int64) + bs[..., 1::2])  # (T, nb, 8): bsums per 32-value sub-block
    flat = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, nb * BLOCK_BYTES[qtype])
    if row_chunk is None:
        row_chunk = max(1, (1 << 22) // (nb * QK_K))  # A in float64: ~32 MB a chunk
    out = np.empty((T, rows), np.float32)
    for r0 in range(0, rows, row_chunk):
        r1 = min(rows, r0 + row_chunk)
        R = r1 - r0
        A, d, dmin, mn = weight_terms(flat[r0:r1], qtype, R, cols)
        Al = np.ascontiguousarray(A.reshape(R, nb, 8, 8, 4).transpose(1, 3, 0, 2, 4).reshape(nb, 8, R, 32),
                                  dtype=np.float64)
        lanes = np.matmul(Al, q8l)  # (nb, 8, R, T), exact integers
        if qtype == Q6_K:  # the -32 offset: lane k -= 32 (sc[2k] bsums[2k] + sc[2k+1] bsums[2k+1])
            lanes -= 32 * np.einsum("rbkj,tbkj->bkrt", mn.reshape(R, nb, 8, 2),
                                    bs.reshape(T, nb, 8, 2).astype(np.int64)).astype(np.float64)
        lanes = lanes.astype(np.float32)  # rounds like ggml's int32 -> float conversion
        dd = D.T[:, None, :] * d.T[:, :, None]  # (nb, R, T) float32: y.d * x.d
        acc = np.zeros((8, R, T), np.float32)
        if qtype == Q4_K:
            Bp = B.reshape(T, nb, 4, 2)
            mp = mn.reshape(R, nb, 4, 2)
            mlanes = np.einsum("rbkj,tbkj->bkrt", mp, Bp).astype(np.float32)  # (nb, 4, R, T)
            dm = -D.T[:, None, :] * dmin.T[:, :, None]
            accm = np.zeros((4, R, T), np.float32)
        elif qtype == Q5_K:
            msum = np.einsum("rbs,tbs->brt", mn.astype(np.int64), B).astype(np.float32)  # (nb, R, T)
            dm = -D.T[:, None, :] * dmin.T[:, :, None]
            summs = np.zeros((R, T), np.float32)
        for b in range(nb):
            acc = fma32(dd[b], lanes[b], acc)
            if qtype == Q4_K:
                accm = fma32(dm[b], mlanes[b], accm)
            elif qtype == Q5_K:
                summs = fma32(dm[b], msum[b], summs)
        res = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
        if qtype == Q4_K:
            res = res + ((accm[0] + accm[2]) + (accm[1] + accm[3]))
        elif qtype == Q5_K:
            res = res + summs
        out[:, r0:r1] = res.T
    return out


def kquant_matmul_q8_generic(y: np.ndarray, raw: np.ndarray, qtype: int, rows: int, cols: int,
                             row_chunk: int | None = None) -> np.ndarray:
    """As `kquant_matmul_q8`, in the float order of ggml's generic kernels (ggml_vec_dot_q*_K_q8_K_generic:
    what llama.cpp runs when built without AVX, its SSE4.2 and baseline x86-64 builds, with no FMA), the
    reference of the SSSE3 and scalar C paths:
      - 8 integer lanes per block, lane l = sum over the block's values e with e % 8 == l of
        sc(e) * a[e] * q8[e] (Q6_K: a = q - 32), sc(e) the scale of e's sub-block;
      - sums[l] = sums[l] + (D*d) * lane l, over the blocks: a float32 product, then a float32 sum;
      - Q4_K, Q5_K: sumf = sumf - (D*dmin) * sum_s m[s] B[s], per block, sumf starting at 0;
      - result: sumf = sumf + sums[l] for l = 0..7 in turn."""
    _check(qtype, cols)
    nb = cols // QK_K
    D, q8, bs = unpack_q8_K(y, cols)
    T = D.shape[0]
    q8l = np.ascontiguousarray(q8.reshape(T, nb, 32, 8).transpose(1, 3, 2, 0), dtype=np.float64)  # (nb, 8, 32, T)
    B = bs[..., 0::2].astype(np.int64) + bs[..., 1::2]  # (T, nb, 8): bsums per 32-value sub-block
    flat = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, nb * BLOCK_BYTES[qtype])
    if row_chunk is None:
        row_chunk = max(1, (1 << 22) // (nb * QK_K))
    out = np.empty((T, rows), np.float32)
    for r0 in range(0, rows, row_chunk):
        r1 = min(rows, r0 + row_chunk)
        R = r1 - r0
        A, d, dmin, aux = weight_terms(flat[r0:r1], qtype, R, cols)
        A = A.astype(np.int64)
        if qtype == Q6_K:  # signed quants: sc * (q - 32)
            A -= 32 * np.repeat(aux, 16, axis=-1)
        Al = np.ascontiguousarray(A.reshape(R, nb, 32, 8).transpose(1, 3, 0, 2), dtype=np.float64)  # (nb, 8, R, 32)
        lanes = np.matmul(Al, q8l).astype(np.float32)  # (nb, 8, R, T): exact integers, rounded as int -> float
        dd = D.T[:, None, :] * d.T[:, :, None]  # (nb, R, T) float32: y.d * x.d
        sums = np.zeros((8, R, T), np.float32)
        sumf = np.zeros((R, T), np.float32)
        if dmin is not None:
            dm = D.T[:, None, :] * dmin.T[:, :, None]
            imin = np.einsum("rbs,tbs->brt", aux.astype(np.int64), B).astype(np.float32)  # (nb, R, T)
        for b in range(nb):
            sums = sums + dd[b] * lanes[b]
            if dmin is not None:
                sumf = sumf - dm[b] * imin[b]
        for lane in sums:
            sumf = sumf + lane
        out[:, r0:r1] = sumf.T
    return out

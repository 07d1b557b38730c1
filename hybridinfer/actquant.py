"""llama.cpp's activation quantization for 32-wide weight blocks, as a numpy reference.

llama.cpp multiplies a quantized weight row by an activation row that it first quantizes to its
`vec_dot_type`: Q8_0 for Q4_0/Q5_0/Q8_0 weights, Q8_1 for Q4_1/Q5_1 weights. Per 32-value block:
    d = amax / 127  (float32; stored as fp16),  q_i = roundf(x_i / d)  (computed as x_i * (1/d)),
    Q8_1 also stores s = fp16(d * sum_i q_i).
and the dot product of weight block (d_w, m_w, q_w) with it is
    Q8_0: d_w * d_a * sum_i q_w,i q_a,i
    Q8_1: d_w * d_a * sum_i q_w,i q_a,i + m_w * s_a
with the integer sums exact. `qmatmul` computes x @ W.T this way; the per-block integer sums are formed
by float32 matmuls of integer-valued arrays, exact because |sum| <= 32 * 31 * 127 < 2^24.
"""

from __future__ import annotations

import numpy as np

from .quant import SUPPORTED_TYPES

# ggml type ids
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
QK = 32
LEGACY = {Q4_0: (18, "q8_0"), Q4_1: (20, "q8_1"), Q5_0: (22, "q8_0"), Q5_1: (24, "q8_1"), Q8_0: (34, "q8_0")}


def quantize_q8(x: np.ndarray, with_sum: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """x (T, D) float32, D % 32 == 0 -> (q (T, D/32, 32) float32 holding int8 values, d (T, D/32) float32
    (fp16-rounded), s (T, D/32) float32 (fp16-rounded d*sum q) or None)."""
    T, D = x.shape
    xb = x.reshape(T, D // QK, QK).astype(np.float32)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = xb * inv[..., None]
    q = np.where(v >= 0, np.floor(v + np.float32(0.5)), np.ceil(v - np.float32(0.5))).astype(np.float32)  # roundf
    s = None
    if with_sum:
        s = (q.sum(axis=-1) * d).astype(np.float16).astype(np.float32)
    return q, d.astype(np.float16).astype(np.float32), s


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

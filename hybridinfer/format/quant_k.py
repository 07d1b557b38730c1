"""K-quant block formats (super-blocks of 256 weights): Q4_K, Q5_K, Q6_K.

Private helpers of `hybridinfer.format.quant`, which is the public entry point. Each `deq_*` fills `out`
(n_blocks, 256) float32 from `blk` (n_blocks, block_bytes) uint8, using the `scratch` buffers of
`quant._Scratch`; the float32 operation order is the one of `gguf.quants`, so results are bit-equal.
Each `fill_*` overwrites the scale fields of random bytes so that the blocks dequantize to weights of
about the requested standard deviation.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
K_SCALE_SIZE = 12
_SH8 = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
_SH_Q6 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _f16(blk: np.ndarray, off: int) -> np.ndarray:
    """The fp16 field at byte `off` of each block, as float32 (n_blocks,)."""
    return blk[:, off:off + 2].view(np.float16)[:, 0].astype(np.float32)


def unpack_scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins packed in 12 bytes (Q4_K, Q5_K): (n, 8) uint8 each.

    byte 0..3  : sc[j]   low 6 bits | (sc[j+4] >> 4) << 6
    byte 4..7  : m[j]    low 6 bits | (m[j+4]  >> 4) << 6
    byte 8..11 : (sc[j+4] & 15) | (m[j+4] & 15) << 4          (j = 0..3)
    """
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 2) & 48)], axis=1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 2) & 48)], axis=1)
    return sc, mn


def pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of `unpack_scale_min_k4`: (n, 8) six-bit values -> (n, 12) bytes."""
    sc = sc.astype(np.uint8) & 63
    mn = mn.astype(np.uint8) & 63
    out = np.empty((sc.shape[0], K_SCALE_SIZE), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _k4_scales(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d * sc, dmin * m) as float32 (n, 8): the per-sub-block scale and offset of Q4_K / Q5_K."""
    d = _f16(blk, 0)[:, None]
    dmin = _f16(blk, 2)[:, None]
    sc, mn = unpack_scale_min_k4(blk[:, 4:16])
    return d * sc.astype(np.float32), dmin * mn.astype(np.float32)


def deq_q4_k(blk: np.ndarray, out: np.ndarray, scratch) -> None:
    """Q4_K, 144 bytes per 256 weights, 8 sub-blocks of 32:
    y[32*s + l] = (d * sc[s]) * q[s][l] - (dmin * m[s])
    d: fp16 @0, dmin: fp16 @2, scales: 12 bytes @4 (six-bit sc, m; see unpack_scale_min_k4),
    qs: 128 bytes @16 in 4 groups of 32; group j holds sub-block 2j in its low nibbles and 2j+1 in its
    high nibbles: q[2j][l] = qs[32j + l] & 15, q[2j+1][l] = qs[32j + l] >> 4.
    """
    n = blk.shape[0]
    ds, dm = _k4_scales(blk)
    qs = blk[:, 16:144].reshape(n, 4, 32)
    t8 = scratch.get("t8", (n, 4, 32), np.uint8)
    tf = scratch.get("tf", (n, 4, 32), np.float32)
    o = out.reshape(n, 4, 2, 32)
    d4 = ds.reshape(n, 4, 2, 1)
    np.bitwise_and(qs, 15, out=t8)
    tf[...] = t8
    np.multiply(d4[:, :, 0], tf, out=o[:, :, 0])
    np.right_shift(qs, 4, out=t8)
    tf[...] = t8
    np.multiply(d4[:, :, 1], tf, out=o[:, :, 1])
    o3 = out.reshape(n, 8, 32)
    np.subtract(o3, dm[:, :, None], out=o3)


def deq_q5_k(blk: np.ndarray, out: np.ndarray, scratch) -> None:
    """Q5_K, 176 bytes per 256 weights, 8 sub-blocks of 32:
    y[32*s + l] = (d * sc[s]) * q[s][l] - (dmin * m[s]),   q = low nibble | high bit << 4 (0..31)
    d: fp16 @0, dmin: fp16 @2, scales: 12 bytes @4 (as Q4_K), qh: 32 bytes @16, qs: 128 bytes @48.
    Low nibbles as Q4_K; the high bit of q[s][l] is bit s of qh[l].
    """
    n = blk.shape[0]
    ds, dm = _k4_scales(blk)
    qh = blk[:, 16:48].reshape(n, 1, 32)
    qs = blk[:, 48:176].reshape(n, 4, 32)
    t8 = scratch.get("t8", (n, 8, 32), np.uint8)
    u8 = scratch.get("u8", (n, 4, 32), np.uint8)
    tf = scratch.get("tf", (n, 8, 32), np.float32)
    np.right_shift(qh, _SH8, out=t8)
    t8 &= 1
    t8 <<= 4
    t4 = t8.reshape(n, 4, 2, 32)
    np.bitwise_and(qs, 15, out=u8)
    t4[:, :, 0] |= u8
    np.right_shift(qs, 4, out=u8)
    t4[:, :, 1] |= u8
    tf[...] = t8
    o3 = out.reshape(n, 8, 32)
    np.multiply(ds[:, :, None], tf, out=o3)
    np.subtract(o3, dm[:, :, None], out=o3)


def deq_q6_k(blk: np.ndarray, out: np.ndarray, scratch) -> None:
    """Q6_K, 210 bytes per 256 weights, 16 sub-blocks of 16:
    y[i] = (d * sc[i // 16]) * (q[i] - 32),   q six-bit (0..63)
    ql: 128 bytes @0, qh: 64 bytes @128, sc: 16 int8 @192, d: fp16 @208.
    Two halves h of 128 weights; within a half, weight 64k + b (k = 0, 1; b = 0..63) takes its low 4 bits
    from nibble k of ql[64h + b], and weight 32s + l (s = 0..3, l = 0..31) its high 2 bits from bits
    2s, 2s+1 of qh[32h + l].
    """
    n = blk.shape[0]
    ql = blk[:, 0:128].reshape(n, 2, 64)
    qh = blk[:, 128:192].reshape(n, 2, 1, 32)
    d = _f16(blk, 208)
    dsc = (d[:, None] * blk[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    t8 = scratch.get("t8", (n, 2, 4, 32), np.uint8)
    u8 = scratch.get("u8", (n, 2, 4, 32), np.uint8)
    tf = scratch.get("tf", (n, 16, 16), np.float32)
    np.right_shift(qh, _SH_Q6, out=t8)
    t8 &= 3
    t8 <<= 4
    u2 = u8.reshape(n, 2, 2, 64)
    np.bitwise_and(ql, 15, out=u2[:, :, 0])
    np.right_shift(ql, 4, out=u2[:, :, 1])
    t8 |= u8
    s8 = t8.view(np.int8)
    s8 -= 32
    tf[...] = s8.reshape(n, 16, 16)
    np.multiply(dsc, tf, out=out.reshape(n, 16, 16))


# ------------------------------------------------------------------------------------------------
# random valid blocks. The block bytes arrive uniformly random; `fill_*` rewrites the scale fields in
# place. A scale field's own random 16 bits pick its value through a 65536-entry table (`f16_table`):
# magnitude base * (0.5 .. 1.5), sign from the top bit where signed, so no per-block random draws.
# rms of (q - centre) over uniform q: 4 bits 4.61 (centre 7.5), 5 bits 9.233 (15.5), 6 bits 18.48 (32);
# rms of a uniform six-bit scale 0..63 is 36.52, of a uniform int8 73.9.

_U16 = np.arange(1 << 16, dtype=np.uint32)


def f16_table(base: float, signed: bool = False, factor: float | None = None) -> np.ndarray:
    """fp16 bits (uint16) indexed by 16 random bits: base * (0.5 + low 15 bits / 2**15), negated when
    `signed` and the top bit is set; with `factor`, fp16(factor * that fp16 value) instead (a min
    tied to its scale)."""
    mag = np.float32(base) * (np.float32(0.5) + (_U16 & 0x7FFF).astype(np.float32) / np.float32(1 << 15))
    if signed:
        mag = np.where(_U16 >= 0x8000, -mag, mag)
    v = mag.astype(np.float16)
    if factor is not None:
        v = (v.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return v.view(np.uint16)


def f16_field(blk: np.ndarray, off: int) -> np.ndarray:
    """The fp16 field at byte `off` of each block as a writable uint16 view (n, 1)."""
    return blk[:, off:off + 2].view(np.uint16)


def _fill_k4(blk: np.ndarray, std: float, spread: float, centre: float) -> None:
    # dmin = centre * d and m = sc centre every sub-block: y = d sc q - centre d sc
    d = f16_field(blk, 0)
    idx = d.copy()
    d[...] = f16_table(std / (spread * 36.52))[idx]
    f16_field(blk, 2)[...] = f16_table(std / (spread * 36.52), factor=centre)[idx]
    sc = blk[:, 4:16]
    sc[:, 4:8] = sc[:, 0:4]  # m[0..3] = sc[0..3] and the top bits of m[4..7] = those of sc[4..7]
    lo = sc[:, 8:12] & 15
    sc[:, 8:12] = lo | (lo << 4)  # low bits of m[4..7] = those of sc[4..7]


def fill_q4_k(blk: np.ndarray, std: float) -> None:
    _fill_k4(blk, std, 4.61, 7.5)


def fill_q5_k(blk: np.ndarray, std: float) -> None:
    _fill_k4(blk, std, 9.233, 15.5)


def fill_q6_k(blk: np.ndarray, std: float) -> None:
    # int8 sub-scales: the random bytes as they are (uniform -128..127)
    d = f16_field(blk, 208)
    d[...] = f16_table(std / (18.48 * 73.9))[d]

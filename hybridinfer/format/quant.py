"""ggml block formats: sizes, vectorized numpy dequantization, random valid blocks.

Dequantization is bit-for-bit equal to `gguf.quants.dequantize` (cast to float32): every type below
computes its float32 products and sums in the same order. (In these formats every product before the
last operation is exact in float32, e.g. fp16 d times a 6-bit scale, so there is one rounding per weight;
keeping gguf's order anyway makes the equality obvious rather than argued.) Work runs over chunks of blocks with scratch
buffers reused across chunks, so the temporaries stay small (a few MB) whatever the tensor size.
The K-quants (Q4_K, Q5_K, Q6_K) live in `quant_k.py`; this module is the public entry point.

Shapes are numpy order: the last dimension is ggml's ne0, the row, which holds whole blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..errors import UnsupportedTensorTypeError
from . import quant_k as _k
from .quant_types import BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TYPES  # noqa: F401

# id -> (name, elements per block, bytes per block), from the one table of types (quant_types.py)
_BLOCKS: dict[int, tuple[str, int, int]] = {q: (t.name, t.block, t.nbytes) for q, t in TYPES.items()}
SUPPORTED_TYPES: frozenset[int] = frozenset(_BLOCKS)

# weights per chunk of blocks: output 1 MiB, scratch about as much (stays in L2 on most CPUs)
_CHUNK_ELEMS = 1 << 18


def type_name(qtype: int) -> str:
    """The ggml name of a type id ("Q4_K"); "type#N" for an id ggml does not define."""
    q = int(qtype)
    if q in _BLOCKS:
        return _BLOCKS[q][0]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(q).name
    except (ImportError, ValueError):
        return f"type#{q}"


def _unsupported(qtype: int) -> UnsupportedTensorTypeError:
    names = ", ".join(_BLOCKS[q][0] for q in sorted(_BLOCKS))
    return UnsupportedTensorTypeError(
        f"ggml type {type_name(qtype)} (id {int(qtype)}) is not supported by hybridinfer (supported: {names})")


def block_info(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block). Known for every ggml type, not only the supported ones."""
    q = int(qtype)
    if q in _BLOCKS:
        return _BLOCKS[q][1], _BLOCKS[q][2]
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        return tuple(GGML_QUANT_SIZES[GGMLQuantizationType(q)])  # type: ignore[return-value]
    except (ImportError, ValueError, KeyError):
        raise _unsupported(q) from None


def row_nbytes(qtype: int, n_elements_in_row: int) -> int:
    """Bytes of one row of `n_elements_in_row` weights; the row must be a whole number of blocks."""
    qk, bs = block_info(qtype)
    n = int(n_elements_in_row)
    if n < 0 or n % qk:
        raise ValueError(f"a {type_name(qtype)} row of {n} elements is not a whole number of {qk}-element blocks")
    return n // qk * bs


class _Scratch:
    """Reusable flat buffers, one per name, grown on demand; `get` returns a view of the wanted shape."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        size = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._bufs[name] = np.empty(size, dtype=dtype)
        return buf[:size].reshape(shape)


def _f16(blk: np.ndarray, off: int) -> np.ndarray:
    """The fp16 field at byte `off` of each block as a float32 column (n_blocks, 1)."""
    return blk[:, off:off + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, t8: np.ndarray) -> None:
    """t8 (n, 32) <- the 32 four-bit values of 16 bytes: element j < 16 is qs[j] & 15, j >= 16 qs[j-16] >> 4."""
    np.bitwise_and(qs, 15, out=t8[:, :16])
    np.right_shift(qs, 4, out=t8[:, 16:])


def _high_bits(qh: np.ndarray, t8: np.ndarray) -> None:
    """t8 (n, 32) |= bit j of the little-endian uint32 qh (4 bytes), shifted to bit 4."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")
    bits <<= 4
    t8 |= bits


def _deq_q4_0(blk, out, scratch):
    """Q4_0, 18 bytes per 32 weights: y[j] = d * (q[j] - 8).
    d: fp16 @0; qs: 16 bytes @2, q[j] = qs[j] & 15 and q[j+16] = qs[j] >> 4 (j = 0..15).
    """
    n = blk.shape[0]
    t8 = scratch.get("t8", (n, 32), np.uint8)
    tf = scratch.get("tf", (n, 32), np.float32)
    _nibbles(blk[:, 2:18], t8)
    s8 = t8.view(np.int8)
    s8 -= 8
    tf[...] = s8
    np.multiply(_f16(blk, 0), tf, out=out)


def _deq_q4_1(blk, out, scratch):
    """Q4_1, 20 bytes per 32 weights: y[j] = d * q[j] + m.
    d: fp16 @0, m: fp16 @2; qs: 16 bytes @4, nibbles as Q4_0.
    """
    n = blk.shape[0]
    t8 = scratch.get("t8", (n, 32), np.uint8)
    tf = scratch.get("tf", (n, 32), np.float32)
    _nibbles(blk[:, 4:20], t8)
    tf[...] = t8
    np.multiply(_f16(blk, 0), tf, out=out)
    out += _f16(blk, 2)


def _deq_q5_0(blk, out, scratch):
    """Q5_0, 22 bytes per 32 weights: y[j] = d * (q[j] - 16), q five-bit.
    d: fp16 @0; qh: uint32 @2, bit j = bit 4 of q[j]; qs: 16 bytes @6, low nibbles as Q4_0.
    """
    n = blk.shape[0]
    t8 = scratch.get("t8", (n, 32), np.uint8)
    tf = scratch.get("tf", (n, 32), np.float32)
    _nibbles(blk[:, 6:22], t8)
    _high_bits(blk[:, 2:6], t8)
    s8 = t8.view(np.int8)
    s8 -= 16
    tf[...] = s8
    np.multiply(_f16(blk, 0), tf, out=out)


def _deq_q5_1(blk, out, scratch):
    """Q5_1, 24 bytes per 32 weights: y[j] = d * q[j] + m, q five-bit.
    d: fp16 @0, m: fp16 @2; qh: uint32 @4 (as Q5_0); qs: 16 bytes @8.
    """
    n = blk.shape[0]
    t8 = scratch.get("t8", (n, 32), np.uint8)
    tf = scratch.get("tf", (n, 32), np.float32)
    _nibbles(blk[:, 8:24], t8)
    _high_bits(blk[:, 4:8], t8)
    tf[...] = t8
    np.multiply(_f16(blk, 0), tf, out=out)
    out += _f16(blk, 2)


def _deq_q8_0(blk, out, scratch):
    """Q8_0, 34 bytes per 32 weights: y[j] = q[j] * d.   d: fp16 @0; q: 32 int8 @2."""
    out[...] = blk[:, 2:34].view(np.int8)
    out *= _f16(blk, 0)


_DEQ: dict[int, Callable] = {
    Q4_0: _deq_q4_0, Q4_1: _deq_q4_1, Q5_0: _deq_q5_0, Q5_1: _deq_q5_1, Q8_0: _deq_q8_0,
    Q4_K: _k.deq_q4_k, Q5_K: _k.deq_q5_k, Q6_K: _k.deq_q6_k,
}


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray:
    """Weights of ggml type `qtype` stored in `raw` (flat bytes) as a float32 array of `shape`.

    Without `out`, F32 comes back as a view of `raw` (no copy; read-only where `raw` is) and every other
    type as a new array; with `out` (C-contiguous float32 of `shape`), the weights are written there.
    """
    q = int(qtype)
    if q not in _BLOCKS:
        raise _unsupported(q)
    name, qk, bs = _BLOCKS[q]
    shape = tuple(int(x) for x in shape)
    n_el = math.prod(shape)
    if shape and shape[-1] % qk:
        raise ValueError(f"{name} rows must hold whole {qk}-element blocks, but shape {shape} has rows of {shape[-1]}")
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    raw = raw.reshape(-1)
    need = n_el // qk * bs
    if raw.size != need:
        raise ValueError(f"{name} tensor of shape {shape} needs {need} bytes, but {raw.size} were given")
    if out is None:
        if q == F32:
            return raw.view(np.float32).reshape(shape)
        out = np.empty(shape, dtype=np.float32)
    elif out.dtype != np.float32 or tuple(out.shape) != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}, not {out.dtype} {out.shape}")
    flat = out.reshape(-1)
    if q == F32:
        flat[...] = raw.view(np.float32)
    elif q == F16:
        flat[...] = raw.view(np.float16)
    elif q == BF16:
        # bf16 is the top half of a float32
        u = flat.view(np.uint32)
        u[...] = raw.view(np.uint16)
        u <<= 16
    else:
        nb = n_el // qk
        blocks = raw.reshape(nb, bs)
        out2 = flat.reshape(nb, qk)
        fn = _DEQ[q]
        step = max(1, _CHUNK_ELEMS // qk)
        scratch = _Scratch()
        for s in range(0, nb, step):
            fn(blocks[s:s + step], out2[s:s + step], scratch)
    return out


# ------------------------------------------------------------------------------------------------
# random valid blocks

# 32-weight formats: (rms of the centred quant, centre): the _1 types centre with m = -centre * d (the fp16
# at byte 2); the _0 types get a random sign on d, as ggml's own quantizer gives.
_SIMPLE_FILL = {Q4_0: (4.637, None), Q4_1: (4.61, 7.5), Q5_0: (9.247, None), Q5_1: (9.233, 15.5), Q8_0: (73.9, None)}


def _fill_simple(q: int, blk: np.ndarray, std: float) -> None:
    spread, centre = _SIMPLE_FILL[q]
    d = _k.f16_field(blk, 0)
    idx = d.copy()
    d[...] = _k.f16_table(std / spread, signed=centre is None)[idx]
    if centre is not None:
        _k.f16_field(blk, 2)[...] = _k.f16_table(std / spread, factor=-centre)[idx]


_FILL_K: dict[int, Callable] = {Q4_K: _k.fill_q4_k, Q5_K: _k.fill_q5_k, Q6_K: _k.fill_q6_k}


def random_blocks(qtype: int, n_blocks: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """`n_blocks` random but valid blocks of `qtype`, uint8 (n_blocks, bytes per block).

    Quants are uniform random bits; fp16 scales (and mins, sub-block scales) are finite and chosen so the
    weights dequantize to mean ~0 and standard deviation ~`std`, like trained weights. F32/F16/BF16 give
    normal samples.
    """
    q = int(qtype)
    if q not in _BLOCKS:
        raise _unsupported(q)
    _, qk, bs = _BLOCKS[q]
    n = int(n_blocks)
    if q in (F32, F16, BF16):
        # 65536 normal samples (pairs for the 2-byte types), picked by random 16-bit indices: normal sampling
        # itself is ~10x slower
        table = rng.standard_normal(1 << 16 if q == F32 else 1 << 17, dtype=np.float32) * np.float32(std)
        if q == F16:
            table = table.astype(np.float16)
        elif q == BF16:
            table = (table.view(np.uint32) >> 16).astype(np.uint16)
        table = table.view(np.uint32)
        m = (n * bs + 3) // 4
        idx = rng.integers(0, 0xFFFFFFFF, (m + 1) // 2, dtype=np.uint32, endpoint=True).view(np.uint16)[:m]
        out = np.empty(m, dtype=np.uint32)
        step = 1 << 20
        for s in range(0, m, step):
            np.take(table, idx[s:s + step], out=out[s:s + step])
        return out.view(np.uint8)[: n * bs].reshape(n, bs)
    # full-range uint32 draws are the fastest way to random bytes through the Generator API
    words = rng.integers(0, 0xFFFFFFFF, (n * bs + 3) // 4, dtype=np.uint32, endpoint=True)
    blk = words.view(np.uint8)[: n * bs].reshape(n, bs)
    step = 1 << 20
    for s in range(0, n, step):
        if q in _FILL_K:
            _FILL_K[q](blk[s:s + step], std)
        else:
            _fill_simple(q, blk[s:s + step], std)
    return blk


def dequantize_rows(raw: np.ndarray, qtype: int, row_len: int, ids, out: np.ndarray) -> np.ndarray:
    """Rows `ids` of a 2-D tensor stored row after row in `raw`, dequantized into out (len(ids), row_len)
    float32; only those rows are read (an embedding lookup)."""
    rb = row_nbytes(qtype, row_len)
    if len(ids) == 1:  # decode: a slice, no gather copy
        r = int(ids[0])
        dequantize(raw[r * rb : (r + 1) * rb], qtype, (row_len,), out=out[0])
        return out
    flat = np.asarray(raw).reshape(-1).view(np.uint8)
    # one gather of the rows' bytes (a memmap reads only those pages), then one vectorized dequantization
    dequantize(flat.reshape(-1, rb)[np.asarray(ids, dtype=np.int64)], qtype, (len(ids), row_len), out=out)
    return out

"""hybridinfer.format.quant: own numpy dequantization, bit-for-bit against gguf.quants; random valid blocks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from hybridinfer.errors import UnsupportedTensorTypeError
from hybridinfer.format import quant
from hybridinfer.format.quant import SUPPORTED_TYPES, block_info, dequantize, random_blocks, row_nbytes, type_name

T = GGMLQuantizationType
TYPES = sorted(SUPPORTED_TYPES)
IDS = [type_name(q) for q in TYPES]
# byte offsets of the fp16 fields of each block (scales, mins), overwritten with finite values in raw tests
FP16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
               T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def _shapes(qk: int) -> list[tuple[int, ...]]:
    """numpy shapes: one row, one block, odd row counts, 3-D, and enough blocks to span several chunks."""
    if qk == 1:
        return [(1,), (1, 1), (7, 13), (3, 5, 7), (2, 33)]
    return [(qk,), (1, qk), (7, 3 * qk), (3, 5, qk), (2, 3, 2 * qk), (1001 if qk > 32 else 301, 4 * qk)]


def _finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random fp16 bit patterns, subnormals and both signs included, never inf or NaN."""
    b = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    exp_all_ones = (b & 0x7C00) == 0x7C00
    b[exp_all_ones] &= np.uint16(0xBFFF)  # clear the top exponent bit: a large finite value
    return b


def _raw_random(qtype: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Uniformly random block bytes with the fp16 fields made finite (covers every bit pattern of the
    quants and sub-scales). For F32/F16/BF16 the exponent is kept off all-ones."""
    qk, bs = block_info(qtype)
    raw = rng.integers(0, 256, (n_blocks, bs), dtype=np.uint8)
    if qtype == T.F32:
        w = raw.view(np.uint32)
        w[(w & 0x7F800000) == 0x7F800000] &= np.uint32(0xBFFFFFFF)
    elif qtype == T.F16:
        raw.view(np.uint16)[...] = _finite_f16_bits(rng, n_blocks).reshape(-1, 1)
    elif qtype == T.BF16:
        h = raw.view(np.uint16)
        h[(h & 0x7F80) == 0x7F80] &= np.uint16(0xBFFF)
    else:
        for off in FP16_FIELDS[qtype]:
            raw[:, off:off + 2] = _finite_f16_bits(rng, n_blocks).view(np.uint8).reshape(-1, 2)
    return raw


def _reference(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(gq.dequantize(raw.reshape(-1), T(qtype)), dtype=np.float32).reshape(shape)


def _assert_bitwise_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == np.float32 and b.dtype == np.float32
    assert a.shape == b.shape
    assert np.isfinite(b).all()
    eq = a.view(np.uint32) == b.view(np.uint32)
    if not eq.all():
        i = np.flatnonzero(~eq.reshape(-1))[0]
        raise AssertionError(f"{(~eq).sum()} of {a.size} differ; first at {i}: {a.reshape(-1)[i]!r} vs "
                             f"{b.reshape(-1)[i]!r}")


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("source", ["random_blocks", "raw_bytes"])
def test_dequantize_bitwise_equals_gguf(qtype, source):
    rng = np.random.default_rng(1000 + qtype)
    qk, bs = block_info(qtype)
    for shape in _shapes(qk):
        n_blocks = int(np.prod(shape)) // qk
        if source == "random_blocks":
            raw = random_blocks(qtype, n_blocks, rng)
        else:
            raw = _raw_random(qtype, n_blocks, rng)
        flat = raw.reshape(-1)
        got = dequantize(flat, qtype, shape)
        assert got.shape == shape
        _assert_bitwise_equal(got, _reference(flat, qtype, shape))


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_dequantize_across_many_chunks(qtype, monkeypatch):
    """A tiny chunk size makes the chunk loop run many times with a ragged last chunk."""
    monkeypatch.setattr(quant, "_CHUNK_ELEMS", 3 * 256)
    rng = np.random.default_rng(7)
    qk, _ = block_info(qtype)
    shape = (5, 7 * max(qk, 32))
    raw = _raw_random(qtype, int(np.prod(shape)) // qk, rng).reshape(-1)
    _assert_bitwise_equal(dequantize(raw, qtype, shape), _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_dequantize_out_and_input_forms(qtype):
    """`out=` is filled in place; raw may be a 2-D or read-only (memory-mapped) byte array."""
    rng = np.random.default_rng(3)
    qk, _ = block_info(qtype)
    shape = (4, 2 * max(qk, 32))
    raw = random_blocks(qtype, int(np.prod(shape)) // qk, rng)
    ref = _reference(raw, qtype, shape)
    ro = raw.copy()
    ro.flags.writeable = False
    _assert_bitwise_equal(dequantize(ro, qtype, shape), ref)
    out = np.full(shape, np.nan, dtype=np.float32)
    assert dequantize(raw.reshape(-1), qtype, shape, out=out) is out
    _assert_bitwise_equal(out, ref)
    with pytest.raises(ValueError, match="out must be"):
        dequantize(raw, qtype, shape, out=np.empty(shape, dtype=np.float64))


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_random_blocks_look_like_weights(qtype):
    qk, bs = block_info(qtype)
    n_blocks = 65536 // qk
    for std in (0.02, 0.1):
        blk = random_blocks(qtype, n_blocks, np.random.default_rng(5), std=std)
        assert blk.dtype == np.uint8 and blk.shape == (n_blocks, bs)
        w = dequantize(blk.reshape(-1), qtype, (n_blocks * qk,))
        assert np.isfinite(w).all()
        assert 0.8 * std < float(w.std()) < 1.25 * std, (type_name(qtype), std, float(w.std()))
        assert abs(float(w.mean())) < 0.05 * std
        assert float(np.abs(w).max()) < 12 * std
    # reproducible from the seed, different across seeds
    a = random_blocks(qtype, 8, np.random.default_rng(1))
    assert np.array_equal(a, random_blocks(qtype, 8, np.random.default_rng(1)))
    assert not np.array_equal(a, random_blocks(qtype, 8, np.random.default_rng(2)))
    assert random_blocks(qtype, 0, np.random.default_rng(1)).shape == (0, bs)


def test_random_k_quant_sub_scales_vary():
    rng = np.random.default_rng(0)
    from hybridinfer.format.quant_k import unpack_scale_min_k4

    for q in (T.Q4_K, T.Q5_K):
        sc, mn = unpack_scale_min_k4(random_blocks(q, 4096, rng)[:, 4:16])
        assert sc.min() == 0 and sc.max() == 63 and len(np.unique(sc)) == 64
        assert np.array_equal(sc, mn)  # min tied to scale: centred sub-blocks
    s6 = random_blocks(T.Q6_K, 4096, rng)[:, 192:208].view(np.int8)
    assert s6.min() < -100 and s6.max() > 100


def test_block_info_and_names():
    for q in TYPES:
        assert block_info(q) == tuple(GGML_QUANT_SIZES[T(q)])
        assert type_name(q) == T(q).name
    assert type_name(T.Q4_K) == "Q4_K"
    assert type_name(T.Q2_K) == "Q2_K"
    assert type_name(4) == "type#4"  # removed Q4_2
    assert type_name(999) == "type#999"
    assert block_info(T.Q2_K) == (256, 84)  # sizes are known beyond the supported set
    with pytest.raises(UnsupportedTensorTypeError, match="type#999"):
        block_info(999)
    assert {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K} == set(TYPES)


def test_row_nbytes():
    assert row_nbytes(T.Q4_K, 2048) == 8 * 144
    assert row_nbytes(T.Q8_0, 64) == 68
    assert row_nbytes(T.F16, 7) == 14
    assert row_nbytes(T.Q6_K, 0) == 0
    with pytest.raises(ValueError, match="Q4_K.*100"):
        row_nbytes(T.Q4_K, 100)
    with pytest.raises(ValueError, match="Q4_0"):
        row_nbytes(T.Q4_0, 33)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ2_XXS, T.TQ1_0, 999])
def test_unsupported_type_raises_naming_it(qtype):
    name = type_name(qtype)
    with pytest.raises(UnsupportedTensorTypeError, match=name):
        dequantize(np.zeros(256, np.uint8), qtype, (256,))
    with pytest.raises(UnsupportedTensorTypeError, match=name):
        random_blocks(qtype, 1, np.random.default_rng(0))
    assert qtype not in SUPPORTED_TYPES


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_wrong_raw_length_raises_value_error(qtype):
    qk, bs = block_info(qtype)
    shape = (3, max(qk, 32))
    need = 3 * max(qk, 32) // qk * bs
    for n in (need - 1, need + 1, need + bs, 0):
        with pytest.raises(ValueError, match=f"needs {need} bytes.*{n} were given"):
            dequantize(np.zeros(n, np.uint8), qtype, shape)
    if qk > 1:
        with pytest.raises(ValueError, match="whole"):
            dequantize(np.zeros(bs, np.uint8), qtype, (qk + 1,))

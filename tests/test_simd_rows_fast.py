"""GGML_DECODE_ROWS through the multi-token kernels (native/simd/kernels_rows.h): one weight row against groups of
tokens, each block unpacked once. Every row of a product over T rows must equal, bit for bit (NaN payloads
included), the same row as a one-token GGML_MUL_MAT product, whatever T, the group a token falls in, the row
count (Q4_K's repacked shape at rows % 8 == 0, vec_dot's otherwise), the row length (the groups' preparation on
the stack or the heap), the thread count, the SSSE3 unit's zipped rows; with activations of very different scales,
zero blocks, rounding ties and subnormals, and weight blocks with huge, tiny, subnormal and zero scales."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.cpu.simd import GGML_DECODE_ROWS, GGML_MUL_MAT, KERNEL_TYPES, SimdLib, supported_isas
from hybridinfer.format.quant import random_blocks

QTYPES = sorted(KERNEL_TYPES)
KQ = (12, 13, 14)
TMAX = 33  # past every group size and the driver's 32-token blocks

# byte offsets of the fp16 scales of a block: (d, optional min) per type
_SCALES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
_EDGE_F16 = np.array([65504.0, 6.1e-5, 6e-8, 0.0, -3.0e4, 1e-3], np.float16).view(np.uint16)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def _weights(qtype: int, rows: int, cols: int, rng, edges: bool = True) -> np.ndarray:
    if qtype in (0, 1):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if edges:
            w[0, :7] = [3e4, -2e4, 1e-30, 1e-41, 0.0, -0.0, 6e-8]
            w[rows - 1] *= 1e-3
        return w if qtype == 0 else w.astype(np.float16)
    blk = 256 if qtype in KQ else 32
    b = random_blocks(qtype, rows * cols // blk, rng)
    if edges:  # some blocks' scales at fp16 extremes (huge, smallest normal, subnormal, zero, negative)
        for off in _SCALES[qtype]:
            pick = rng.choice(b.shape[0], size=min(b.shape[0], 2 * len(_EDGE_F16)), replace=False)
            vals = np.resize(_EDGE_F16, pick.size)
            b[pick, off:off + 2] = vals.view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


def _activations(rng, T: int, n: int) -> np.ndarray:
    """Rows of very different scales, zero blocks, exact rounding ties, subnormals (no NaN or inf)."""
    x = (rng.standard_normal((T, n)) * rng.uniform(0.01, 50, (T, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = np.arange(-15.5, 16.5, dtype=np.float32)
    x[1, 5] = 127.0
    x[2] = 0.0  # a whole zero row
    x[3] *= 1e4
    x[4] *= 1e-30
    if n >= 512:
        x[5, 256:288] = np.arange(-15.5, 16.5, dtype=np.float32)
        x[5, 260] = -127.0
        x[6, 300:320] = np.float32(1e-41)
    x[7, 32:64] = np.float32(1e-41)  # a subnormal block
    return x


def _one_token(lib, w, qtype, rows, cols, xq) -> np.ndarray:
    want = np.zeros((xq.shape[0], rows), np.float32)
    for t in range(xq.shape[0]):
        lib.matmul(w, qtype, rows, cols, xq[t], want[t], GGML_MUL_MAT)
    return want


def _check_all_T(lib, w, qtype, rows, cols, xq, want, Ts, what):
    for T in Ts:
        got = np.full((T, rows), np.nan, np.float32)
        lib.matmul(w, qtype, rows, cols, xq[:T], got, GGML_DECODE_ROWS)
        assert np.array_equal(_bits(got), _bits(want[:T])), (what, T)


def _shapes(qtype):
    if qtype in KQ:
        return [(24, 256), (13, 512), (8, 768), (5, 1280)]
    if qtype in (0, 1):
        return [(24, 512), (7, 96), (5, 200), (9, 1000)]  # F32/F16: tails past the vector steps too
    return [(24, 256), (13, 32), (5, 96), (6, 288)]


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_T_and_shape(libs, qtype):
    rng = np.random.default_rng(77 + qtype)
    for rows, cols in _shapes(qtype):
        w = _weights(qtype, rows, cols, rng)
        x = _activations(rng, TMAX, cols)
        for isa, lib in libs.items():
            xq = lib.quantize(x, qtype)
            want = _one_token(lib, w, qtype, rows, cols, xq)
            Ts = range(2, TMAX + 1) if (rows, cols) == _shapes(qtype)[0] else (2, 3, 5, 8, 9, 12, 17, 33)
            _check_all_T(lib, w, qtype, rows, cols, xq, want, Ts, (isa, rows, cols))


@pytest.mark.parametrize("qtype", KQ + (1, 8))
def test_long_rows_and_thread_counts(qtype):
    """Rows long enough that a group's preparation (K-quants; F16 below AVX) leaves the stack; 1 and 3 threads."""
    rng = np.random.default_rng(5 + qtype)
    rows, cols = 16, 256 * 23
    w = _weights(qtype, rows, cols, rng)
    x = _activations(rng, 17, cols)
    for isa in supported_isas():
        ref = SimdLib(isa, n_threads=1)
        xq = ref.quantize(x, qtype)
        want = _one_token(ref, w, qtype, rows, cols, xq)
        for nth in (1, 3):
            lib = SimdLib(isa, n_threads=nth)
            _check_all_T(lib, w, qtype, rows, cols, xq, want, (2, 8, 9, 16, 17), (isa, nth))
            lib.close()
        ref.close()



@pytest.mark.parametrize("qtype", KQ)
def test_prefetched_weight_stream(qtype):
    """The group kernels' sweeps prefetch the weight stream ahead as the one-token tiles do (the context's prefetch
    bytes: less than a row, several rows, past the chunk's end): every row still its one-token product."""
    rng = np.random.default_rng(31 + qtype)
    rows, cols = 13, 512
    w = _weights(qtype, rows, cols, rng)
    x = _activations(rng, 17, cols)
    for isa in supported_isas():
        ref = SimdLib(isa, n_threads=1, prefetch=0)
        xq = ref.quantize(x, qtype)
        want = _one_token(ref, w, qtype, rows, cols, xq)
        ref.close()
        for pf in (64, 4096, 1 << 20):
            lib = SimdLib(isa, n_threads=2, prefetch=pf)
            _check_all_T(lib, w, qtype, rows, cols, xq, want, (2, 3, 8, 9, 16, 17), (isa, pf))
            got = np.full(rows, np.nan, np.float32)
            lib.matmul(w, qtype, rows, cols, xq[0], got, GGML_DECODE_ROWS)
            assert np.array_equal(_bits(got), _bits(want[0])), (isa, pf, 1)
            lib.close()

@pytest.mark.parametrize("qtype", KQ)
def test_ssse3_zipped_rows(qtype):
    if "ssse3" not in supported_isas():
        pytest.skip("this CPU has no SSSE3")
    lib = SimdLib("ssse3", n_threads=2)
    rng = np.random.default_rng(qtype)
    rows, cols = 12, 768
    w = _weights(qtype, rows, cols, rng)
    z = w.copy()
    zq = lib.repack(z, qtype)
    xq = lib.quantize(_activations(rng, 11, cols), qtype)
    want = _one_token(lib, w, qtype, rows, cols, xq)
    _check_all_T(lib, z, zq, rows, cols, xq, want, range(2, 12), "zipped")
    lib.close()


def test_matmul_many_mixed(libs):
    """Several matrices in one call: Q4_K in both of its shapes, Q5_K, Q6_K (one input), and apart the legacy and
    float types, as each would be alone one token at a time."""
    rng = np.random.default_rng(9)
    cols, T = 512, 11
    groups = [[(12, 16), (12, 13), (13, 9), (14, 21)], [(2, 8), (8, 5)], [(3, 7), (7, 6)], [(6, 10)], [(0, 6)],
              [(1, 4)]]
    x = _activations(rng, T, cols)
    for isa, lib in libs.items():
        for group in groups:
            ws = [(_weights(q, r, cols, rng), q, r) for q, r in group]
            xq = lib.quantize(x, group[0][0])
            outs = [np.full((T, r), np.nan, np.float32) for _, _, r in ws]
            lib.matmul_many(xq, cols, [(w, q, r, o) for (w, q, r), o in zip(ws, outs, strict=True)], GGML_DECODE_ROWS)
            for (w, q, r), o in zip(ws, outs, strict=True):
                assert np.array_equal(_bits(o), _bits(_one_token(lib, w, q, r, cols, xq))), (isa, q, r)

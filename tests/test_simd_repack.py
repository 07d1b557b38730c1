"""SimdLib.repack: the SSSE3 unit's zipped K-quant layout gives the same bits as ggml's, in every product shape;
other units keep ggml's layout."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.cpu.simd import GGML_MUL_MAT_ID, KQ_ZIPPED, SimdLib, supported_isas
from hybridinfer.errors import UnsupportedTensorTypeError
from hybridinfer.format.quant import random_blocks

KQ = {12: "q4_K", 13: "q5_K", 14: "q6_K"}


def _ssse3() -> SimdLib:
    if "ssse3" not in supported_isas():
        pytest.skip("this CPU has no SSSE3")
    return SimdLib("ssse3", n_threads=2)


def _mat(qtype: int, rows: int, cols: int, seed: int) -> np.ndarray:
    return random_blocks(qtype, rows * cols // 256, np.random.default_rng(seed)).reshape(-1)


@pytest.mark.parametrize("qtype", list(KQ), ids=list(KQ.values()))
@pytest.mark.parametrize("T", [1, 5])
def test_zipped_rows_give_the_same_bits(qtype, T):
    lib = _ssse3()
    rows, cols = 24, 512
    w = _mat(qtype, rows, cols, qtype)
    z = w.copy()
    zq = lib.repack(z, qtype)
    assert zq == qtype | KQ_ZIPPED
    assert not np.array_equal(z, w)  # the quant bytes moved
    x = np.random.default_rng(T).standard_normal((T, cols)).astype(np.float32)
    xq = lib.quantize(x, qtype)
    a, b = np.zeros((T, rows), np.float32), np.zeros((T, rows), np.float32)
    lib.matmul(w, qtype, rows, cols, xq, a)
    lib.matmul(z, zq, rows, cols, xq, b)
    assert np.array_equal(a, b) and np.abs(a).max() > 0


def test_zipped_rows_in_the_batched_and_moe_calls():
    lib = _ssse3()
    n_exp, rows, cols, k = 6, 16, 256, 3
    gate, up = _mat(12, n_exp * rows, cols, 1), _mat(14, n_exp * rows, cols, 2)
    down = _mat(13, n_exp * cols, rows * 16, 3)
    zg, zu, zd = gate.copy(), up.copy(), down.copy()
    qg, qu, qd = lib.repack(zg, 12), lib.repack(zu, 14), lib.repack(zd, 13)
    x = np.random.default_rng(4).standard_normal(cols).astype(np.float32)
    xq = lib.quantize(x, 12)
    ids = np.array([4, 0, 2], np.int32)
    outs = {}
    for tag, (g, gq, u, uq, d, dq) in {"raw": (gate, 12, up, 14, down, 13), "zip": (zg, qg, zu, qu, zd, qd)}.items():
        go, uo = np.zeros((k, rows), np.float32), np.zeros((k, rows), np.float32)
        lib.moe_gate_up(g, gq, u, uq, rows, cols, xq, ids, go, uo, GGML_MUL_MAT_ID)
        h = np.random.default_rng(5).standard_normal((k, rows * 16)).astype(np.float32)
        hq = lib.quantize(h, dq)
        do = np.zeros((k, cols), np.float32)
        lib.moe_down(d, dq, cols, rows * 16, hq, ids, do, GGML_MUL_MAT_ID)
        m1, m2 = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        lib.matmul_many(xq, cols, [(g[: rows * 144], gq, rows, m1), (up[: rows * 210], 14, rows, m2)])
        outs[tag] = (go, uo, do, m1, m2)
    for a, b in zip(outs["raw"], outs["zip"], strict=True):
        assert np.array_equal(a, b) and np.abs(a).max() > 0


def test_other_units_keep_ggml_layout():
    w = _mat(12, 4, 256, 7)
    for isa in supported_isas():
        lib = SimdLib(isa, n_threads=1)
        z = w.copy()
        q = lib.repack(z, 12)
        if isa == "ssse3":
            assert q == 12 | KQ_ZIPPED
            continue
        assert q == 12 and np.array_equal(z, w)
        xq = lib.quantize(np.ones(256, np.float32), 12)
        with pytest.raises(ValueError, match="rejected"):  # no kernels for zipped rows here
            lib.matmul(w, 12 | KQ_ZIPPED, 4, 256, xq, np.zeros(4, np.float32))


def test_repack_rejects_bad_input():
    lib = _ssse3()
    legacy = random_blocks(8, 4, np.random.default_rng(0)).reshape(-1)
    before = legacy.copy()
    assert lib.repack(legacy, 8) == 8 and np.array_equal(legacy, before)  # Q8_0: ggml's layout
    with pytest.raises(ValueError, match="whole number of Q4_K blocks"):
        lib.repack(np.zeros(145, np.uint8), 12)
    with pytest.raises(ValueError, match="already repacked"):
        lib.repack(np.zeros(144, np.uint8), 12 | KQ_ZIPPED)
    with pytest.raises(UnsupportedTensorTypeError):
        lib.repack(np.zeros(144, np.uint8), 10)  # Q2_K: no kernel
    with pytest.raises(ValueError, match="writable"):
        ro = np.zeros(144, np.uint8)
        ro.flags.writeable = False
        lib.repack(ro, 12)
    with pytest.raises(UnsupportedTensorTypeError):
        lib.matmul(np.zeros(144, np.uint8), 8 | KQ_ZIPPED, 1, 256, np.zeros(34 * 8, np.uint8), np.zeros(1, np.float32))

"""The reference's llama.cpp-rounding mode (actquant.py) against llama.cpp's own CPU kernels."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends import actquant
from hybridinfer.format.quant import random_blocks

TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}


@pytest.fixture(scope="module")
def ggml():
    pytest.importorskip("llama_cpp")
    import ggml_kernels

    return ggml_kernels.load()


@pytest.mark.parametrize("kind", ["q8_0", "q8_1"])
def test_activation_quantizers_match_ggml(ggml, kind):
    import ggml_kernels

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 320)) * rng.uniform(0.01, 30, (7, 1))).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block
    q, d, s = actquant.quantize_q8(x, with_sum=kind == "q8_1")
    for t in range(x.shape[0]):
        y = ggml_kernels.quantize_act(ggml, x[t], kind).reshape(-1, 34 if kind == "q8_0" else 36)
        gd = y[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
        off = 2 if kind == "q8_0" else 4
        gq = y[:, off:].view(np.int8).astype(np.float32)
        assert np.array_equal(gd, d[t]) and np.array_equal(gq, q[t])
        if kind == "q8_1":
            assert np.array_equal(y[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32), s[t])


@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_qmatmul_matches_ggml_vec_dot(ggml, qtype):
    import ggml_kernels

    rng = np.random.default_rng(qtype)
    rows, cols = 37, 32 * 9
    raw = random_blocks(qtype, rows * cols // 32, rng).reshape(-1)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    ours = actquant.qmatmul(x, raw, qtype, rows, cols, row_chunk=16)
    for t in range(3):
        theirs = ggml_kernels.matvec(ggml, raw, qtype, rows, cols, x[t])
        # integer sums are exact in both; only the float summation order of block terms differs
        assert np.allclose(ours[t], theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max()), TYPES[qtype]
    from hybridinfer.format.quant import dequantize

    exact = x @ dequantize(raw, qtype, (rows, cols)).T
    assert not np.allclose(ours, exact, rtol=1e-6, atol=0)  # activation rounding really happened


def test_qmatmul_rejects_k_quants():
    with pytest.raises(ValueError, match="type 12"):
        actquant.qmatmul(np.zeros((1, 256), np.float32), np.zeros(144, np.uint8), 12, 1, 256)

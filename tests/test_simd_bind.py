"""SimdLib.bind: a call checked once and repeated over the same buffers gives what the checked call gives."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.cpu.simd import SimdLib
from hybridinfer.quant import random_blocks

Q4_K, Q8_0 = 12, 8


@pytest.mark.parametrize("qtype", [Q8_0, Q4_K])
def test_bound_calls_follow_buffer_contents(qtype):
    lib = SimdLib(n_threads=2)
    rng = np.random.default_rng(qtype)
    rows, cols = 40, 512
    w = random_blocks(qtype, rows * cols // 256 if qtype == Q4_K else rows * cols // 32, rng).reshape(-1)
    x = np.zeros((1, cols), np.float32)
    xq = np.zeros((1, lib.act_row_bytes(qtype, cols)), np.uint8)
    out = np.zeros((1, rows), np.float32)
    q = lib.bind("quantize", x, qtype, xq)
    mm = lib.bind("matmul", w, qtype, rows, cols, xq, out)
    for _ in range(3):
        x[...] = rng.standard_normal(x.shape)
        q()
        mm()
        want = lib.matmul(w, qtype, rows, cols, lib.quantize(x, qtype), np.zeros((1, rows), np.float32))
        assert np.array_equal(out, want)
    with pytest.raises(ValueError, match="no native call|unknown|has no"):
        lib.bind("act_kind", qtype)

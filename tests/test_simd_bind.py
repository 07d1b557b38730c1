"""SimdLib.bind: a call checked once and repeated over the same buffers gives what the checked call gives."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.cpu.simd import SimdLib
from hybridinfer.format.quant import random_blocks

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


def test_packed_steps_run_as_the_bound_calls_and_name_a_failing_one():
    """Steps (the decode step as one hi_replay_run) repeat the Bound calls they pack, in order, clocking each when
    asked; a call the library rejects is named in the error."""
    from hybridinfer.backends.cpu.replay import Steps

    lib = SimdLib(n_threads=2)
    rng = np.random.default_rng(3)
    rows, cols = 24, 256
    w = random_blocks(Q4_K, rows * cols // 256, rng).reshape(-1)
    x = np.zeros((1, cols), np.float32)
    xq = np.zeros((1, lib.act_row_bytes(Q4_K, cols)), np.uint8)
    out, out2 = np.zeros((1, rows), np.float32), np.zeros((1, rows), np.float32)
    nw = np.ones(cols, np.float32)
    calls = [lib.bind("rms_norm", x, None, nw, 1e-6, x), lib.bind("quantize", x, Q4_K, xq),
             lib.bind("matmul_many", xq, cols, [(w, Q4_K, rows, out), (w, Q4_K, rows, out2)])]
    steps = Steps(lib, calls)
    for _ in range(2):
        x[...] = rng.standard_normal(x.shape)
        want_x = x.copy()
        lib.rms_norm(want_x, None, nw, 1e-6, want_x)
        want = lib.matmul(w, Q4_K, rows, cols, lib.quantize(want_x, Q4_K), np.zeros((1, rows), np.float32))
        steps.run(0)
        assert np.array_equal(x, want_x) and np.array_equal(out, want) and np.array_equal(out2, want)
    steps.ns = np.zeros(3, np.int64)  # the per-call clock: each run adds every call's time
    steps.run(0)
    first = steps.ns.copy()
    steps.run(0)
    assert np.all(first > 0) and np.all(steps.ns > first)
    steps.ns = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="Steps.ns"):
        steps.run(0)
    steps.ns = None
    steps._arr[2].a[4].i = 100  # cols no longer whole blocks: the library rejects the call
    with pytest.raises(ValueError, match="matmul_many"):
        steps.run(0)

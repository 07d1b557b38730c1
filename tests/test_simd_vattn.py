"""The SIMD library's fused full attention for the vision tower (native/simd/vattn.c, kernels_vattn.h;
SimdLib.attention_full): against a float64 softmax attention at edge sizes (one row, rows and keys past a whole
block of either, head_dims not a multiple of a vector), with scores large enough to overflow an exp taken before
the maximum is subtracted; the same bits at 1 and 3 threads; the units without it
(scalar, SSSE3) saying so; bad shapes refused by name."""

import numpy as np
import pytest

from hybridinfer.backends.cpu.simd import SimdLib, supported_isas

HAVE = [i for i in supported_isas() if i in ("avx2", "avx512vnni")]
# (rows, heads, head_dim): one row; under a row block; past one key block of 240 and a partial query panel; odd dims
SHAPES = ((1, 1, 72), (1, 3, 64), (47, 2, 72), (300, 3, 72), (513, 2, 64), (257, 1, 33), (130, 2, 100), (20, 1, 1))


def _case(n, nh, hd, seed=0, shift=0.0):
    rng = np.random.default_rng([seed, n, nh, hd])
    q, k, v = (rng.standard_normal((nh, n, hd)).astype(np.float32) for _ in range(3))
    if shift:  # a shared component: every score raised by shift² (exp of it overflows float32)
        q[:, :, 0] = k[:, :, 0] = np.float32(shift)
    return q, k, v


def _ref(q, k, v, scale):
    """float64 softmax attention -> (out [n, nh, hd], the float64 weights p [nh, n, n])."""
    s = np.einsum("hid,hjd->hij", q.astype(np.float64), k.astype(np.float64)) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hij,hjd->ihd", p, v.astype(np.float64)), p


def _run(isa, threads, q, k, v, scale):
    lib = SimdLib(isa, n_threads=threads)
    try:
        nh, n, hd = q.shape
        out = np.full((n, nh, hd), np.nan, np.float32)
        return lib.attention_full(q, k, v, scale, out)
    finally:
        lib.close()


def _need(isa):
    if isa not in HAVE:
        pytest.skip(f"this CPU does not run the {isa} unit")


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
@pytest.mark.parametrize("n,nh,hd", SHAPES)
def test_matches_float64_attention(isa, n, nh, hd):
    _need(isa)
    q, k, v = _case(n, nh, hd)
    scale = hd ** -0.5
    out = _run(isa, 2, q, k, v, scale)
    ref, p = _ref(q, k, v, scale)
    # a weight's relative error (its score's rounding, the exp's ulps) times |v|, summed over the keys
    bound = 2e-6 * np.einsum("hij,hjd->ihd", p, np.abs(v.astype(np.float64))) + 2e-7
    assert np.all(np.abs(out - ref) <= bound)


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
def test_large_scores_do_not_overflow(isa):
    _need(isa)
    # every score near 64² · 4 = 16384 (exp overflows past 88); keys past one block of 240, the row maxima
    # rising from block to block (the running sums rescaled), the last block partial
    n, nh, hd = 600, 2, 40
    q, k, v = _case(n, nh, hd, seed=1, shift=64.0)
    k[:, :, 1] = np.linspace(0, 3, n, dtype=np.float32)  # later keys score higher for rows with q[..., 1] > 0
    scale = 4.0
    out = _run(isa, 2, q, k, v, scale)
    ref, _ = _ref(q, k, v, scale)
    assert np.isfinite(out).all()
    # scores of 16384 hold 2^-9 in float32: the weights' relative error is of that order
    assert np.abs(out - ref).max() <= 4e-3 * np.abs(v).max()
    # and one dominant key: the output is its v row
    q1, k1, v1 = _case(300, 1, 16, seed=2)
    k1[0, 290] = q1[0, :].mean(0) * 1e4  # past the first key block
    out1 = _run(isa, 1, q1, k1, v1, 1.0)
    s1 = np.sort(np.einsum("id,jd->ij", q1[0].astype(np.float64), k1[0].astype(np.float64)), axis=1)
    rows = (np.argmax(np.einsum("id,jd->ij", q1[0], k1[0]), axis=1) == 290) & (s1[:, -1] - s1[:, -2] > 40)
    assert rows.sum() > 100
    assert np.allclose(out1[rows, 0], v1[0, 290], rtol=0, atol=1e-6)


def test_the_same_bits_at_any_thread_count():
    if not HAVE:
        pytest.skip("this CPU runs neither AVX2 nor AVX-512 (the units with the fused attention)")
    q, k, v = _case(333, 3, 72, seed=3)
    for isa in HAVE:
        outs = [_run(isa, t, q, k, v, 0.125) for t in (1, 3)]
        assert np.array_equal(outs[0], outs[1]), isa


@pytest.mark.parametrize("isa", supported_isas())
def test_units_without_it_say_so(isa):
    lib = SimdLib(isa, n_threads=1)
    try:
        has = isa in ("avx2", "avx512vnni")
        assert lib.has_attention_full == has == (lib.attention_full_floats(10, 2, 8) > 0)
        if not has:
            q = np.ones((2, 10, 8), np.float32)
            with pytest.raises(NotImplementedError, match=isa):
                lib.attention_full(q, q, q, 1.0, np.empty((10, 2, 8), np.float32))
    finally:
        lib.close()


def test_bad_shapes_are_refused_by_name():
    if not HAVE:
        pytest.skip("this CPU runs neither AVX2 nor AVX-512 (the units with the fused attention)")
    lib = SimdLib(HAVE[0], n_threads=1)
    try:
        q = np.ones((2, 10, 8), np.float32)
        out = np.empty((10, 2, 8), np.float32)
        with pytest.raises(ValueError, match=r"k has shape \(2, 8, 10\), expected \(2, 10, 8\)"):
            lib.attention_full(q, np.ones((2, 8, 10), np.float32), q, 1.0, out)
        with pytest.raises(ValueError, match=r"v has shape \(2, 11, 8\), expected \(2, 10, 8\)"):
            lib.attention_full(q, q, np.ones((2, 11, 8), np.float32), 1.0, out)
        with pytest.raises(ValueError, match=r"out has shape \(2, 10, 8\), expected \(10, 2, 8\)"):
            lib.attention_full(q, q, q, 1.0, np.empty((2, 10, 8), np.float32))
        with pytest.raises(ValueError, match=r"q must be \[heads, n, head_dim\].*\(10, 8\)"):
            lib.attention_full(q[0], q, q, 1.0, out)
        with pytest.raises(ValueError, match="k is not C-contiguous"):
            lib.attention_full(q, np.ones((2, 10, 16), np.float32)[:, :, :8], q, 1.0, out)
        with pytest.raises(TypeError, match="v must have dtype float32"):
            lib.attention_full(q, q, q.astype(np.float64), 1.0, out)
        with pytest.raises(ValueError, match="workspace must be .* at least"):
            lib.attention_full(q, q, q, 1.0, out, workspace=np.empty(5, np.float32))
        with pytest.raises(ValueError, match="scale must be finite"):
            lib.attention_full(q, q, q, float("inf"), out)
        with pytest.raises(ValueError, match="head_dim 0"):
            lib.attention_full_floats(10, 2, 0)
    finally:
        lib.close()

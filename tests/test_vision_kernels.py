"""The CPU vision tower's row kernels (backends/cpu/vision_kernels.py) against the numpy formulas they replace (the
reference ops of backends/vision.py), to float32 rounding, and on RowPool's thread splits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridinfer.backends.cpu import vision_kernels as vk


def _x(shape, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def test_exp32_within_2_ulp_of_exp():
    x = np.linspace(-87, 88, 400_001, dtype=np.float32)
    out = np.empty_like(x)
    vk.exp_vec(x, out)
    want = np.exp(x.astype(np.float64))
    assert float((np.abs(out - want) / want).max()) <= 2 * 2.0 ** -24
    vk.exp_vec(np.array([-1e4, 0, 1e4], np.float32), out[:3])  # clamped: finite, not inf or 0
    assert np.isfinite(out[:3]).all() and out[1] == 1 and 0 < out[0] < 1e-37


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_softmax_rows_equals_formula(threads):
    sc = _x((37, 301), seed=1)
    want = sc.astype(np.float64) * np.float32(0.3)
    want = np.exp(want - want.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    got = sc.copy()
    pool = vk.RowPool(threads)
    pool.run(vk.softmax_rows, (got,), np.float32(0.3))
    pool.close()
    assert float(np.abs(got - want).max()) <= 1e-6 and np.allclose(got.sum(1), 1, atol=1e-6)
    assert float((np.abs(got - want) / want).max()) <= 1e-5


def test_layer_norm_rows_equals_reference():
    from hybridinfer.backends.vision import RefVisionOps

    x, w, b = _x((9, 130), seed=2) + 5, _x(130, seed=3), _x(130, seed=4)
    ref = RefVisionOps(None, None, None)
    ref._vec = {"n.weight": w, "n.bias": b}
    want = ref.layer_norm(x, "n", 1e-6)
    got = np.empty_like(x)
    vk.layer_norm_rows(x, got, w, b, 1e-6)
    assert float(np.abs(got - want).max()) <= 4 * 2.0 ** -24 * float(np.abs(want).max())


def test_gelus_equal_formulas():
    from hybridinfer.backends.vision import RefVisionOps

    x = np.concatenate([_x((4, 500), seed=5), np.linspace(-12, 12, 2000, dtype=np.float32).reshape(4, 500)])
    xd = x.astype(np.float64)
    want = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    got = np.empty_like(x)
    vk.gelu_tanh_rows(x, got, np.zeros(500, np.float32))
    assert float((np.abs(got - want) / np.maximum(np.abs(xd), 1)).max()) <= 1e-6
    vk.gelu_erf_rows(x, got, np.zeros(500, np.float32))
    assert np.array_equal(got, RefVisionOps(None, None, None).gelu_erf(x))  # the same float64 erf, rounded


def test_rope_heads_equals_model_rotate():
    from hybridinfer.models.qwen3vl_vision import rope_tables, rotate

    cos, sin = rope_tables(4, 6, 2, 16)
    qkv = _x((24, 3, 5, 16), seed=6)
    qh, kt, vh = (np.full(shape, np.nan, np.float32) for shape in ((5, 24, 16), (5, 16, 24), (5, 24, 16)))
    vk.rope_heads(0, 10, qkv, cos, sin, qh, kt, vh)
    vk.rope_heads(10, 24, qkv, cos, sin, qh, kt, vh)
    assert np.array_equal(qh, rotate(qkv[:, 0], cos, sin).transpose(1, 0, 2))
    assert np.array_equal(kt, rotate(qkv[:, 1], cos, sin).transpose(1, 2, 0))
    assert np.array_equal(vh, qkv[:, 2].transpose(1, 0, 2))


def test_cpu_ops_equal_reference_ops_and_leave_inputs():
    """CPUVisionOps' row ops (the SIMD library's) and rotary attention (one rotating pass, softmax on the pool) against
    RefVisionOps; attention_heads in several blocks with a short last one."""
    from hybridinfer.backends.cpu.simd import SimdLib
    from hybridinfer.backends.cpu.vision import CPUVisionOps
    from hybridinfer.backends.vision import RefVisionOps, attention_blocks
    from hybridinfer.models import qwen3vl_vision

    cpu = CPUVisionOps(None, None, qwen3vl_vision, SimdLib(n_threads=2))
    ref = RefVisionOps(None, None, qwen3vl_vision)
    cos, sin = qwen3vl_vision.rope_tables(10, 6, 2, 8)
    qkv = _x((60, 3, 3, 8), 7)
    keep = qkv.copy()
    got, want = cpu.rotary_attention(qkv, cos, sin, 0.35), ref.rotary_attention(qkv, cos, sin, 0.35)
    assert got.shape == (60, 3, 8) and np.array_equal(qkv, keep)
    assert float(np.abs(got - want).max()) <= 1e-6 * float(np.abs(want).max())
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    small = attention_blocks(q, k, v, 0.35, lambda sc, s: cpu.rows.run(vk.softmax_rows, (sc,), s), score_floats=500)
    whole = ref.attention(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), 0.35)
    assert float(np.abs(small - whole).max()) <= 1e-6 * float(np.abs(whole).max())
    x = _x((6, 40), 10)
    keep = x.copy()
    assert np.allclose(cpu.gelu_tanh(x), ref.gelu_tanh(x), rtol=1e-6, atol=1e-6) and np.array_equal(x, keep)
    assert np.array_equal(cpu.gelu_erf(x), ref.gelu_erf(x)) and np.array_equal(x, keep)
    cpu.close()


def test_row_pool_covers_every_row_once():
    seen = []

    def kernel(rows, tag):
        seen.append((tag, rows.tolist()))

    for threads, n in ((2, 7), (3, 2), (1, 5), (4, 1)):
        seen.clear()
        pool = vk.RowPool(threads)
        pool.run(kernel, (np.arange(n),), "t")
        assert sorted(r for _, rows in seen for r in rows) == list(range(n)) and all(t == "t" for t, _ in seen)
        assert len(seen) == min(threads, n)
        seen.clear()
        pool.run_ranges(lambda s, e, tag: seen.append((tag, list(range(s, e)))), n, "r")
        pool.close()
        assert sorted(r for _, rows in seen for r in rows) == list(range(n)) and len(seen) == min(threads, n)


def test_row_pool_raises_the_kernels_error():
    def kernel(rows):
        raise ValueError(f"bad rows {len(rows)}")

    pool = vk.RowPool(2)
    with pytest.raises(ValueError, match="bad rows"):
        pool.run(kernel, (np.zeros(4),))
    pool.close()


def test_one_thread_blas_holds_and_restores_the_count():
    from hybridinfer.backends.cpu import blas_threads

    if not blas_threads.available():
        pytest.skip("numpy's BLAS is not a bundled OpenBLAS: one_thread does nothing here")
    get, _ = blas_threads._funcs
    before = get()
    with blas_threads.one_thread() as held:
        assert held and get() == 1
        with blas_threads.one_thread():
            assert get() == 1
        assert get() == 1  # the inner exit leaves the outer's hold
    assert get() == before


def test_cpu_products_in_parts_equal_numpy():
    """_matmul's parts (weight columns dealt to threads; stacked products by their first axis) equal one product."""
    from types import SimpleNamespace

    from hybridinfer.backends.cpu.vision import CPUVisionOps

    ops = CPUVisionOps(None, None, None, SimpleNamespace(n_threads=3))
    a, w = _x((37, 50), 11), _x((41, 50), 12)
    got, want = ops._matmul(a, w.T, np.empty((37, 41), np.float32)), a @ w.T
    assert float(np.abs(got - want).max()) <= 1e-6 * float(np.abs(want).max())  # summation order only
    q, kt = _x((5, 9, 8), 13), _x((5, 8, 11), 14)
    out = np.empty((5, 11, 9), np.float32).transpose(0, 2, 1)  # a strided out, as the attention's
    ops._matmul(q, kt, out)
    assert float(np.abs(out - q @ kt).max()) <= 1e-6 * float(np.abs(q @ kt).max())
    ops.close()

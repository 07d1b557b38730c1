"""The vision tower's kernels (elementwise.cu's layer_norm_f32, bias_act_f32, vit_rope_split_f32; attention.cu's
attn_full) against tests/fake_cuda.py's numpy statement of each launcher, outputs poisoned with NaN: the same
functions stand in for the kernels in tests/test_vision_gpu_wiring.py, which checks the tower's wiring here."""

from __future__ import annotations

import fake_cuda
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
F32 = np.float32


def _rng(seed):
    return np.random.default_rng(seed)


def _rel(got, want) -> float:
    assert got.shape == want.shape and np.isfinite(got).all()
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("R,D,Sx,So", [(70, 48, 64, 64), (3, 1152, 1152, 1152), (33, 48, 64, 48)])
def test_layer_norm(ga, R, D, Sx, So):
    from hybridinfer.backends.gpu import k_elementwise as ke

    rng = _rng(R)
    x = (rng.standard_normal((R, Sx)) * 3 + 1).astype(F32)
    w, b = rng.standard_normal(D).astype(F32), rng.standard_normal(D).astype(F32)
    out = ga.to_gpu(np.full((R, So), np.nan, F32))
    ke.layer_norm(ga.to_gpu(x), ga.to_gpu(w), ga.to_gpu(b), 1e-6, out)
    want = fake_cuda._layer_norm(x, w, b, 1e-6, np.full((R, So), np.nan, F32))
    got = out.get()
    assert _rel(got, want) <= 1e-6 and (got[:, D:] == 0).all()


@pytest.mark.parametrize("act", ["store", "gelu_tanh", "gelu_erf", "add"])
@pytest.mark.parametrize("bias", [True, False])
def test_bias_act(ga, act, bias):
    from hybridinfer.backends.gpu import k_elementwise as ke

    rng = _rng(7)
    R, N, Sx, So = 37, 72, 72, 96
    x = (rng.standard_normal((R, Sx)) * 2).astype(F32)
    b = rng.standard_normal(N).astype(F32) if bias else None
    y0 = rng.standard_normal((R, So)).astype(F32) if act == "add" else np.full((R, So), np.nan, F32)
    out = ga.to_gpu(y0)
    ke.bias_act(ga.to_gpu(x), out, None if b is None else ga.to_gpu(b), act)
    want = fake_cuda._bias_act(x, y0.copy(), b, act)
    got = out.get()
    assert _rel(got, want) <= 2e-6
    assert np.array_equal(got[:, N:], y0[:, N:] if act == "add" else np.zeros((R, So - N), F32))


def test_bias_act_in_place(ga):
    from hybridinfer.backends.gpu import k_elementwise as ke

    rng = _rng(8)
    y, b = rng.standard_normal((9, 40)).astype(F32), rng.standard_normal(40).astype(F32)
    g = ga.to_gpu(y)
    ke.bias_act(g, g, ga.to_gpu(b))
    assert np.array_equal(g.get(), y + b)


@pytest.mark.parametrize("T,H,hd", [(140, 4, 12), (24, 16, 72)])
def test_rope_split(ga, T, H, hd):
    from hybridinfer.backends.gpu import k_elementwise as ke
    from hybridinfer.models.qwen3vl_vision import rope_tables

    rng = _rng(T)
    y = rng.standard_normal((T, 3 * H * hd)).astype(F32)
    b = rng.standard_normal(3 * H * hd).astype(F32)
    cos, sin = rope_tables(T // 4, 4, 2, hd) if T % 8 == 0 else rope_tables(14, 10, 2, hd)
    out = ga.to_gpu(np.full((3, T, H, hd), np.nan, F32))
    ke.rope_split(ga.to_gpu(y), ga.to_gpu(b), ga.to_gpu(cos), ga.to_gpu(sin), out)
    want = fake_cuda._rope_split(y, b, cos, sin, np.full((3, T, H, hd), np.nan, F32))
    assert _rel(out.get(), want) <= 1e-6


@pytest.mark.parametrize("T,H,hd", [(140, 4, 12), (200, 16, 72), (33, 2, 64)])
def test_attention_full(ga, T, H, hd):
    from hybridinfer.backends.gpu import k_attention as ka

    rng = _rng(hd)
    q, k, v = (rng.standard_normal((T, H, hd)).astype(F32) for _ in range(3))
    out = ga.to_gpu(np.full((T, H, hd), np.nan, F32))
    ka.attention_full(ga.to_gpu(q), ga.to_gpu(k), ga.to_gpu(v), out, hd ** -0.5)
    want = np.full((T, H, hd), np.nan, F32)
    fake_cuda._attention_full(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), want, hd ** -0.5)
    assert _rel(out.get(), want) <= 1e-5
    # every key counts for every row: the causal kernel's first row sees one key, this one all of them
    assert float(np.abs(out.get()[0] - v[0]).max()) > 1e-3

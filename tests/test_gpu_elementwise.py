"""elementwise.cu against numpy (hybridinfer.backends.reference_ops, hybridinfer.format.quant), outputs poisoned with
NaN."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.reference_ops import rms_norm as ref_rms_norm
from hybridinfer.backends.reference_ops import rope as ref_rope
from hybridinfer.backends.reference_ops import sigmoid as ref_sigmoid
from hybridinfer.backends.reference_ops import silu as ref_silu
from hybridinfer.format import quant

pytestmark = pytest.mark.gpu

EMBED_TYPES = [quant.F32, quant.F16, quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.Q4_K, quant.Q5_K, quant.Q6_K]


@pytest.fixture(scope="module")
def gpu():
    from pycuda import gpuarray

    from hybridinfer.backends.gpu import k_elementwise, k_gemm, loader

    loader.init()
    return gpuarray, k_elementwise, k_gemm


def _nan(gpuarray, shape):
    return gpuarray.to_gpu(np.full(shape, np.nan, np.float32))


def _close(got, ref, rtol, atol, what):
    assert np.isfinite(got).all(), f"{what}: non-finite outputs"
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("T", [1, 7, 65, 300])
@pytest.mark.parametrize("D", [64, 256, 2048, 1000])
def test_rms_norm(gpu, T, D):
    gpuarray, ke, _ = gpu
    rng = np.random.default_rng(T * D)
    x = rng.standard_normal((T, D), dtype=np.float32) * 3
    w = rng.standard_normal(D, dtype=np.float32)
    out = _nan(gpuarray, (T, D))
    ke.rms_norm(gpuarray.to_gpu(x), gpuarray.to_gpu(w), 1e-6, out=out)
    _close(out.get(), ref_rms_norm(x, w, 1e-6), 2e-6, 1e-6, f"rms_norm T={T} D={D}")


@pytest.mark.parametrize("T", [1, 65])
def test_rms_norm_head_rows(gpu, T):
    """q norm over the query halves of [query, gate] heads (rows of pitch 2*hd), into a compact buffer,
    then in place on k heads."""
    gpuarray, ke, _ = gpu
    rng = np.random.default_rng(T)
    H, hd = 4, 256
    q = rng.standard_normal((T * H, 2 * hd), dtype=np.float32)
    w = rng.standard_normal(hd, dtype=np.float32)
    out = _nan(gpuarray, (T * H, hd))
    qg = gpuarray.to_gpu(q)
    ke.rms_norm(qg, gpuarray.to_gpu(w), 1e-6, out=out)
    _close(out.get(), ref_rms_norm(q[:, :hd], w, 1e-6), 2e-6, 1e-6, "q-norm")
    ke.rms_norm(qg, gpuarray.to_gpu(w), 1e-6, out=qg)  # in place, rows of 2*hd: gate halves untouched
    got = qg.get()
    _close(got[:, :hd], ref_rms_norm(q[:, :hd], w, 1e-6), 2e-6, 1e-6, "in-place norm")
    assert np.array_equal(got[:, hd:], q[:, hd:])


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "norm"])
@pytest.mark.parametrize("T", [1, 7, 65, 300])
@pytest.mark.parametrize("H,S,n_rot", [(4, 256, 64), (2, 256, 256), (3, 96, 32)])
def test_rope_neox(gpu, T, H, S, n_rot, neox):
    gpuarray, ke, _ = gpu
    rng = np.random.default_rng(T + S + n_rot)
    x = rng.standard_normal((T, H, S), dtype=np.float32)
    pos = rng.integers(0, 300_000, T).astype(np.int32)
    pos[0] = 0
    xg = gpuarray.to_gpu(x)
    ke.rope_neox(xg, gpuarray.to_gpu(pos), n_rot, 1e7, neox=neox)
    ref = ref_rope(x, pos, n_rot, 1e7, neox=neox)
    got = xg.get()
    _close(got, ref, 1e-5, 2e-6, f"rope T={T} H={H} S={S} n_rot={n_rot}")
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:])


@pytest.mark.parametrize("qtype", EMBED_TYPES, ids=[quant.type_name(q) for q in EMBED_TYPES])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_embed_is_exact(gpu, qtype, T):
    gpuarray, ke, k_gemm = gpu
    rng = np.random.default_rng(qtype * 100 + T)
    V, D = 53, 512
    qk, _ = quant.block_info(qtype)
    raw = quant.random_blocks(qtype, V * D // qk, rng).reshape(-1)
    table = k_gemm.DeviceWeight.upload(raw, qtype, (V, D))
    ids = rng.integers(0, V, T).astype(np.int32)
    ids[-1] = V - 1
    out = _nan(gpuarray, (T, D))
    ke.embed(table, gpuarray.to_gpu(ids), out=out)
    ref = quant.dequantize(raw, qtype, (V, D))[ids]
    assert np.array_equal(out.get(), ref), f"embed {quant.type_name(qtype)}"


@pytest.mark.parametrize("n", [1, 1000, 70_001])
def test_add_and_scale(gpu, n):
    gpuarray, ke, _ = gpu
    rng = np.random.default_rng(n)
    y = rng.standard_normal(n, dtype=np.float32)
    x = rng.standard_normal(n, dtype=np.float32)
    yg = gpuarray.to_gpu(y)
    ke.add(yg, gpuarray.to_gpu(x))
    assert np.array_equal(yg.get(), y + x)
    ke.add(yg, gpuarray.to_gpu(x), a=-0.25)
    _close(yg.get(), (y + x) - np.float32(0.25) * x, 1e-6, 1e-7, "axpy")
    ke.scale(yg, 0.5)
    _close(yg.get(), ((y + x) - np.float32(0.25) * x) * np.float32(0.5), 1e-6, 1e-7, "scale")


@pytest.mark.parametrize("T", [1, 7, 65, 300])
def test_swiglu(gpu, T):
    gpuarray, ke, _ = gpu
    rng = np.random.default_rng(T)
    F = 333
    g = rng.standard_normal((T, F), dtype=np.float32) * 4
    u = rng.standard_normal((T, F), dtype=np.float32)
    out = _nan(gpuarray, (T, F))
    ke.swiglu(gpuarray.to_gpu(g), gpuarray.to_gpu(u), out=out)
    _close(out.get(), ref_silu(g) * u, 2e-6, 1e-7, "swiglu")
    gu = np.concatenate([g, u], axis=1)  # fused [gate | up] rows
    gug = gpuarray.to_gpu(gu)
    out2 = _nan(gpuarray, (T, F))
    ke.swiglu(gug, gug, out=out2, u_off=F)
    _close(out2.get(), ref_silu(g) * u, 2e-6, 1e-7, "swiglu fused")


@pytest.mark.parametrize("T", [1, 7, 65, 300])
def test_sigmoid_mul(gpu, T):
    gpuarray, ke, _ = gpu
    rng = np.random.default_rng(T)
    H, hd = 3, 256
    a = rng.standard_normal((T * H, hd), dtype=np.float32)
    qg = rng.standard_normal((T * H, 2 * hd), dtype=np.float32) * 3  # [query, gate] heads
    ag = gpuarray.to_gpu(a)
    ke.sigmoid_mul(ag, gpuarray.to_gpu(qg), g_off=hd)
    _close(ag.get(), a * ref_sigmoid(qg[:, hd:]), 2e-6, 1e-7, "attention gate")
    s = rng.standard_normal((T, 1), dtype=np.float32)
    y = rng.standard_normal((T, 500), dtype=np.float32)
    yg = gpuarray.to_gpu(y)
    ke.sigmoid_mul(yg, gpuarray.to_gpu(s), per_row=True)
    _close(yg.get(), y * ref_sigmoid(s), 2e-6, 1e-7, "shared-expert gate")


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("D", [64, 1000, 2048])
def test_dot_rows(gpu, T, D):
    gpuarray, ke, _ = gpu
    rng = np.random.default_rng(T + D)
    x = rng.standard_normal((T, D), dtype=np.float32)
    w = rng.standard_normal(D, dtype=np.float32)
    out = _nan(gpuarray, (T, 1))
    ke.dot_rows(gpuarray.to_gpu(x), gpuarray.to_gpu(w), out=out)
    want = x.astype(np.float64) @ w.astype(np.float64)
    bound = 1e-6 * np.sqrt(D) * (np.abs(x) @ np.abs(w))  # fp32 sums of D terms
    got = out.get()[:, 0]
    assert np.isfinite(got).all() and (np.abs(got - want) <= bound).all()
    from hybridinfer.errors import KernelArgumentError

    with pytest.raises(KernelArgumentError, match="dot_rows out"):
        ke.dot_rows(gpuarray.to_gpu(x), gpuarray.to_gpu(w), out=_nan(gpuarray, (T, 2)))

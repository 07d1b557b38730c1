"""GPU prefill attention (native/cuda_sm20/attention.cu via hybridinfer.backends.gpu.k_attention) against the numpy
reference reference_ops.causal_attention: odd sizes, pos0 > 0, GQA, hd up to 256, with and without
the output gate; outputs and unused cache rows poisoned with NaN."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends import reference_ops as op
from hybridinfer.errors import KernelArgumentError

pytestmark = pytest.mark.gpu


def rel_err(x, ref) -> float:
    assert np.all(np.isfinite(x)), "non-finite output (poison left or NaN produced)"
    return float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def _inputs(rs, T, pos0, H, H_kv, hd, sharp=1.0):
    n_ctx = pos0 + T + 7
    q = (sharp * rs.standard_normal((T, H, hd))).astype(np.float32)
    k = np.full((n_ctx, H_kv, hd), np.nan, np.float32)  # rows >= pos0+T must never be read
    v = np.full((n_ctx, H_kv, hd), np.nan, np.float32)
    k[: pos0 + T] = rs.standard_normal((pos0 + T, H_kv, hd))
    v[: pos0 + T] = rs.standard_normal((pos0 + T, H_kv, hd))
    gate = rs.standard_normal((T, H * hd)).astype(np.float32)
    return q, k, v, gate


CASES = [  # T, pos0, H, H_kv, hd
    (1, 0, 4, 2, 16),
    (5, 0, 4, 1, 64),
    (67, 13, 8, 2, 128),
    (300, 0, 2, 2, 256),
    (300, 517, 4, 2, 80),
    (1, 1000, 4, 4, 256),
    (67, 0, 6, 3, 32),
    (17, 40, 2, 1, 100),
]


@pytest.mark.parametrize("use_gate", [True, False])
@pytest.mark.parametrize("T,pos0,H,H_kv,hd", CASES)
def test_attention_prefill(ga, T, pos0, H, H_kv, hd, use_gate):
    from hybridinfer.backends.gpu import k_attention

    rs = np.random.default_rng(T * 1000 + pos0 + hd)
    q, k, v, gate = _inputs(rs, T, pos0, H, H_kv, hd)
    ref = op.causal_attention(q, k[: pos0 + T], v[: pos0 + T], pos0).reshape(T, H * hd)
    if use_gate:
        ref = ref * op.sigmoid(gate)
    out = ga.to_gpu(np.full((T, H, hd), np.nan, np.float32))
    k_attention.attention_prefill(ga.to_gpu(q), ga.to_gpu(k), ga.to_gpu(v), out, pos0,
                                  gate=ga.to_gpu(gate) if use_gate else None)
    assert rel_err(out.get().reshape(T, H * hd), ref) < 1e-4


@pytest.mark.parametrize("sharp", [8.0, 30.0])
def test_attention_sharp_scores(ga, sharp):
    """Large score ranges: the running maximum changes between key tiles and e^(s - m) underflows."""
    from hybridinfer.backends.gpu import k_attention

    T, pos0, H, H_kv, hd = 67, 100, 2, 1, 64
    rs = np.random.default_rng(7)
    q, k, v, _ = _inputs(rs, T, pos0, H, H_kv, hd, sharp=sharp)
    ref = op.causal_attention(q, k[: pos0 + T], v[: pos0 + T], pos0)
    out = ga.to_gpu(np.full((T, H, hd), np.nan, np.float32))
    k_attention.attention_prefill(ga.to_gpu(q), ga.to_gpu(k), ga.to_gpu(v), out, pos0)
    assert rel_err(out.get(), ref) < 1e-4


def test_attention_long_prompt(ga):
    """A prompt spanning many query and key tiles at a large offset."""
    from hybridinfer.backends.gpu import k_attention

    T, pos0, H, H_kv, hd = 1200, 2100, 2, 1, 64
    rs = np.random.default_rng(11)
    q, k, v, gate = _inputs(rs, T, pos0, H, H_kv, hd)
    ref = op.causal_attention(q, k[: pos0 + T], v[: pos0 + T], pos0).reshape(T, H * hd) * op.sigmoid(gate)
    out = ga.to_gpu(np.full((T, H, hd), np.nan, np.float32))
    k_attention.attention_prefill(ga.to_gpu(q), ga.to_gpu(k), ga.to_gpu(v), out, pos0, gate=ga.to_gpu(gate))
    assert rel_err(out.get().reshape(T, H * hd), ref) < 1e-4


def test_gate_mul(ga):
    from hybridinfer.backends.gpu import k_attention

    rs = np.random.default_rng(3)
    o = rs.standard_normal((67, 3, 16)).astype(np.float32)
    g = rs.standard_normal((67, 48)).astype(np.float32)
    d = ga.to_gpu(o)
    k_attention.gate_mul(d, ga.to_gpu(g))
    assert rel_err(d.get().reshape(67, 48), o.reshape(67, 48) * op.sigmoid(g)) < 1e-6


@pytest.mark.parametrize("T,pos0", [(1, 0), (5, 3), (67, 100)])
def test_kv_append(ga, T, pos0):
    from hybridinfer.backends.gpu import k_attention

    rs = np.random.default_rng(T + pos0)
    n_ctx, H_kv, hd = pos0 + T + 5, 2, 24
    kc = rs.standard_normal((n_ctx, H_kv, hd)).astype(np.float32)
    vc = rs.standard_normal((n_ctx, H_kv, hd)).astype(np.float32)
    kn = rs.standard_normal((T, H_kv, hd)).astype(np.float32)
    vn = rs.standard_normal((T, H_kv, hd)).astype(np.float32)
    dk, dv = ga.to_gpu(kc), ga.to_gpu(vc)
    k_attention.kv_append(ga.to_gpu(kn), ga.to_gpu(vn), dk, dv, pos0)
    kc[pos0 : pos0 + T], vc[pos0 : pos0 + T] = kn, vn
    np.testing.assert_array_equal(dk.get(), kc)
    np.testing.assert_array_equal(dv.get(), vc)


def test_attention_then_append_matches_reference_step(ga):
    """Two chunks through the GPU cache (append, then attend) equal one reference pass."""
    from hybridinfer.backends.gpu import k_attention

    rs = np.random.default_rng(5)
    H, H_kv, hd, n_ctx = 4, 2, 32, 128
    T1, T2 = 37, 5
    q = rs.standard_normal((T1 + T2, H, hd)).astype(np.float32)
    k = rs.standard_normal((T1 + T2, H_kv, hd)).astype(np.float32)
    v = rs.standard_normal((T1 + T2, H_kv, hd)).astype(np.float32)
    ref = op.causal_attention(q, k, v, 0)
    kc = ga.to_gpu(np.full((n_ctx, H_kv, hd), np.nan, np.float32))
    vc = ga.to_gpu(np.full((n_ctx, H_kv, hd), np.nan, np.float32))
    outs = []
    for a, b in ((0, T1), (T1, T1 + T2)):
        k_attention.kv_append(ga.to_gpu(k[a:b]), ga.to_gpu(v[a:b]), kc, vc, a)
        out = ga.to_gpu(np.full((b - a, H, hd), np.nan, np.float32))
        k_attention.attention_prefill(ga.to_gpu(q[a:b]), kc, vc, out, a)
        outs.append(out.get())
    assert rel_err(np.concatenate(outs), ref) < 1e-4


def test_attention_bad_arguments(ga):
    from hybridinfer.backends.gpu import k_attention

    q = ga.zeros((5, 4, 16), np.float32)
    kc = ga.zeros((8, 2, 16), np.float32)
    out = ga.zeros((5, 4, 16), np.float32)
    with pytest.raises(KernelArgumentError):
        k_attention.attention_prefill(q, kc, kc, out, 4)  # rows [4, 9) outside 8
    with pytest.raises(KernelArgumentError):
        k_attention.attention_prefill(q, kc, kc, ga.zeros((5, 4, 8), np.float32), 0)
    with pytest.raises(KernelArgumentError):
        k_attention.attention_prefill(q, ga.zeros((8, 3, 16), np.float32), kc, out, 0)  # H % H_kv
    with pytest.raises(KernelArgumentError):
        k_attention.attention_prefill(q.astype(np.float64), kc, kc, out, 0)


def _typed_cache(ga, typed: str, k, v, n: int):
    """(type id, K cache, V cache) on the card in cache type `typed`, rows [0, n) written by kv_store."""
    from hybridinfer.backends.gpu import k_attention as ka
    from hybridinfer.format.quant_types import cache_row, cache_type

    t = cache_type(typed).id
    dt, row = cache_row(t, k.shape[2])
    kc = ga.to_gpu(np.zeros((k.shape[0], k.shape[1], row), dt))
    vc = ga.to_gpu(np.zeros_like(kc.get()))
    ka.kv_store(ga.to_gpu(k[:n]), ga.to_gpu(v[:n]), kc, vc, 0, t, t)
    return t, kc, vc


@pytest.mark.parametrize("typed", ["f32", "q8_0", "f16"])
@pytest.mark.parametrize("T,pos0,H,H_kv,hd", [(67, 13, 8, 2, 128), (300, 517, 4, 2, 256), (5, 40, 4, 1, 64),
                                              (1, 1000, 4, 4, 256), (33, 0, 16, 2, 256)])
def test_register_tiled_kernel_gives_the_plain_kernels_bits(ga, monkeypatch, typed, T, pos0, H, H_kv, hd):
    """attention_tiled.cuh holds the same sums in the same order as attn_prefill_body with the same key tile: for the
    heads it takes (64, 128, 256) its output equals the plain kernel's bit for bit, over f32 and typed caches, with
    a gate, across query and key tiles, rows past the prompt poisoned."""
    from hybridinfer.backends.gpu import k_attention as ka

    rs = np.random.default_rng(T + pos0 + hd)
    q, k, v, gate = _inputs(rs, T, pos0, H, H_kv, hd)
    outs = []
    for tiled in (ka.TILED_HD, ()):
        monkeypatch.setattr(ka, "TILED_HD", tiled)
        out = ga.to_gpu(np.full((T, H, hd), np.nan, np.float32))
        if typed == "f32":
            ka.attention_prefill(ga.to_gpu(q), ga.to_gpu(k), ga.to_gpu(v), out, pos0, gate=ga.to_gpu(gate))
        else:
            t, kc, vc = _typed_cache(ga, typed, k, v, pos0 + T)
            ka.attention_prefill_kv(ga.to_gpu(q), kc, vc, out, pos0, t, t)
        outs.append(out.get())
    assert np.all(np.isfinite(outs[0])) and np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("typed", ["f32", "q8_0"])
@pytest.mark.parametrize("T,pos0,H,H_kv,hd,nseg", [(1, 5000, 4, 2, 256, 5), (40, 100, 4, 2, 64, 8),
                                                   (3, 2500, 16, 2, 128, 3), (17, 3000, 2, 1, 256, 2)])
def test_split_over_the_context_joins_to_the_whole(ga, typed, T, pos0, H, H_kv, hd, nseg):
    """nseg segments of the keys, each block writing its rows' partials, joined by attn_merge: the output of the
    unsplit call to float rounding and the reference's, also where some segments hold no key a row sees (40 rows
    after 100 positions in 8 segments of 32 keys: the last three see none) and with the gate (f32)."""
    from hybridinfer.backends.gpu import k_attention as ka

    rs = np.random.default_rng(T + pos0 + nseg)
    q, k, v, gate = _inputs(rs, T, pos0, H, H_kv, hd)
    # out and the scratch are views (slices of longer buffers) as a micro-batch's rows are: a view's gpudata is a
    # plain int, which the kernel call must convert (the two-card bench met it)
    part = ga.to_gpu(np.full((ka.SPLIT_ROWS + 1, hd + 2), np.nan, np.float32))[: ka.SPLIT_ROWS]
    outs = []
    for n in (1, nseg):
        out = ga.to_gpu(np.full((T + 2, H, hd), np.nan, np.float32))[:T]
        if typed == "f32":
            ka.attention_prefill(ga.to_gpu(q), ga.to_gpu(k), ga.to_gpu(v), out, pos0, gate=ga.to_gpu(gate)[:T],
                                 part=part, nseg=n)
        else:
            t, kc, vc = _typed_cache(ga, typed, k, v, pos0 + T)
            ka.attention_prefill_kv(ga.to_gpu(q), kc, vc, out, pos0, t, t, part=part, nseg=n)
        outs.append(out.get())
    whole, split = outs
    assert np.all(np.isfinite(split)) and rel_err(split, whole) < 1e-5
    if typed == "f32":
        ref = op.causal_attention(q, k[: pos0 + T], v[: pos0 + T], pos0).reshape(T, H * hd) * op.sigmoid(gate)
        assert rel_err(split.reshape(T, H * hd), ref) < 1e-4
    with pytest.raises(KernelArgumentError, match="scratch"):
        ka.attention_prefill(ga.to_gpu(q), ga.to_gpu(k), ga.to_gpu(v), out, pos0, nseg=2)

"""GPU prefill over K/V caches of other types (-ctk / -ctv: f16, q8_0, q4_0): the kernels that write them (kv_store),
round the queries (q_round) and rotate (kv_fwht) against gguf.quants and the numpy reference, the typed attention
against the reference over the same cache rows, and whole GPU prefills (resident and streamed, then CPU decode)
against the CPU backend at the same types; the card's K/V buffers shrink with the type."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants
from gpu_profile import PROFILE
from test_gpu_prefill import _streaming_budget

from hybridinfer.backends import reference_ops as op
from hybridinfer.engine.api import Engine
from hybridinfer.format.quant_types import cache_type

pytestmark = pytest.mark.gpu
GG = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}


def _rows(rs, T, Hkv, hd, scale=1.0):
    return (scale * rs.standard_normal((T, Hkv, hd))).astype(np.float32)


def _cache(ga, t: str, n_ctx: int, Hkv: int, hd: int):
    qt = cache_type(t)
    if t == "f32":
        return ga.to_gpu(np.full((n_ctx, Hkv, hd), np.nan, np.float32))
    if t == "f16":
        return ga.to_gpu(np.full((n_ctx, Hkv, hd), np.nan, np.float16))
    return ga.to_gpu(np.zeros((n_ctx, Hkv, hd // qt.block * qt.nbytes), np.uint8))


@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0", "lm3", "lm4"])
def test_kv_store_writes_ggml_blocks(ga, t):
    """The rows the card writes are gguf.quants' blocks of the same values at the row pos0 asks (fp16 bit for bit;
    q8_0 / q4_0 the same scales and, but for values within an ulp of a rounding edge, the same quants)."""
    from hybridinfer.backends.gpu import k_attention as ka

    rs = np.random.default_rng(3)
    T, Hkv, hd, pos0 = 37, 2, 128, 5
    k, v = _rows(rs, T, Hkv, hd), _rows(rs, T, Hkv, hd, 4.0)
    kc, vc = _cache(ga, t, 64, Hkv, hd), _cache(ga, t, 64, Hkv, hd)
    tid = cache_type(t).id
    ka.kv_store(ga.to_gpu(k), ga.to_gpu(v), kc, vc, pos0, tid, tid)
    for got, x in ((kc.get(), k), (vc.get(), v)):
        got = got[pos0 : pos0 + T].view(np.uint8).reshape(-1)
        want = np.asarray(quants.quantize(x, GG[t])).view(np.uint8).reshape(-1) if t in GG else None
        if t in ("lm3", "lm4"):  # this engine's types: the reference's blocks bit for bit (the same float steps)
            assert np.array_equal(got, op.lm_encode(x, t).reshape(-1)), t
            continue
        if t == "f16":
            assert np.array_equal(got, want)
            continue
        # gguf forms q from x * (1 / d) (q8_0) or in float64 (q4_0), ggml as 127 / amax or in float32: a value
        # within an ulp of a rounding edge may differ by one step, nothing else
        bs = cache_type(t).nbytes
        g, w = got.reshape(-1, bs), want.reshape(-1, bs)
        assert np.array_equal(g[:, :2], w[:, :2]), f"{t}: block scales differ"
        if t == "q8_0":
            dq = np.abs(g[:, 2:].view(np.int8).astype(int) - w[:, 2:].view(np.int8).astype(int))
        else:
            dq = np.abs(np.concatenate([g[:, 2:] & 15, g[:, 2:] >> 4]).astype(int)
                        - np.concatenate([w[:, 2:] & 15, w[:, 2:] >> 4]).astype(int))
        assert dq.max() <= 1 and (dq > 0).mean() <= 1e-3, t


@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0"])
def test_q_round_and_fwht(ga, t):
    """q_round: the queries as llama.cpp's flash attention takes them for K of type t (fp16, or q8_0 for the
    quantized types); kv_fwht: the reference's Walsh-Hadamard rotation (the same float32 butterflies), its own
    inverse."""
    from hybridinfer.backends.gpu import k_attention as ka

    rs = np.random.default_rng(5)
    q = rs.standard_normal((9, 4, 128)).astype(np.float32)
    g = ga.to_gpu(q)
    ka.q_round(g, cache_type(t).id)
    assert np.array_equal(g.get(), op.kv_query(q, t))
    for n in (64, 128):
        g = ga.to_gpu(q)
        ka.fwht(g, n)
        assert np.array_equal(g.get(), op.hadamard(q, n)), n
        ka.fwht(g, n)
        assert np.abs(g.get() - q).max() <= 1e-5 * np.abs(q).max()


@pytest.mark.parametrize("kt,vt", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "q4_0"),
                                   ("q8_0", "f32"), ("lm3", "lm3"), ("lm4", "q8_0")])
@pytest.mark.parametrize("T,pos0,hd", [(1, 300, 64), (67, 13, 128), (40, 0, 256)])
def test_typed_attention_matches_reference(ga, kt, vt, T, pos0, hd):
    """attn_prefill_kv over typed rows equals the reference's softmax attention over the same rows dequantized."""
    from hybridinfer.backends.gpu import k_attention as ka

    rs = np.random.default_rng(T + pos0 + hd)
    H, Hkv, n = 4, 2, pos0 + T
    q = rs.standard_normal((T, H, hd)).astype(np.float32)
    k, v = _rows(rs, n, Hkv, hd), _rows(rs, n, Hkv, hd)
    kc, vc = _cache(ga, kt, n + 3, Hkv, hd), _cache(ga, vt, n + 3, Hkv, hd)
    ka.kv_store(ga.to_gpu(k), ga.to_gpu(v), kc, vc, 0, cache_type(kt).id, cache_type(vt).id)
    kh, vh = kc.get()[:n], vc.get()[:n]
    ref = op.causal_attention(q, op.kv_decode(kh, kt, hd), op.kv_decode(vh, vt, hd), pos0)
    out = ga.to_gpu(np.full((T, H, hd), np.nan, np.float32))
    ka.attention_prefill_kv(ga.to_gpu(q), kc, vc, out, pos0, cache_type(kt).id, cache_type(vt).id)
    got = out.get()
    assert np.all(np.isfinite(got))
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def _gpu(path, budget=None, **kw):
    return Engine.load(str(path), backend="gpu", n_ctx=256, vram_budget=budget, gpu_chunk=32, card_profile=PROFILE,
                       **kw)


def _ids(n_vocab, n, seed=7):
    return [int(x) for x in np.random.default_rng(seed).integers(0, n_vocab, n)]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "f16"), ("f16", "q8_0"),
                                   ("lm3", "lm3"), ("lm4", "lm4")])
def test_gpu_prefill_at_cache_types_matches_reference(oracle_gguf, arch, kt, vt):
    """A 72-token prompt in chunks of 32 on the card (the wide oracle models: heads of 64, rotated where quantized)
    against the float reference at the same types (the CPU backend's Q8 activations move these random models' logits
    by several percent, so it is no oracle for the card's float products): logits close, the rows handed to the host
    in the type's storage and close once dequantized, then CPU decode from the handed-off state follows the
    reference's greedy tokens."""
    path = oracle_gguf(arch, "q8_0")
    cpu = Engine.load(str(path), backend="reference", n_ctx=256, cache_type_k=kt, cache_type_v=vt)
    eng = _gpu(path, cache_type_k=kt, cache_type_v=vt)
    ids = _ids(cpu.args.n_vocab, 72)
    cs, gs = cpu.new_state(), eng.new_state()
    want, got = cpu.prefill(ids, cs, all_logits=True), eng.prefill(ids, gs, all_logits=True)
    d, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    print(f"gpu vs reference [{arch} K {kt} V {vt}]: max|d| {d:.3g} of {scale:.3g}, top-1 {agree:.1%}")
    assert d <= 5e-3 * scale and agree >= 0.97
    hd = cpu.args.head_dim
    for name, t in (("k", kt), ("v", vt)):
        for x, y in zip(gs.arrays[name], cs.arrays[name], strict=True):
            if x is None:
                continue
            assert x.dtype == y.dtype and x.shape == y.shape
            a, b = op.kv_decode(x[:72], t, hd), op.kv_decode(y[:72], t, hd)
            step = {"q4_0": 0.15, "lm4": 0.2, "lm3": 0.4}.get(t, 0.02)  # a value near an edge lands a step away
            assert np.abs(a - b).max() <= step * np.abs(b).max(), (name, t)
    cl, gl = want[-1], got[-1]
    for step in range(6):
        tok = int(np.argmax(cl))
        assert int(np.argmax(gl)) == tok, f"step {step}"
        cl = cpu.backend.forward([tok], cs, all_logits=False)[-1]
        gl = eng.backend.forward([tok], gs, all_logits=False)[-1]


def test_streamed_prefill_and_vram_shrink_with_the_type(oracle_gguf):
    """Under a budget that streams the weights, a q8_0 cache still matches the resident pass; the card's state
    buffers take the type's bytes (q8_0: 34 bytes per 32 values, not 128)."""
    from hybridinfer.backends.gpu.backend import Buffers

    path = oracle_gguf("qwen35moe", "q8_0")
    full = _gpu(path, cache_type_k="q8_0", cache_type_v="q8_0")
    a32, a8 = Engine.load(str(path), backend="cpu", n_ctx=256).args, full.args
    kv32 = Buffers.nbytes(a32, 32, 1024) - Buffers.nbytes(a32, 32, 0)
    kv8 = Buffers.nbytes(a8, 32, 1024) - Buffers.nbytes(a8, 32, 0)
    assert kv8 < kv32
    streamed = _gpu(path, _streaming_budget(path), cache_type_k="q8_0", cache_type_v="q8_0")
    assert streamed.backend.gpu.placement.stream_bytes_per_pass > 0
    ids = _ids(full.args.n_vocab, 72, seed=3)
    a, b = full.prefill(ids, full.new_state(), all_logits=True), streamed.prefill(ids, streamed.new_state(),
                                                                                  all_logits=True)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()

"""The numba oracles (tests/oracles/numba_ops.py, numba_gdn.py) and the sampler in use (hybridinfer/engine/sampling.py)
against the numpy reference: each op on fresh random inputs with odd sizes, state updated identically, no allocation
at decode size, sampling reproducible and distributed as the plain sampler (tests/oracles/sampler.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
from oracles import numba_gdn as ops_gdn
from oracles import numba_ops as ops
from oracles.sampler import Sampler

from hybridinfer.backends import reference_ops as ref
from hybridinfer.backends.reference import RefOps
from hybridinfer.engine import sampling
from hybridinfer.engine.sampling import SamplingParams

TS = (1, 3, 70)


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    ops.warmup()


def rnd(rs, *shape, scale=1.0):
    return (rs.standard_normal(shape) * scale).astype(np.float32)


def rel_err(a, b):
    return float(np.max(np.abs(a.astype(np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def ggml_rms_norm(x, w, eps):
    """ggml_compute_forward_rms_norm_f32 rounding: mean narrowed to float32 before + eps."""
    x = x.astype(np.float32)
    mean = (np.sum((x * x).astype(np.float64), axis=-1, keepdims=True) / x.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    return (x * scale) * w


# norms ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", TS)
def test_rms_norm(T):
    rs = np.random.default_rng(T)
    D = 77
    x, w = rnd(rs, T, D, scale=3.0), rnd(rs, D)
    out = np.empty_like(x)
    ops.rms_norm(x, w, 1e-6, out)
    np.testing.assert_array_equal(out, ggml_rms_norm(x, w, 1e-6))
    np.testing.assert_allclose(out, ref.rms_norm_ggml(x, w, 1e-6), rtol=3e-7, atol=0)
    ops.rms_norm(x, w, 1e-6, x)  # in place
    np.testing.assert_array_equal(x, out)


@pytest.mark.parametrize("T", TS)
def test_rms_norm_heads(T):
    rs = np.random.default_rng(10 + T)
    x, w = rnd(rs, T, 5, 36), rnd(rs, 36)
    out = np.empty_like(x)
    ops.rms_norm_heads(x, w, 1e-5, out)
    np.testing.assert_array_equal(out, ggml_rms_norm(x, w, 1e-5))
    np.testing.assert_allclose(out, ref.rms_norm(x, w, 1e-5), rtol=3e-7, atol=1e-7)


# rope ----------------------------------------------------------------------------------------------
def _libm():
    name = ctypes.util.find_library("m")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    for f in ("powf", "cosf", "sinf"):
        getattr(lib, f).restype = ctypes.c_float
    lib.powf.argtypes = [ctypes.c_float, ctypes.c_float]
    lib.cosf.argtypes = lib.sinf.argtypes = [ctypes.c_float]
    return lib


def ggml_rope(x, pos0, n_rot, base, neox, ff, libm):
    """ggml_rope_cache_init's float32 angles (theta *= theta_scale) with libm's powf/cosf/sinf."""
    x = x.copy()
    T, half = x.shape[0], n_rot // 2
    ts = np.float32(libm.powf(np.float32(base), np.float32(-2.0) / np.float32(n_rot)))
    for t in range(T):
        theta = np.float32(pos0 + t)
        for i in range(half):
            th = theta / ff[i] if ff is not None else theta
            c, s = np.float32(libm.cosf(th)), np.float32(libm.sinf(th))
            i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
            a, b = x[t, :, i0].copy(), x[t, :, i1].copy()
            x[t, :, i0], x[t, :, i1] = a * c - b * s, a * s + b * c
            theta = np.float32(theta * ts)
    return x


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("with_ff", [False, True])
def test_rope(T, neox, with_ff):
    rs = np.random.default_rng(T + 2 * neox + 4 * with_ff)
    H, hd, n_rot, base = 3, 22, 12, 1e7 if neox else 10000.0
    ff = (1.0 + rs.random(n_rot // 2)).astype(np.float32) if with_ff else None
    x = rnd(rs, T, H, hd)
    pos0 = 5
    y = x.copy()
    ops.rope(y, pos0, n_rot, base, neox, ff if with_ff else ops.NO_FREQS)
    want = ref.rope(x, np.arange(pos0, pos0 + T), n_rot, base, neox, ff)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(y[..., n_rot:], x[..., n_rot:])
    libm = _libm()
    if libm is not None:  # ggml's float32 angle recurrence, to the ulp of cosf/sinf
        np.testing.assert_allclose(y, ggml_rope(x, pos0, n_rot, base, neox, ff, libm), rtol=0, atol=2e-6)


def test_rope_long_positions():
    """At large positions the float32 angle recurrence (ggml's) drifts from the float64 reference by
    ~pos * 1e-7 rad; this bounds it and checks it tracks ggml's recurrence instead."""
    rs = np.random.default_rng(7)
    x = rnd(rs, 3, 2, 64)
    pos0 = 4093
    y = x.copy()
    ops.rope(y, pos0, 64, 1e7, True, ops.NO_FREQS)
    want = ref.rope(x, np.arange(pos0, pos0 + 3), 64, 1e7, True)
    assert np.max(np.abs(y - want)) < 5e-3
    libm = _libm()
    if libm is not None:
        np.testing.assert_allclose(y, ggml_rope(x, pos0, 64, 1e7, True, None, libm), rtol=0, atol=1e-5)


# attention -----------------------------------------------------------------------------------------
def _attn_case(rs, T, pos0, H=6, Hkv=2, hd=36, n_ctx=None):
    n_ctx = n_ctx or pos0 + T + 3
    kc = np.zeros((n_ctx, Hkv, hd), np.float32)
    vc = np.zeros_like(kc)
    kc[:pos0], vc[:pos0] = rnd(rs, pos0, Hkv, hd), rnd(rs, pos0, Hkv, hd)
    k, v = rnd(rs, T, Hkv, hd), rnd(rs, T, Hkv, hd)
    q, gate = rnd(rs, T, H, hd, scale=2.0), rnd(rs, T, H * hd)
    return q, k, v, kc, vc, gate


def _attn_want(q, kc, vc, pos0, gate):
    T, H, hd = q.shape
    o = ref.causal_attention(q, kc[: pos0 + T], vc[: pos0 + T], pos0).reshape(T, H * hd)
    return o * ref.sigmoid(gate) if gate is not None else o


@pytest.mark.parametrize("T,pos0", [(1, 0), (1, 150), (3, 7), (70, 33)])
@pytest.mark.parametrize("gated", [True, False])
def test_attention(T, pos0, gated):
    rs = np.random.default_rng(T * 1000 + pos0 + gated)
    q, k, v, kc, vc, gate = _attn_case(rs, T, pos0)
    ops.kv_append(k, v, kc, vc, pos0)
    np.testing.assert_array_equal(kc[pos0 : pos0 + T], k)
    np.testing.assert_array_equal(vc[pos0 : pos0 + T], v)
    H, hd = q.shape[1], q.shape[2]
    g = gate if gated else ops.NO_GATE
    want = _attn_want(q, kc, vc, pos0, gate if gated else None)
    out = np.full((T, H * hd), np.nan, np.float32)
    ops.attention(q, kc, vc, pos0, g, out, np.zeros(ops.attention_scratch_size(kc.shape[0], H, 2, hd), np.float32))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_split_qgate():
    rs = np.random.default_rng(3)
    T, H, hd = 3, 5, 12
    qg = rnd(rs, T, H * 2 * hd)
    q, gate = np.empty((T, H, hd), np.float32), np.empty((T, H * hd), np.float32)
    ops.split_qgate(qg, q, gate)
    r = qg.reshape(T, H, 2, hd)
    np.testing.assert_array_equal(q, r[:, :, 0])
    np.testing.assert_array_equal(gate, r[:, :, 1].reshape(T, H * hd))


# GDN -----------------------------------------------------------------------------------------------
class _FakeLayer:
    """Stands in for reference.Layer: projections return preset outputs (ssm_out: identity)."""

    def __init__(self, proj, **tensors):
        self.proj = proj
        self.__dict__.update(tensors)

    def __getitem__(self, short):  # a block's tensor by short name, as models/graph.BlockTensors
        return self.__dict__[short]

    def mm(self, attr, x, expert=None):
        return x if attr == "ssm_out" else self.proj[attr]


def _gdn_case(rs, Hk=2, Hv=6, dk=12, dv=10, K=4):
    C = 2 * Hk * dk + Hv * dv
    w = dict(ssm_conv1d=rnd(rs, C, K, scale=0.5), ssm_a=-np.exp(rnd(rs, Hv)),
             ssm_dt_bias=rnd(rs, Hv), ssm_norm=(1.0 + 0.1 * rnd(rs, dv)).astype(np.float32))
    return C, w


def _gdn_inputs(rs, T, C, Hv, dv):
    a = rnd(rs, T, Hv, scale=2.0)
    if T > 1:
        a[0, 0] = 30.0  # softplus passthrough branch
    return dict(attn_qkv=rnd(rs, T, C), attn_gate=rnd(rs, T, Hv * dv), ssm_beta=rnd(rs, T, Hv), ssm_alpha=a)


@pytest.mark.parametrize("head_map", ["mod", "div"])
def test_gdn_layer(head_map):
    rs = np.random.default_rng(1 if head_map == "mod" else 2)
    Hk, Hv, dk, dv, K, eps = 2, 6, 12, 10, 4, 1e-6
    C, w = _gdn_case(rs, Hk, Hv, dk, dv, K)
    args = SimpleNamespace(ssm_n_k_heads=Hk, ssm_n_v_heads=Hv, ssm_d_k=dk, ssm_d_v=dv, rms_eps=eps,
                           gdn_head_map=head_map)
    st = SimpleNamespace(conv=[np.zeros((K - 1, C), np.float32)], ssm=[np.zeros((Hv, dk, dv), np.float32)])
    conv, S = st.conv[0].copy(), st.ssm[0].copy()
    conv_ch, S_ch = conv.copy(), S.copy()
    scratch = np.zeros(ops_gdn.gdn_scratch_size(C, Hv, dv), np.float32)  # one token at a time
    scratch_ch = np.zeros(ops_gdn.gdn_scratch_size(C, Hv, dv, 16), np.float32)  # chunks of 16 tokens
    for T in (3, 70, 1, 1):  # crosses the conv window start, a long chunk, then decode steps
        proj = _gdn_inputs(rs, T, C, Hv, dv)
        L = _FakeLayer(proj, **w)
        want = RefOps.gdn(SimpleNamespace(a=args, L=L, i=0, st=st), proj["attn_qkv"], proj["attn_gate"],
                          proj["ssm_beta"], proj["ssm_alpha"], conv="ssm_conv1d", a="ssm_a", dt_bias="ssm_dt_bias",
                          norm="ssm_norm")
        y = np.full((T, Hv * dv), np.nan, np.float32)
        y_ch = np.full_like(y, np.nan)
        call = (proj["attn_qkv"], proj["attn_gate"], proj["ssm_beta"], proj["ssm_alpha"], w["ssm_conv1d"],
                w["ssm_a"], w["ssm_dt_bias"], w["ssm_norm"])
        ops_gdn.gdn_layer(*call, conv, S, Hk, head_map == "mod", eps, y, scratch)
        ops_gdn.gdn_layer(*call, conv_ch, S_ch, Hk, head_map == "mod", eps, y_ch, scratch_ch)
        assert rel_err(y, want) < 1e-5, rel_err(y, want)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        np.testing.assert_array_equal(conv, st.conv[0])
        assert rel_err(S, st.ssm[0]) < 1e-5
        np.testing.assert_array_equal(y_ch, y)  # token chunking changes nothing
        np.testing.assert_array_equal(S_ch, S)
        np.testing.assert_array_equal(conv_ch, conv)


def test_gdn_head_map_matters():
    rs = np.random.default_rng(5)
    Hk, Hv, dk, dv = 2, 6, 12, 10
    C, w = _gdn_case(rs, Hk, Hv, dk, dv)
    p = _gdn_inputs(rs, 3, C, Hv, dv)
    ys = []
    for mod in (True, False):
        y = np.zeros((3, Hv * dv), np.float32)
        ops_gdn.gdn_layer(p["attn_qkv"], p["attn_gate"], p["ssm_beta"], p["ssm_alpha"], w["ssm_conv1d"], w["ssm_a"],
                          w["ssm_dt_bias"], w["ssm_norm"], np.zeros((3, C), np.float32),
                          np.zeros((Hv, dk, dv), np.float32), Hk, mod, 1e-6, y,
                          np.zeros(ops_gdn.gdn_scratch_size(C, Hv, dv), np.float32))
        ys.append(y)
    assert np.abs(ys[0] - ys[1]).max() > 0.1


# MoE -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", TS)
def test_moe_route(T):
    rs = np.random.default_rng(20 + T)
    E, k = 37, 5
    logits = rnd(rs, T, E, scale=2.0)
    logits[:, 3] = logits[:, 11] = logits[:, 30] = 9.0  # exact ties: lower index first
    logits[0, 20] = -1000.0  # underflows to P = 0
    idx, w = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
    ops.moe_route(logits, k, idx, w)
    widx, ww = ref.moe_route(logits, k)
    np.testing.assert_array_equal(idx, widx)
    np.testing.assert_allclose(w, ww, rtol=2e-7, atol=0)
    assert list(idx[0, :3]) == [3, 11, 30]


def test_moe_route_all_tied():
    logits = np.zeros((2, 9), np.float32)
    idx, w = np.zeros((2, 4), np.int32), np.zeros((2, 4), np.float32)
    ops.moe_route(logits, 4, idx, w)
    np.testing.assert_array_equal(idx, [[0, 1, 2, 3]] * 2)
    np.testing.assert_allclose(w, 0.25, rtol=1e-7)


@pytest.mark.parametrize("T", TS)
def test_ffn_helpers(T):
    rs = np.random.default_rng(40 + T)
    D, F, k = 33, 45, 3
    g, u = rnd(rs, T, F, scale=3.0), rnd(rs, T, F)
    out = np.empty_like(g)
    ops.swiglu(g, u, out)
    np.testing.assert_allclose(out, ref.silu(g) * u, rtol=1e-6, atol=1e-7)
    h, y = rnd(rs, T, D), rnd(rs, T, D)
    h2 = h.copy()
    ops.add_inplace(h2, y)
    np.testing.assert_array_equal(h2, h + y)
    x, s, wsh = rnd(rs, T, D), rnd(rs, T, D), rnd(rs, D, scale=0.3)
    o = h.copy()
    ops.gated_add(o, s, x, wsh)
    gate = ref.sigmoid((x.astype(np.float64) @ wsh.astype(np.float64)).astype(np.float32))
    np.testing.assert_allclose(o, h + gate[:, None] * s, rtol=1e-6, atol=1e-6)
    ys, wk = rnd(rs, T * k, D), rs.random((T, k)).astype(np.float32)
    o = np.full((T, D), np.nan, np.float32)
    ops.moe_combine(ys, wk, o)
    want = np.einsum("tk,tkd->td", wk.astype(np.float64), ys.reshape(T, k, D).astype(np.float64))
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)


# no allocation at decode size -----------------------------------------------------------------------
def test_decode_calls_allocate_nothing():
    from numba.core.runtime import _nrt_python, rtsys

    rs = np.random.default_rng(9)
    D, H, Hkv, hd, n_ctx, E, k, V = 2048, 8, 2, 64, 600, 64, 4, 50_000
    x, wn, out = rnd(rs, 1, D), rnd(rs, D), np.zeros((1, D), np.float32)
    q, kc, vc = rnd(rs, 1, H, hd), rnd(rs, n_ctx, Hkv, hd), rnd(rs, n_ctx, Hkv, hd)
    gate, ao = rnd(rs, 1, H * hd), np.zeros((1, H * hd), np.float32)
    ascr = np.zeros(ops.attention_scratch_size(n_ctx, H, Hkv, hd), np.float32)
    Hk, Hv, dk, dv = 2, 6, 32, 32
    C, w = _gdn_case(rs, Hk, Hv, dk, dv)
    p = _gdn_inputs(rs, 1, C, Hv, dv)
    conv, S, y = np.zeros((3, C), np.float32), np.zeros((Hv, dk, dv), np.float32), np.zeros((1, Hv * dv), np.float32)
    gscr = np.zeros(ops_gdn.gdn_scratch_size(C, Hv, dv), np.float32)
    lg, idx, rw = rnd(rs, 1, E), np.zeros((1, k), np.int32), np.zeros((1, k), np.float32)
    logits, hist = rnd(rs, V, scale=3.0), rs.integers(0, V, 64).astype(np.int32)
    sscr, rng = sampling.SampleScratch(V), sampling.rng_new(1)
    gdn = (p["attn_qkv"], p["attn_gate"], p["ssm_beta"], p["ssm_alpha"], w["ssm_conv1d"], w["ssm_a"], w["ssm_dt_bias"],
           w["ssm_norm"], conv, S, Hk, True, 1e-6, y, gscr)

    calls = [
        (ops.rms_norm, (x, wn, 1e-6, out)),
        (ops.rms_norm_heads, (q, wn[:hd], 1e-6, q)),
        (ops.rope, (q, 500, 32, 1e7, True, ops.NO_FREQS)),
        (ops.kv_append, (q[:, :Hkv], q[:, :Hkv], kc, vc, 500)),
        (ops.attention, (q, kc, vc, 500, gate, ao, ascr)),
        (ops_gdn.gdn_layer, gdn),
        (ops.moe_route, (lg, k, idx, rw)),
        (ops.swiglu, (x, out, out)),
        (ops.add_inplace, (out, x)),
        (ops.gated_add, (out, x, x, wn)),
        (ops.moe_combine, (x, rw[:, :1], out)),
    ] + [(sampling.sample, (logits, 0.8, tk, 0.9, 0.05, 1.1, 0.1, 0.2, hist, 64, 64, rng, sscr.xs, sscr.idx))
         for tk in (0, 40)]
    for fn, args in calls:
        fn(*args)
    was_on = _nrt_python.memsys_stats_enabled()
    _nrt_python.memsys_enable_stats()
    try:
        tracemalloc.start()
        for fn, args in calls:
            # unboxing each array argument takes one small NRT record; anything more is an allocation
            n_arrays = sum(isinstance(a, np.ndarray) for a in args)
            for _ in range(3):
                before = rtsys.get_allocation_stats().alloc
                fn(*args)
                n = rtsys.get_allocation_stats().alloc - before
                assert n == n_arrays, f"{fn.__name__}: {n - n_arrays} numba allocations per call"
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        if not was_on:
            _nrt_python.memsys_disable_stats()
    assert peak < 16_384, f"{peak} bytes of Python allocations in decode-size calls"


# sampling ------------------------------------------------------------------------------------------
def _nb_sample(logits, p: SamplingParams, hist, rng, scr):
    return sampling.sample(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty,
                              p.presence_penalty, p.frequency_penalty, hist, len(hist), p.repeat_last_n, rng, scr.xs,
                              scr.idx)


def _ref_distribution(logits, p: SamplingParams, hist):
    """The plain sampler's (oracles/sampler.py) final candidate distribution, read by intercepting its draw."""

    class Rec:
        def choice(self, n, p):
            self.n, self.p = n, p
            return self.pick

    s = Sampler(p)
    s.rng = Rec()
    s.rng.pick = 0
    s(logits, hist)
    probs = np.zeros(len(logits))
    w = s.rng.p.copy()
    for i in range(s.rng.n):
        s.rng.pick = i
        probs[s(logits, hist)] = w[i]
    return probs


def test_sample_greedy_exact():
    rs = np.random.default_rng(11)
    for V in (7, 1000, 248_320):
        scr, rng = sampling.SampleScratch(V), sampling.rng_new(0)
        for trial in range(4):
            logits = rnd(rs, V, scale=3.0)
            if trial == 1:
                logits[[5, 2]] = logits.max() + 1.0  # tie: lower id wins
            hist = rs.integers(0, V, 20).astype(np.int32)
            if trial == 2:
                hist[:] = np.argmax(logits)  # the penalty moves the arg max
            for rp, pp, fp in ((1.0, 0.0, 0.0), (1.3, 0.5, 0.0), (1.0, 0.0, 0.7), (1.2, 0.3, 0.4)):
                p = SamplingParams(temperature=0.0, repeat_penalty=rp, presence_penalty=pp, frequency_penalty=fp,
                                   repeat_last_n=8)
                assert _nb_sample(logits, p, hist, rng, scr) == Sampler(p)(logits, hist)
                assert sampling.choose(logits, p, hist, len(hist), rng, scr) == Sampler(p)(logits, hist)


def test_choose_greedy_takes_samples_pick_on_ties_masks_and_nan():
    """sampling.choose's greedy fast path (numpy's arg max) picks what sample's loop picks: the lowest id of tied
    maxima, a row masked to -inf but for a few, an all -inf row (id 0), and rows with NaN (sample's rule: NaN is
    passed by, except at id 0)."""
    rs = np.random.default_rng(5)
    V = 248_320
    scr, rng = sampling.SampleScratch(V), sampling.rng_new(0)
    p = SamplingParams(temperature=0.0)
    hist = np.zeros(0, np.int32)
    rows = []
    x = rnd(rs, V, scale=3.0)
    x[[9000, 17, 200_000]] = x.max() + 2.0
    rows.append(x)
    m = np.full(V, -np.inf, np.float32)
    m[[40, 41, 7]] = (1.0, 2.0, 2.0)
    rows += [m, np.full(V, -np.inf, np.float32)]
    for where in ((0,), (3,), (123_456, 5)):
        y = rnd(rs, V, scale=3.0)
        y[list(where)] = np.nan
        rows.append(y)
    for x in rows:
        assert sampling.choose(x, p, hist, 0, rng, scr) == _nb_sample(x, p, hist, rng, scr)
    assert sampling.choose(rows[0], p, hist, 0, rng, scr) == 17 and sampling.choose(m, p, hist, 0, rng, scr) == 7


@pytest.mark.parametrize("params", [
    dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.1, repeat_penalty=1.5, presence_penalty=0.3),
    dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, frequency_penalty=0.6, repeat_last_n=16),
    dict(temperature=1.5, top_k=0, top_p=0.95, min_p=0.05, repeat_penalty=0.8, repeat_last_n=0),
])
def test_sample_distribution(params):
    rs = np.random.default_rng(len(str(params)))
    V, N = 12, 20_000
    logits = rnd(rs, V, scale=1.5)
    logits[7] = logits[3]  # a tie inside the candidates
    hist = np.array([3, 3, 9, 0], np.int32)
    p = SamplingParams(**params)
    want = _ref_distribution(logits, p, hist)
    scr, rng = sampling.SampleScratch(V), sampling.rng_new(1234)
    counts = np.bincount([_nb_sample(logits, p, hist, rng, scr) for _ in range(N)], minlength=V)
    freq = counts / N
    assert np.all(counts[want == 0] == 0), (counts, want)
    sd = np.sqrt(want * (1 - want) / N)
    assert np.all(np.abs(freq - want) <= 5 * sd + 1e-3), (freq, want)


def test_sample_reproducible_and_large_vocab():
    rs = np.random.default_rng(12)
    V = 248_320
    logits = rnd(rs, V, scale=4.0)
    hist = rs.integers(0, V, 64).astype(np.int32)
    scr = sampling.SampleScratch(V)
    for p in (SamplingParams(top_k=40, seed=7), SamplingParams(top_k=0, top_p=0.9, min_p=0.0, seed=7),
              SamplingParams(top_k=0, top_p=0.5, min_p=0.02, repeat_penalty=1.2, seed=7)):
        runs = []
        for seed in (7, 7, 8):
            rng = sampling.rng_new(seed)
            runs.append([_nb_sample(logits, p, hist, rng, scr) for _ in range(30)])
        assert runs[0] == runs[1]
        assert runs[0] != runs[2]
        if p.top_k:
            top = set(np.argsort(-logits.astype(np.float64), kind="stable")[: p.top_k].tolist())
            assert set(runs[0]) <= top

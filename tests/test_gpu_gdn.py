"""GPU Gated DeltaNet prefill (native/cuda_sm20/gdn.cu via hybridinfer.backends.gpu.k_gdn) against the numpy reference
ops as ReferenceModel.gdn composes them: each kernel alone and the whole chain, odd sizes, carried
conv/S state, both head maps, and snapshots equal to the reference state after that many tokens.
Outputs are poisoned with NaN before each run."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends import reference_ops as op

pytestmark = pytest.mark.gpu
EPS = 1e-6


def rel_err(x, ref) -> float:
    assert np.all(np.isfinite(x)), "non-finite output (poison left or NaN produced)"
    if ref.size == 0:
        return 0.0
    return float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def nan(ga, shape):
    return ga.to_gpu(np.full(shape, np.nan, np.float32))


def make_case(seed, T, Hk, Hv, dk, dv, K):
    rs = np.random.default_rng(seed)
    C = 2 * Hk * dk + Hv * dv
    r = lambda *s, scale=1.0: (scale * rs.standard_normal(s)).astype(np.float32)  # noqa: E731
    a = r(T, Hv, scale=2.0)
    a[0, 0] = 30.0  # softplus passthrough branch
    return dict(u=r(T, C), z=r(T, Hv * dv), b=r(T, Hv), a=a, conv_w=r(C, K, scale=0.5),
                ssm_a=-np.exp(r(Hv, scale=0.5)).astype(np.float32), dt_bias=r(Hv, scale=0.5),
                norm_w=(1.0 + 0.1 * r(dv)).astype(np.float32), conv0=r(K - 1, C), S0=r(Hv, dk, dv, scale=0.3),
                Hk=Hk, dk=dk)


def kmap(Hk, Hv, head_map):
    return np.arange(Hv) % Hk if head_map == "mod" else np.arange(Hv) // (Hv // Hk)


def ref_qkv(c, Hk, dk, Hv, dv):
    """Split and L2-normalise as ReferenceModel.gdn: (q scaled by 1/sqrt(d_k), k, v)."""
    T = c.shape[0]
    q = c[:, : Hk * dk].reshape(T, Hk, dk)
    k = c[:, Hk * dk : 2 * Hk * dk].reshape(T, Hk, dk)
    v = c[:, 2 * Hk * dk :].reshape(T, Hv, dv)
    return op.l2_norm(q, EPS) / np.float32(np.sqrt(dk)), op.l2_norm(k, EPS), v


def ref_gdn(cs, head_map, n=None):
    """(y, conv state, S) of the reference after the first n tokens (all when None)."""
    n = cs["u"].shape[0] if n is None else n
    Hk, dk = cs["Hk"], cs["dk"]
    Hv, _, dv = cs["S0"].shape
    if n == 0:
        return np.zeros((0, Hv, dv), np.float32), cs["conv0"].copy(), cs["S0"].copy()
    c, conv1 = op.causal_conv(cs["u"][:n], cs["conv0"], cs["conv_w"])
    q, k, v = ref_qkv(op.silu(c), Hk, dk, Hv, dv)
    km = kmap(Hk, Hv, head_map)
    g = cs["ssm_a"][None, :] * op.softplus(cs["a"][:n] + cs["dt_bias"][None, :])
    S = cs["S0"].copy()
    o = op.delta_rule(q[:, km], k[:, km], v, g, op.sigmoid(cs["b"][:n]), S)
    y = op.rms_norm(o, cs["norm_w"], EPS) * op.silu(cs["z"][:n].reshape(n, Hv, dv))
    return y, conv1, S


SHAPES = [  # T, H_k, H_v, d_k, d_v, K, head_map
    (1, 2, 6, 16, 16, 4, "mod"),
    (5, 2, 6, 16, 16, 4, "div"),
    (67, 1, 2, 128, 128, 4, "mod"),
    (300, 2, 4, 32, 48, 4, "mod"),
    (67, 2, 6, 12, 10, 3, "div"),
    (5, 1, 2, 256, 64, 4, "mod"),
    (67, 2, 4, 16, 32, 1, "mod"),
]


def snaps_for(T):
    return np.array(sorted({p for p in (0, 1, 3, 64, T - 1, T) if 0 <= p <= T}), np.int32)


@pytest.mark.parametrize("T,Hk,Hv,dk,dv,K,head_map", SHAPES)
def test_gdn_prefill_chain(ga, T, Hk, Hv, dk, dv, K, head_map):
    from hybridinfer.backends.gpu import k_gdn

    cs = make_case(T * 7 + dk + dv + K, T, Hk, Hv, dk, dv, K)
    y_ref, conv_ref, S_ref = ref_gdn(cs, head_map)
    snap = snaps_for(T)
    conv = ga.to_gpu(cs["conv0"])
    S = ga.to_gpu(cs["S0"])
    y = nan(ga, (T, Hv, dv))
    snap_conv = nan(ga, (len(snap), K - 1, cs["u"].shape[1]))
    snap_S = nan(ga, (len(snap), Hv, dk, dv))
    up = {n: ga.to_gpu(cs[n]) for n in ("u", "z", "a", "b", "conv_w", "ssm_a", "dt_bias", "norm_w")}
    k_gdn.gdn_prefill(up["u"], up["z"], up["a"], up["b"], up["conv_w"], up["ssm_a"], up["dt_bias"], up["norm_w"],
                      conv, S, y, Hk, dk, EPS, head_map=head_map, snap_pos=ga.to_gpu(snap), snap_conv=snap_conv,
                      snap_S=snap_S)
    assert rel_err(y.get(), y_ref) < 1e-4
    assert rel_err(conv.get(), conv_ref) == 0.0
    assert rel_err(S.get(), S_ref) < 1e-4
    sc, sS = snap_conv.get(), snap_S.get()
    for i, p in enumerate(snap):
        _, conv_p, S_p = ref_gdn(cs, head_map, int(p))
        assert rel_err(sc[i], conv_p) == 0.0, f"conv snapshot at {p}"
        assert rel_err(sS[i], S_p) < 1e-4, f"S snapshot at {p}"


def test_gdn_chunks_carry_state(ga):
    """Prefill in chunks 67 + 5 + 1 through the same state buffers equals one reference pass."""
    from hybridinfer.backends.gpu import k_gdn

    T, Hk, Hv, dk, dv, K = 73, 2, 4, 32, 32, 4
    cs = make_case(99, T, Hk, Hv, dk, dv, K)
    y_ref, conv_ref, S_ref = ref_gdn(cs, "mod")
    conv, S = ga.to_gpu(cs["conv0"]), ga.to_gpu(cs["S0"])
    ys = []
    for a, b in ((0, 67), (67, 72), (72, 73)):
        part = {n: ga.to_gpu(np.ascontiguousarray(cs[n][a:b])) for n in ("u", "z", "a", "b")}
        y = nan(ga, (b - a, Hv, dv))
        k_gdn.gdn_prefill(part["u"], part["z"], part["a"], part["b"], ga.to_gpu(cs["conv_w"]), ga.to_gpu(cs["ssm_a"]),
                          ga.to_gpu(cs["dt_bias"]), ga.to_gpu(cs["norm_w"]), conv, S, y, Hk, dk, EPS)
        ys.append(y.get())
    assert rel_err(np.concatenate(ys), y_ref) < 1e-4
    assert rel_err(conv.get(), conv_ref) == 0.0
    assert rel_err(S.get(), S_ref) < 1e-4


@pytest.mark.parametrize("T,K", [(1, 4), (5, 4), (67, 4), (300, 3), (130, 2)])
def test_conv_silu_and_state(ga, T, K):
    from hybridinfer.backends.gpu import k_gdn

    cs = make_case(T + K, T, 2, 6, 16, 16, K)
    C = cs["u"].shape[1]
    c_ref, conv_ref = op.causal_conv(cs["u"], cs["conv0"], cs["conv_w"])
    c = nan(ga, (T, C))
    u, conv = ga.to_gpu(cs["u"]), ga.to_gpu(cs["conv0"])
    k_gdn.conv_silu(u, conv, ga.to_gpu(cs["conv_w"]), c)
    assert rel_err(c.get(), op.silu(c_ref)) < 1e-5
    snap = snaps_for(T)
    sc = nan(ga, (len(snap), K - 1, C))
    k_gdn.conv_state_update(u, conv, ga.to_gpu(snap), sc)
    np.testing.assert_array_equal(conv.get(), conv_ref)
    for i, p in enumerate(snap):
        np.testing.assert_array_equal(sc.get()[i], ref_gdn(cs, "mod", int(p))[1])


@pytest.mark.parametrize("T,Hk,dk", [(1, 2, 16), (67, 3, 128), (300, 1, 256), (5, 2, 20)])
def test_l2norm_qk(ga, T, Hk, dk):
    from hybridinfer.backends.gpu import k_gdn

    rs = np.random.default_rng(T + dk)
    Hv, dv = 2 * Hk, 8
    c = rs.standard_normal((T, 2 * Hk * dk + Hv * dv)).astype(np.float32)
    q, k, _ = ref_qkv(c, Hk, dk, Hv, dv)
    ref = c.copy()
    ref[:, : Hk * dk] = q.reshape(T, -1)
    ref[:, Hk * dk : 2 * Hk * dk] = k.reshape(T, -1)
    d = ga.to_gpu(c)
    k_gdn.l2norm_qk(d, Hk, dk, EPS)
    assert rel_err(d.get(), ref) < 1e-5


@pytest.mark.parametrize("T,Hk,Hv,dk,dv,head_map", [(1, 2, 6, 16, 16, "mod"), (67, 2, 4, 128, 128, "div"),
                                                    (300, 1, 3, 64, 40, "mod"), (17, 1, 1, 200, 33, "mod")])
def test_delta_rule(ga, T, Hk, Hv, dk, dv, head_map):
    from hybridinfer.backends.gpu import k_gdn

    cs = make_case(T + dk + dv, T, Hk, Hv, dk, dv, 4)
    rs = np.random.default_rng(T)
    c = rs.standard_normal(cs["u"].shape).astype(np.float32)
    q, k, v = ref_qkv(c, Hk, dk, Hv, dv)
    cn = c.copy()
    cn[:, : Hk * dk] = q.reshape(T, -1)
    cn[:, Hk * dk : 2 * Hk * dk] = k.reshape(T, -1)
    km = kmap(Hk, Hv, head_map)
    g = cs["ssm_a"][None, :] * op.softplus(cs["a"] + cs["dt_bias"][None, :])
    S_ref = cs["S0"].copy()
    o_ref = op.delta_rule(q[:, km], k[:, km], v, g, op.sigmoid(cs["b"]), S_ref)
    S, o = ga.to_gpu(cs["S0"]), nan(ga, (T, Hv, dv))
    snap = np.array([p for p in (0, T // 2, T) if p <= T], np.int32)
    sS = nan(ga, (len(snap), Hv, dk, dv))
    k_gdn.delta_rule(ga.to_gpu(cn), ga.to_gpu(cs["a"]), ga.to_gpu(cs["b"]), ga.to_gpu(cs["ssm_a"]),
                     ga.to_gpu(cs["dt_bias"]), S, o, Hk, dk, head_map, ga.to_gpu(snap), sS)
    assert rel_err(o.get(), o_ref) < 1e-4
    assert rel_err(S.get(), S_ref) < 1e-4
    assert rel_err(sS.get()[-1], S_ref) < 1e-4
    assert rel_err(sS.get()[0], cs["S0"]) == 0.0


@pytest.mark.parametrize("T,Hv,dv", [(1, 2, 16), (67, 6, 128), (300, 3, 48)])
def test_gated_norm(ga, T, Hv, dv):
    from hybridinfer.backends.gpu import k_gdn

    rs = np.random.default_rng(T * Hv)
    o = rs.standard_normal((T, Hv, dv)).astype(np.float32)
    o[0, 0] *= 1e-3  # a small head
    z = rs.standard_normal((T, Hv * dv)).astype(np.float32)
    w = (1 + 0.1 * rs.standard_normal(dv)).astype(np.float32)
    ref = op.rms_norm(o, w, EPS) * op.silu(z.reshape(T, Hv, dv))
    y = nan(ga, (T, Hv, dv))
    k_gdn.gated_norm(ga.to_gpu(o), ga.to_gpu(z), ga.to_gpu(w), y, EPS)
    assert rel_err(y.get(), ref) < 1e-5
    d = ga.to_gpu(o)  # in place
    k_gdn.gated_norm(d, ga.to_gpu(z), ga.to_gpu(w), d, EPS)
    assert rel_err(d.get(), ref) < 1e-5

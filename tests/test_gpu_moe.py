"""GPU MoE routing, grouping and combination (native/cuda_sm20/moe.cu via hybridinfer.backends.gpu.k_moe) against
reference_ops.moe_route and ReferenceModel.moe's maths: exact expert ids (ties to the lower index),
renormalised weights, a stable counting sort (every (token, slot) exactly once, groups contiguous by
expert, empty experts included) and the deterministic combine with the gated shared expert.
Outputs are poisoned (NaN, or -1 for indices) before each run."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends import reference_ops as op
from hybridinfer.errors import KernelArgumentError

pytestmark = pytest.mark.gpu


def rel_err(x, ref) -> float:
    assert np.all(np.isfinite(x)), "non-finite output (poison left or NaN produced)"
    return float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def poison(ga, shape, dtype=np.float32):
    return ga.to_gpu(np.full(shape, -1 if np.dtype(dtype).kind == "i" else np.nan, dtype))


def gpu_route(ga, logits, k):
    from hybridinfer.backends.gpu import k_moe

    T = logits.shape[0]
    ids, w = poison(ga, (T, k), np.int32), poison(ga, (T, k))
    k_moe.route(ga.to_gpu(logits), k, ids, w)
    return ids, w


def gpu_group(ga, ids_np, w_np, E):
    from hybridinfer.backends.gpu import k_moe

    T, k = ids_np.shape
    out = dict(counts=poison(ga, (E,), np.int32), offsets=poison(ga, (E + 1,), np.int32),
               perm_tok=poison(ga, (T * k,), np.int32), perm_w=poison(ga, (T * k,)),
               row_of_pair=poison(ga, (T, k), np.int32))
    k_moe.group(ga.to_gpu(ids_np.astype(np.int32)), ga.to_gpu(w_np), E, out["counts"], out["offsets"],
                out["perm_tok"], out["perm_w"], out["row_of_pair"])
    return {n: a.get() for n, a in out.items()}


ROUTE_CASES = [(1, 8, 1), (5, 60, 4), (67, 256, 8), (300, 512, 16), (300, 128, 8), (17, 1000, 10), (3, 4, 4)]


@pytest.mark.parametrize("T,E,k", ROUTE_CASES)
def test_route_matches_reference(ga, T, E, k):
    rs = np.random.default_rng(T * E + k)
    logits = (2.0 * rs.standard_normal((T, E))).astype(np.float32)
    ids_ref, w_ref = op.moe_route(logits, k)
    ids, w = gpu_route(ga, logits, k)
    np.testing.assert_array_equal(ids.get(), ids_ref)
    np.testing.assert_allclose(w.get(), w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,E,k", [(67, 16, 4), (5, 300, 8), (300, 64, 6)])
def test_route_ties_go_to_lower_index(ga, T, E, k):
    rs = np.random.default_rng(E)
    logits = rs.integers(-2, 2, (T, E)).astype(np.float32)  # many equal logits
    ids_ref, w_ref = op.moe_route(logits, k)
    ids, w = gpu_route(ga, logits, k)
    np.testing.assert_array_equal(ids.get(), ids_ref)
    np.testing.assert_allclose(w.get(), w_ref, rtol=1e-5, atol=1e-6)


def check_grouping(g, ids, w, E):
    T, k = ids.shape
    P = T * k
    counts = np.bincount(ids.reshape(-1), minlength=E)
    np.testing.assert_array_equal(g["counts"], counts)
    np.testing.assert_array_equal(g["offsets"], np.concatenate([[0], np.cumsum(counts)]))
    rows = g["row_of_pair"].reshape(-1)
    np.testing.assert_array_equal(np.sort(rows), np.arange(P))  # every (token, slot) exactly once
    pairs = np.arange(P)
    e_of = ids.reshape(-1)
    assert np.all(rows >= g["offsets"][e_of]) and np.all(rows < g["offsets"][e_of + 1])  # in its expert's group
    np.testing.assert_array_equal(g["perm_tok"][rows], pairs // k)
    np.testing.assert_array_equal(g["perm_w"][rows], w.reshape(-1))
    pair_of_row = np.empty(P, np.int64)
    pair_of_row[rows] = pairs
    for e in range(E):  # stable: within a group, rows follow the pair order (tokens ascending)
        seg = pair_of_row[g["offsets"][e] : g["offsets"][e + 1]]
        assert np.all(np.diff(seg) > 0)
        assert np.all(e_of[seg] == e)


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (5, 64, 2), (67, 512, 16), (300, 256, 8), (300, 1000, 4)])
def test_group_from_router(ga, T, E, k):
    rs = np.random.default_rng(T + E + k)
    logits = rs.standard_normal((T, E)).astype(np.float32)
    ids, w = gpu_route(ga, logits, k)
    ids, w = ids.get(), w.get()
    g = gpu_group(ga, ids, w, E)
    check_grouping(g, ids, w, E)
    if T * k < E:
        assert np.any(g["counts"] == 0)  # empty experts exercised


def test_group_skewed(ga):
    """All pairs on two experts (many tiles for one expert, all others empty), and repeated experts."""
    T, k, E = 300, 8, 33
    rs = np.random.default_rng(1)
    ids = np.where(rs.random((T, k)) < 0.9, 32, 0).astype(np.int32)
    w = rs.random((T, k)).astype(np.float32)
    check_grouping(gpu_group(ga, ids, w, E), ids, w, E)
    ids = np.zeros((3, 2), np.int32)
    check_grouping(gpu_group(ga, ids, np.ones((3, 2), np.float32), 1), ids, np.ones((3, 2), np.float32), 1)


@pytest.mark.parametrize("T,k,D,shared", [(1, 1, 16, False), (5, 4, 67, True), (67, 8, 300, True),
                                          (300, 16, 64, False)])
def test_combine(ga, T, k, D, shared):
    from hybridinfer.backends.gpu import k_moe

    rs = np.random.default_rng(T + k + D)
    E = 40
    ids = np.stack([rs.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rs.random((T, k)).astype(np.float32)
    g = gpu_group(ga, ids, w, E)
    Y = rs.standard_normal((T * k, D)).astype(np.float32)
    rows = g["row_of_pair"]
    ref = np.einsum("tk,tkd->td", w, Y[rows])
    sh = rs.standard_normal((T, D)).astype(np.float32)
    gl = rs.standard_normal(T).astype(np.float32)
    out = poison(ga, (T, D))
    if shared:
        ref = ref + op.sigmoid(gl)[:, None] * sh
        k_moe.combine(ga.to_gpu(Y), ga.to_gpu(rows), ga.to_gpu(w), out, ga.to_gpu(sh), ga.to_gpu(gl))
    else:
        k_moe.combine(ga.to_gpu(Y), ga.to_gpu(rows), ga.to_gpu(w), out)
    assert rel_err(out.get(), ref) < 1e-5
    # unweighted: outputs pre-scaled by perm_w
    out = poison(ga, (T, D))
    k_moe.combine(ga.to_gpu(Y * g["perm_w"][:, None]), ga.to_gpu(rows), None, out)
    assert rel_err(out.get(), np.einsum("tk,tkd->td", w, Y[rows])) < 1e-5
    o2 = ga.to_gpu(ref.astype(np.float32))
    k_moe.shared_add(o2, ga.to_gpu(sh), ga.to_gpu(gl))
    assert rel_err(o2.get(), ref + op.sigmoid(gl)[:, None] * sh) < 1e-5


def _swiglu(x, wg, wu, wd):
    return (op.silu(x @ wg.T) * (x @ wu.T)) @ wd.T


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (67, 16, 4), (300, 32, 8)])
def test_moe_end_to_end(ga, T, E, k):
    """route -> group -> gather -> (expert SwiGLU per group on the host, standing in for the grouped
    GEMMs) -> combine with the shared expert equals ReferenceModel.moe's loop."""
    from hybridinfer.backends.gpu import k_moe

    rs = np.random.default_rng(T * k)
    D, F = 24, 20
    x = rs.standard_normal((T, D)).astype(np.float32)
    w_router = (0.5 * rs.standard_normal((E, D))).astype(np.float32)
    wg, wu = (0.3 * rs.standard_normal((2, E, F, D))).astype(np.float32)
    wd = (0.3 * rs.standard_normal((E, D, F))).astype(np.float32)
    sg, su = (0.3 * rs.standard_normal((2, F, D))).astype(np.float32)
    sd = (0.3 * rs.standard_normal((D, F))).astype(np.float32)
    w_shg = rs.standard_normal(D).astype(np.float32)
    # the reference (ReferenceModel.moe with explicit weights)
    logits = x @ w_router.T
    idx, wts = op.moe_route(logits, k)
    ref = np.zeros_like(x)
    for e in np.unique(idx):
        rows, slot = np.nonzero(idx == e)
        ref[rows] += wts[rows, slot][:, None] * _swiglu(x[rows], wg[e], wu[e], wd[e])
    s = _swiglu(x, sg, su, sd)
    gate_logit = (x @ w_shg).astype(np.float32)
    ref += op.sigmoid(gate_logit)[:, None] * s
    # the GPU path
    ids, w = gpu_route(ga, logits.astype(np.float32), k)
    g = gpu_group(ga, ids.get(), w.get(), E)
    xg = poison(ga, (T * k, D))
    k_moe.gather_rows(ga.to_gpu(x), ga.to_gpu(g["perm_tok"]), xg)
    xg = xg.get()
    np.testing.assert_array_equal(xg, x[g["perm_tok"]])
    Y = np.empty_like(xg)
    for e in range(E):
        a, b = g["offsets"][e], g["offsets"][e + 1]
        if b > a:
            Y[a:b] = _swiglu(xg[a:b], wg[e], wu[e], wd[e])
    out = poison(ga, (T, D))
    k_moe.combine(ga.to_gpu(Y), ga.to_gpu(g["row_of_pair"]), w, out, ga.to_gpu(s.astype(np.float32)),
                  ga.to_gpu(gate_logit))
    assert rel_err(out.get(), ref) < 1e-4


def test_moe_bad_arguments(ga):
    from hybridinfer.backends.gpu import k_moe

    logits = ga.zeros((5, 8), np.float32)
    with pytest.raises(KernelArgumentError):
        k_moe.route(logits, 9, ga.zeros((5, 9), np.int32), ga.zeros((5, 9), np.float32))  # k > E
    with pytest.raises(KernelArgumentError):
        k_moe.route(logits, 2, ga.zeros((5, 2), np.float32), ga.zeros((5, 2), np.float32))  # ids dtype
    with pytest.raises(KernelArgumentError):
        k_moe.route(ga.zeros((5, 2000), np.float32), 2, ga.zeros((5, 2), np.int32), ga.zeros((5, 2), np.float32))

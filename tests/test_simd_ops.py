"""The C twins of the numba ops (native/simd/ops.c through SimdLib) give the numba ops' bits, and the attention
step gives what its parts give in turn."""

from __future__ import annotations

import numpy as np
import pytest
from oracles import numba_ops as ops

from hybridinfer.backends.cpu.simd import SimdLib


@pytest.fixture(scope="module")
def lib():
    return SimdLib(n_threads=2)


def _f(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("T,D", [(1, 2048), (3, 576), (5, 7)])
def test_rms_norm_and_residual_add_match_numba(lib, T, D):
    rng = np.random.default_rng(D)
    wide = _f(rng, T, D + 9, scale=3.0)  # rows as views of wider rows, as the backend's buffers
    h, y, w = wide[:, :D], _f(rng, T, D), _f(rng, D)
    for eps in (1e-6, 1e-5):
        a, b = h.copy(), h.copy()
        oa, ob = _f(rng, T, D), np.zeros((T, D + 3), np.float32)[:, :D]
        ops.add_rms_norm(a, y, w, eps, oa)
        lib.rms_norm(b, y, w, eps, ob)
        assert np.array_equal(a, b) and np.array_equal(oa, ob)
        ops.rms_norm(a, w, eps, oa)
        lib.rms_norm(b, None, w, eps, ob)
        assert np.array_equal(oa, ob)
        ops.add_inplace(a, y)
        lib.rms_norm(b, y, None, eps, None)
        assert np.array_equal(a, b)
        lib.rms_norm(b, None, w, eps, b)  # in place
        ops.rms_norm(a, w, eps, a)
        assert np.array_equal(a, b)


@pytest.mark.parametrize("T", [1, 4])
def test_per_head_norm_matches_numba(lib, T):
    rng = np.random.default_rng(T)
    H, hd = 4, 64
    q = _f(rng, T, H, hd)
    k = _f(rng, T, 2 * H * hd + 16)[:, : 2 * hd].reshape(T, 2, hd)  # heads of a view of wider rows
    w = _f(rng, hd)
    for x in (q, k):
        want = x.copy()
        ops.rms_norm_heads(want, w, 1e-6, want)
        lib.rms_norm(x, None, w, 1e-6, x)
        assert np.array_equal(x, want)


def test_split_gate_route_combine_match_numba(lib):
    rng = np.random.default_rng(5)
    T, H, hd, E, k, D = 3, 4, 16, 64, 8, 96
    qg = _f(rng, T, H * 2 * hd)
    q1, g1 = np.zeros((T, H, hd), np.float32), np.zeros((T, H * hd), np.float32)
    q2, g2 = q1.copy(), g1.copy()
    ops.split_qgate(qg, q1, g1)
    lib.split_qgate(qg, q2, g2)
    assert np.array_equal(q1, q2) and np.array_equal(g1, g2)
    lib.split_qgate(qg[:, : H * hd], q2, None)  # no gate: a copy
    assert np.array_equal(q2, qg[:, : H * hd].reshape(T, H, hd))
    for n in (H * hd, 16 * 256 + 3):  # one segment; segments of 256 on the pool
        o, g = _f(rng, T, n, scale=4.0), _f(rng, T, n, scale=8.0)
        o2 = o.copy()
        ops.attn_gate(o, g)
        lib.sigmoid_gate(o2, g)
        assert np.array_equal(o, o2)
    logits = _f(rng, T, E, scale=2.0)
    logits[1, 10:20] = logits[1, 3]  # ties: the lower id first
    logits[2] = -90.0  # every weight tiny: the clamped denominator
    i1, w1 = np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)
    i2, w2 = i1.copy(), w1.copy()
    ops.moe_route(logits, k, i1, w1)
    lib.moe_route(logits, k, i2, w2)
    assert np.array_equal(i1, i2) and np.array_equal(w1, w2)
    wide = _f(rng, 2, 4100, scale=2.0)  # more experts than ops.c keeps p_e of: recomputed, the same bits
    i3, w3 = np.zeros((2, 4), np.int32), np.zeros((2, 4), np.float32)
    i4, w4 = i3.copy(), w3.copy()
    ops.moe_route(wide, 4, i3, w3)
    lib.moe_route(wide, 4, i4, w4)
    assert np.array_equal(i3, i4) and np.array_equal(w3, w4)
    # few and many tokens, short and long rows
    for Tc, D in ((T, 96), (2, 1000), (300, 8), (70, 1100)):  # on the caller, in segments, in groups of 64
        wc = rng.dirichlet(np.ones(k), Tc).astype(np.float32)
        ys, s, x, w_shg = _f(rng, Tc * k, D), _f(rng, Tc, D), _f(rng, Tc, D), _f(rng, D)
        c1, c2 = np.zeros((Tc, D), np.float32), np.zeros((Tc, D), np.float32)
        ops.moe_combine(ys, wc, c1)
        lib.moe_combine(ys, wc, c2)
        assert np.array_equal(c1, c2), (Tc, D)
        ops.moe_combine_gated(ys, wc, c1, s, x, w_shg)
        lib.moe_combine(ys, wc, c2, s, x, w_shg)
        assert np.array_equal(c1, c2), (Tc, D)


@pytest.mark.parametrize("T,pos0", [(1, 0), (1, 9), (5, 3)])
def test_attention_step_is_its_parts_in_turn(lib, T, pos0):
    rng = np.random.default_rng(T + pos0)
    n_ctx, H, Hkv, hd = 16, 4, 2, 32
    kc, vc = _f(rng, n_ctx, Hkv, hd), _f(rng, n_ctx, Hkv, hd)
    kv = _f(rng, T, 3 * Hkv * hd)  # k and v as views of wider rows
    k, v = kv[:, : Hkv * hd].reshape(T, Hkv, hd), kv[:, Hkv * hd : 2 * Hkv * hd].reshape(T, Hkv, hd)
    q = _f(rng, T, H, hd)
    scratch = np.zeros(lib.attention_scratch_size(n_ctx, hd), np.float32)
    rot = (hd // 2, 10000.0, True, np.zeros(0, np.float32))
    q1, kc1, vc1, o1 = q.copy(), kc.copy(), vc.copy(), np.zeros((T, H * hd), np.float32)
    kc1[pos0 : pos0 + T], vc1[pos0 : pos0 + T] = k, v
    lib.rope(q1, pos0, *rot)
    lib.rope(kc1[pos0 : pos0 + T], pos0, *rot)
    lib.attention(q1, kc1, vc1, pos0, o1, scratch)
    o2 = np.zeros_like(o1)
    lib.attn_step(q, k, v, kc, vc, pos0, o2, scratch, *rot)
    assert np.array_equal(q, q1) and np.array_equal(kc, kc1) and np.array_equal(vc, vc1)
    assert np.array_equal(o1, o2)
    with pytest.raises(ValueError, match="outside the cache"):
        lib.attn_step(q, k, v, kc, vc, n_ctx - T + 1, o2, scratch, *rot)


@pytest.mark.parametrize("n_threads", [1, 3])
def test_attention_rows_equal_one_step_per_sequence(n_threads):
    """attn_rows (one token of each of B sequences at its own position, decode_batch): caches, roped q and outputs
    bit-identical to B attn_step calls, for any thread count; dpos moves every position on; bad lists raise."""
    lib = SimdLib(n_threads=n_threads)
    rng = np.random.default_rng(11)
    B, n_ctx, H, Hkv, hd = 4, 40, 4, 2, 32
    pos = [0, 7, 19, 38]
    caches = [(_f(rng, n_ctx, Hkv, hd), _f(rng, n_ctx, Hkv, hd)) for _ in range(B)]
    kv = _f(rng, B, 3 * Hkv * hd)
    k, v = kv[:, : Hkv * hd].reshape(B, Hkv, hd), kv[:, Hkv * hd : 2 * Hkv * hd].reshape(B, Hkv, hd)
    q = _f(rng, B, H, hd)
    scratch = np.zeros(lib.attention_scratch_size(n_ctx, hd), np.float32)
    grouped = np.zeros(lib.attention_scratch_size(n_ctx, hd, H // Hkv), np.float32)  # the heads of a K/V head together
    rot = (hd // 2, 10000.0, True, np.zeros(0, np.float32))
    for dpos, rows_scratch in ((0, scratch), (1, scratch), (0, grouped), (1, grouped)):
        want_q, want_o = q.copy(), np.zeros((B, H * hd), np.float32)
        want_c = [(kc.copy(), vc.copy()) for kc, vc in caches]
        for j in range(B):
            lib.attn_step(want_q[j : j + 1], k[j : j + 1], v[j : j + 1], *want_c[j], pos[j] + dpos,
                          want_o[j : j + 1], scratch, *rot)
        got_q, got_o = q.copy(), np.full((B, H * hd), np.nan, np.float32)
        got_c = [(kc.copy(), vc.copy()) for kc, vc in caches]
        lib.attn_rows(got_q, k, v, [c[0] for c in got_c], [c[1] for c in got_c], pos, dpos, got_o, rows_scratch,
                      *rot)
        assert np.array_equal(got_q, want_q) and np.array_equal(got_o, want_o), dpos
        for (gk, gv), (wk, wv) in zip(got_c, want_c, strict=True):
            assert np.array_equal(gk, wk) and np.array_equal(gv, wv), dpos
    with pytest.raises(ValueError, match="one K and one V cache per sequence"):
        lib.attn_rows(q, k, v, [c[0] for c in caches], [c[1] for c in caches][:-1], pos, 0, got_o, scratch, *rot)
    with pytest.raises(ValueError, match="inside the cache"):
        lib.attn_rows(q, k, v, [c[0] for c in caches], [c[1] for c in caches], pos, 2, got_o, scratch, *rot)
    lib.close()


def test_bad_arguments_are_named(lib):
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="y has shape"):
        lib.rms_norm(x, np.zeros((2, 4), np.float32), np.ones(8, np.float32), 1e-6, x)
    with pytest.raises(ValueError, match="whole heads"):
        lib.rms_norm(x, None, np.ones(3, np.float32), 1e-6, x)
    with pytest.raises(TypeError, match="w must have dtype float32"):
        lib.rms_norm(x, None, np.ones(8), 1e-6, x)
    with pytest.raises(ValueError, match="k must be in"):
        lib.moe_route(x, 9, np.zeros((2, 9), np.int32), np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="idx must be"):
        lib.moe_route(x, 2, np.zeros((2, 3), np.int32), np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="ys must be"):
        lib.moe_combine(np.zeros((3, 8), np.float32), np.zeros((2, 2), np.float32), x)
    with pytest.raises(ValueError, match="q must be"):
        lib.split_qgate(x, np.zeros((2, 8), np.float32), None)


def test_copy_many_copies_every_byte_over_the_pool(lib):
    rng = np.random.default_rng(5)
    # sizes around the native segment (256 KiB): none, a few bytes, one segment and a byte, many segments and a tail
    shapes = [(0,), (3,), ((256 << 10) // 4 + 1,), (24, 128, 129), (5, 7)]
    srcs = [rng.standard_normal(s).astype(np.float32) for s in shapes] + [rng.integers(0, 255, 999, np.uint8)]
    dsts = [np.full_like(s, 7) for s in srcs]
    lib.copy_many(dsts, srcs)
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    lib.copy_many([], [])
    with pytest.raises(ValueError, match="pair 1"):
        lib.copy_many([dsts[0], dsts[1][:2]], [srcs[0], srcs[1]])
    with pytest.raises(ValueError, match="as many sources"):
        lib.copy_many(dsts[:2], srcs[:1])
    ro = srcs[2].copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="pair 0"):
        lib.copy_many([ro], [srcs[2]])
    # rows of wider rows (a workspace's views), either side, rows past one segment each and many rows a segment
    for T, n in ((3, 7), (5, (256 << 10) // 4 + 3), (600, 300)):
        wide, src = rng.standard_normal((T, n + 5)).astype(np.float32), rng.standard_normal((T, n)).astype(np.float32)
        lib.copy_many([wide[:, 2 : 2 + n]], [src])
        assert np.array_equal(wide[:, 2 : 2 + n], src)
        out = np.zeros((T, n), np.float32)
        lib.copy_many([out, np.zeros(3, np.int8)], [wide[:, 1 : 1 + n], np.ones(3, np.int8)])
        assert np.array_equal(out, wide[:, 1 : 1 + n])
    with pytest.raises(ValueError, match="rows each contiguous"):
        lib.copy_many([np.zeros((4, 3), np.float32)], [np.ones((3, 4), np.float32).T])

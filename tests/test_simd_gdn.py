"""The native Gated DeltaNet layer (SimdLib.gdn_layer, native/simd/gdn.c) against the numba op
(tests/oracles/numba_gdn.gdn_layer, itself checked against the reference model in test_cpu_ops.py):
outputs and state bit-identical, for every ISA path this CPU runs, thread counts 1, 2, 3 and any token
chunking; bad arguments raise. `pytest -s` also prints the per-call time of both at the 35B shape."""

from __future__ import annotations

import time

import numpy as np
import pytest
from oracles import numba_gdn as ops_gdn

from hybridinfer.backends.cpu.simd import SimdLib, supported_isas

ISAS = supported_isas()
SMALL = (2, 6, 12, 10, 4)  # H_k, H_v, d_k, d_v, K
MIXED = (1, 2, 8, 40, 3)  # d_v: one register block of 32 lanes and a remainder
NOCONV = (2, 4, 16, 32, 1)  # K = 1: no conv state rows
BIG = (16, 32, 128, 128, 4)  # 35B-like: C = 8192
EPS = 1e-6


@pytest.fixture(scope="module")
def libs():
    out = {(isa, n): SimdLib(isa, n_threads=n) for isa in ISAS for n in (1, 2, 3)}
    yield out
    for lib in out.values():
        lib.close()


def _case(rs, shape, T):
    Hk, Hv, dk, dv, K = shape
    C = 2 * Hk * dk + Hv * dv
    r = lambda *s, scale=1.0: (scale * rs.standard_normal(s)).astype(np.float32)  # noqa: E731
    a = r(T, Hv, scale=2.0)
    a[0, 0] = 30.0  # softplus passthrough branch
    inputs = (r(T, C), r(T, Hv * dv), r(T, Hv), a)
    weights = (r(C, K, scale=0.5), -np.exp(r(Hv)).astype(np.float32), r(Hv),
               (1.0 + 0.1 * r(dv)).astype(np.float32))
    state = (r(K - 1, C), r(Hv, dk, dv, scale=0.1))
    return C, inputs, weights, state


def _run_numba(inputs, weights, state, Hk, mod, y, scratch):
    conv, S = state[0].copy(), state[1].copy()
    ops_gdn.gdn_layer(*inputs, *weights, conv, S, Hk, mod, EPS, y, scratch)
    return conv, S


@pytest.mark.parametrize("shape", [SMALL, MIXED, NOCONV, BIG], ids=["small", "mixed", "k1", "35b"])
@pytest.mark.parametrize("mod", [True, False], ids=["mod", "div"])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_gdn_layer_matches_numba(libs, shape, mod, T):
    rs = np.random.default_rng(T * 10 + mod + 100 * shape[0])
    Hk, Hv, dk, dv, K = shape
    C, inputs, weights, state = _case(rs, shape, T)
    y_want = np.full((T, Hv * dv), np.nan, np.float32)
    conv_want, S_want = _run_numba(inputs, weights, state, Hk, mod, y_want,
                                   np.zeros(ops_gdn.gdn_scratch_size(C, Hv, dv), np.float32))
    assert np.isfinite(y_want).all()
    libsel = libs.items() if shape != BIG or T < 17 else [(k, v) for k, v in libs.items() if k[0] == ISAS[-1]]
    for (isa, n), lib in libsel:
        for chunk, out_of_place in ((1, False), (5, True), (T, False), (T, True)):  # tokens per scratch chunk
            y = np.full_like(y_want, np.nan)
            conv, S = state[0].copy(), state[1].copy()
            src = ()
            if out_of_place:  # the old state read from conv_in / S_in, the new one written to conv / S alone
                src, conv, S = (conv, S), np.full_like(conv, np.nan), np.full_like(S, np.nan)
            scratch = np.full(ops_gdn.gdn_scratch_size(C, Hv, dv, chunk), np.nan, np.float32)
            lib.gdn_layer(*inputs, *weights, conv, S, Hk, mod, EPS, y, scratch, *src)
            what = f"{isa}, {n} threads, chunks of {chunk}, out of place {out_of_place}"
            np.testing.assert_array_equal(y, y_want, err_msg=what)
            np.testing.assert_array_equal(S, S_want, err_msg=what)
            np.testing.assert_array_equal(conv, conv_want, err_msg=what)
            for got, was in zip(src, state if src else (), strict=True):  # never written
                np.testing.assert_array_equal(got, was, err_msg=what)


def test_gdn_layer_views_and_steps(libs):
    """Row-strided views of wider projection buffers; several calls in a row carry the state."""
    rs = np.random.default_rng(7)
    Hk, Hv, dk, dv, K = SMALL
    C, _, weights, state = _case(rs, SMALL, 1)
    lib = libs[(ISAS[-1], 2)]
    conv_n, S_n = state[0].copy(), state[1].copy()
    conv_c, S_c = state[0].copy(), state[1].copy()
    scratch = np.zeros(ops_gdn.gdn_scratch_size(C, Hv, dv, 4), np.float32)
    for T in (3, 1, 1, 9):
        big = rs.standard_normal((T, C + 2 * Hv + Hv * dv + 7)).astype(np.float32)
        u, b = big[:, :C], big[:, C:C + Hv]
        a, z = big[:, C + Hv:C + 2 * Hv], big[:, C + 2 * Hv:C + 2 * Hv + Hv * dv]
        y_n = np.zeros((T, Hv * dv), np.float32)
        ybuf = np.zeros((T, Hv * dv + 3), np.float32)
        y_c = ybuf[:, :Hv * dv]
        ops_gdn.gdn_layer(u, z, b, a, *weights, conv_n, S_n, Hk, True, EPS, y_n, scratch)
        lib.gdn_layer(u, z, b, a, *weights, conv_c, S_c, Hk, True, EPS, y_c, scratch)
        np.testing.assert_array_equal(y_c, y_n)
        np.testing.assert_array_equal(S_c, S_n)
        np.testing.assert_array_equal(conv_c, conv_n)
        assert not ybuf[:, Hv * dv:].any()


def test_gdn_layer_bad_args(libs):
    rs = np.random.default_rng(3)
    Hk, Hv, dk, dv, K = SMALL
    C, inputs, weights, state = _case(rs, SMALL, 2)
    lib = libs[(ISAS[0], 1)]
    y = np.zeros((2, Hv * dv), np.float32)
    scratch = np.zeros(ops_gdn.gdn_scratch_size(C, Hv, dv), np.float32)
    good = dict(zip(["u", "z", "b", "a", "conv_w", "ssm_a", "dt_bias", "norm_w", "conv", "S"],
                    [*inputs, *weights, *state], strict=True))

    def call(**kw):
        fresh = {"conv": good["conv"].copy(), "S": good["S"].copy()}  # the state is updated in place
        lib.gdn_layer(**{**good, **fresh, "n_k_heads": Hk, "head_map_mod": True, "eps": EPS, "y": y,
                         "scratch": scratch, **kw})

    call()
    with pytest.raises(TypeError, match="u must have dtype float32"):
        call(u=good["u"].astype(np.float64))
    with pytest.raises(TypeError, match="S must have dtype float32"):
        call(S=good["S"].astype(np.float16))
    with pytest.raises(TypeError, match="z must be a numpy array"):
        call(z=good["z"].tolist())
    with pytest.raises(ValueError, match="conv_w has 60 channels"):
        call(conv_w=np.zeros((60, K), np.float32))
    with pytest.raises(ValueError, match="b has shape"):
        call(b=good["b"][:1])
    with pytest.raises(ValueError, match="u is not C-contiguous"):
        call(u=np.asfortranarray(good["u"]))
    with pytest.raises(ValueError, match="S is not C-contiguous"):
        call(S=np.zeros((Hv, dv, dk), np.float32).transpose(0, 2, 1))
    with pytest.raises(ValueError, match="conv has shape"):
        call(conv=np.zeros((K, C), np.float32))
    with pytest.raises(ValueError, match="norm_w has shape"):
        call(norm_w=np.zeros(dv + 1, np.float32))
    with pytest.raises(ValueError, match="scratch has"):
        call(scratch=np.zeros(C, np.float32))
    with pytest.raises(ValueError, match="n_k_heads must be a positive int dividing"):
        call(n_k_heads=4)
    with pytest.raises(ValueError, match="n_k_heads must be a positive int"):
        call(n_k_heads=0)
    ro = good["S"].copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="S is read-only"):
        call(S=ro)
    with pytest.raises(ValueError, match="y has shape"):
        call(y=np.zeros((3, Hv * dv), np.float32))
    with pytest.raises(ValueError, match="conv_in and S_in together"):
        call(S_in=good["S"].copy())
    with pytest.raises(ValueError, match="S_in has shape"):
        call(conv_in=good["conv"].copy(), S_in=np.zeros((Hv, dk, dv + 1), np.float32))
    half = np.zeros((2, Hv, dk, dv), np.float32)  # an old state overlapping the new one
    with pytest.raises(ValueError, match="overlap"):
        call(conv_in=good["conv"].copy(), S_in=half[0], S=half.reshape(2 * Hv, dk, dv)[Hv // 2:Hv // 2 + Hv])


def test_gdn_layer_timing(libs):
    """Per-call time at the 35B shape, one token (printed with -s); checks nothing but agreement."""
    rs = np.random.default_rng(11)
    Hk, Hv, dk, dv, K = BIG
    C, inputs, weights, state = _case(rs, BIG, 1)
    scratch = np.zeros(ops_gdn.gdn_scratch_size(C, Hv, dv), np.float32)
    y = np.zeros((1, Hv * dv), np.float32)

    def best(fn, conv, S, reps=200):
        fn(*inputs, *weights, conv, S, Hk, True, EPS, y, scratch)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(*inputs, *weights, conv, S, Hk, True, EPS, y, scratch)
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts)), 1e3 * min(ts)

    res = {"numba": best(ops_gdn.gdn_layer, state[0].copy(), state[1].copy())}
    for n in (1, 2):
        lib = libs[(ISAS[-1], n)]
        res[f"C {ISAS[-1]} {n} thr"] = best(lib.gdn_layer, state[0].copy(), state[1].copy())
    print()
    for k, (med, mn) in res.items():
        print(f"gdn_layer 35B shape T=1, {k}: median {med:.3f} ms, min {mn:.3f} ms")


@pytest.mark.parametrize("shape", [SMALL, MIXED, NOCONV], ids=["small", "mixed", "k1"])
def test_gdn_rows_equals_one_call_per_sequence(libs, shape):
    """gdn_rows (one token of each of B sequences, decode_batch): outputs and every sequence's states bit-identical
    to B one-token gdn_layer calls; bad lists raise."""
    rs = np.random.default_rng(7 + shape[1])
    Hk, Hv, dk, dv, K = shape
    B = 5
    C, inputs, weights, _ = _case(rs, shape, B)
    states = [_case(rs, shape, 1)[3] for _ in range(B)]
    per = Hv * dv + C
    for (isa, n), lib in libs.items():
        want_y = np.zeros((B, Hv * dv), np.float32)
        want = [(c.copy(), S.copy()) for c, S in states]
        for j in range(B):
            lib.gdn_layer(*(x[j : j + 1] for x in inputs), *weights, *want[j], Hk, True, EPS, want_y[j : j + 1],
                          np.zeros(per, np.float32))
        got_y = np.full((B, Hv * dv), np.nan, np.float32)
        got = [(c.copy(), S.copy()) for c, S in states]
        lib.gdn_rows(*inputs, *weights, [c for c, _ in got], [S for _, S in got], Hk, True, EPS, got_y,
                     np.zeros(B * per, np.float32))
        assert np.array_equal(got_y, want_y), (isa, n)
        for (gc, gS), (wc, wS) in zip(got, want, strict=True):
            assert np.array_equal(gc, wc) and np.array_equal(gS, wS), (isa, n)
    lib = libs[(ISAS[0], 2)]
    y = np.zeros((B, Hv * dv), np.float32)
    with pytest.raises(ValueError, match="one conv and one S per sequence"):
        lib.gdn_rows(*inputs, *weights, [c for c, _ in states][:-1], [S for _, S in states], Hk, True, EPS, y,
                     np.zeros(B * per, np.float32))
    with pytest.raises(ValueError, match="u has 5 rows for 4 sequences"):
        lib.gdn_rows(*inputs, *weights, [c for c, _ in states][:-1], [S for _, S in states][:-1], Hk, True, EPS, y,
                     np.zeros(B * per, np.float32))
    with pytest.raises(ValueError, match="scratch has"):
        lib.gdn_rows(*inputs, *weights, [c for c, _ in states], [S for _, S in states], Hk, True, EPS, y,
                     np.zeros(per, np.float32))

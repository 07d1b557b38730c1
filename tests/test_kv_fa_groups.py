"""Typed attention computes the query heads that share a K/V head together: their K.q dots (8, 4 or 1 rows at a time,
the horizontal sums of 8 by one transpose-and-add tree), a long row's tile softmax (8 rows across a vector) and its V
accumulation (4 rows at a time). How many rows a work unit takes depends on the thread count (fewer rows per unit
when there are more threads than units), so every grouping must give the same bits: one decode row and 3 prompt
rows, over a short row (one pass) and long rows (chunks of 1024 positions in tiles of 64, tails included), at every
ISA unit this CPU runs, with 8 and 6 query heads per K/V head; and the result is the attention of the cache's values
(reference_ops, float64 softmax) within float rounding (an fp16 V in one pass accumulates in fp16: within 1e-2).
Units of 8, 4, 2 and 1 rows (G = 8) and of 6 and 3 (G = 6) come out of the thread counts here. The tiled kernel
takes V's rows HI_FA_SLAB values at a time (an f32 V read in place, any other converted): a wrong slab offset or
stride would move the result off the reference. Decode rows of several sequences (attn_rows), long and short, have
their split rows merged on the pool: bit-identical to one attn_step per sequence at every thread count.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends import reference_ops as rop
from hybridinfer.backends.cpu.simd import SimdLib, supported_isas
from hybridinfer.format.quant_types import cache_row, cache_type

HKV, HD = 2, 64
THREADS = (1, 5, 16)  # units of G, G / 2 (or G) and fewer rows for the long rows here


def _run(lib, q, k, v, kc, vc, p, kt, vt):
    q, kc, vc = q.copy(), kc.copy(), vc.copy()
    out = np.full((q.shape[0], q.shape[1] * HD), np.nan, np.float32)
    scratch = np.zeros(lib.attention_scratch_size(kc.shape[0], HD, q.shape[1] // HKV), np.float32)
    lib.attn_step(q, k, v, kc, vc, p, out, scratch, HD // 4, 1.0e4, True, np.zeros(0, np.float32),
                  k_type=cache_type(kt).id, v_type=cache_type(vt).id)
    return q, kc, vc, out


@pytest.mark.parametrize("n", [300, 2100, 3075])
@pytest.mark.parametrize("G", [8, 6])
@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "f16"), ("lm4", "q8_0"), ("f16", "q4_0"),
                                   ("q8_0", "f32")])
def test_row_grouping_changes_no_bit(kt, vt, G, n):
    H = G * HKV
    rng = np.random.default_rng(n + 10 * G + len(kt))
    for isa in supported_isas():
        libs = [SimdLib(isa, n_threads=t) for t in THREADS]
        try:
            for T in (1, 3):
                p = n - T
                kc = np.zeros((n, HKV, cache_row(cache_type(kt).id, HD)[1]), cache_row(cache_type(kt).id, HD)[0])
                vc = np.zeros((n, HKV, cache_row(cache_type(vt).id, HD)[1]), cache_row(cache_type(vt).id, HD)[0])
                kc[:p] = rop.kv_encode(rng.standard_normal((p, HKV, HD)).astype(np.float32), kt)
                vc[:p] = rop.kv_encode(rng.standard_normal((p, HKV, HD)).astype(np.float32), vt)
                q = (rng.standard_normal((T, H, HD)) * 0.6).astype(np.float32)
                k = rng.standard_normal((T, HKV, HD)).astype(np.float32)
                v = rng.standard_normal((T, HKV, HD)).astype(np.float32)
                runs = [_run(lib, q, k, v, kc, vc, p, kt, vt) for lib in libs]
                for got in runs[1:]:
                    for a, b in zip(runs[0], got, strict=True):
                        assert np.array_equal(a, b), (isa, T)
                qr, kr, vr, out = runs[0]
                want = rop.causal_attention(rop.kv_query(qr, kt), rop.kv_decode(kr, kt, HD), rop.kv_decode(vr, vt, HD),
                                            p).reshape(T, H * HD)
                d, scale = float(np.abs(out - want).max()), float(np.abs(want).max())
                assert d <= (1e-2 if vt == "f16" and n <= 2048 else 1e-4) * scale, (isa, T, d, scale)
        finally:
            for lib in libs:
                lib.close()


def _filled_cache(rng, t, n, p):
    c = np.zeros((n, HKV, cache_row(cache_type(t).id, HD)[1]), cache_row(cache_type(t).id, HD)[0])
    if p:
        c[:p] = rop.kv_encode(rng.standard_normal((p, HKV, HD)).astype(np.float32), t)
    return c


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "f32")])
def test_long_decode_rows_merged_on_the_pool(kt, vt):
    """attn_rows over 3 sequences at positions 2048 (its last chunk of 1024 holds one position), 40 (not split) and
    3074 (a last chunk of 3): each sequence's output, query and caches bit-identical to its own attn_step, and the
    same bits at 1, 5 and 16 threads (the merges of the two split rows' 16 heads spread over the pool)."""
    pos, H = [2048, 40, 3074], 8 * HKV
    n_ctx, rope = max(pos) + 1, (HD // 4, 1.0e4, True, np.zeros(0, np.float32))
    types = dict(k_type=cache_type(kt).id, v_type=cache_type(vt).id)
    for isa in supported_isas():
        rng = np.random.default_rng(7)
        caches = [(_filled_cache(rng, kt, n_ctx, p), _filled_cache(rng, vt, n_ctx, p)) for p in pos]
        q = rng.standard_normal((len(pos), H, HD)).astype(np.float32)
        k, v = (rng.standard_normal((len(pos), HKV, HD)).astype(np.float32) for _ in range(2))
        outs = []
        for t in THREADS:
            lib = SimdLib(isa, n_threads=t)
            try:
                scratch = np.zeros(lib.attention_scratch_size(n_ctx, HD, H // HKV), np.float32)
                want = []
                for j, p in enumerate(pos):
                    qj, kc, vc = q[j : j + 1].copy(), caches[j][0].copy(), caches[j][1].copy()
                    o = np.full((1, H * HD), np.nan, np.float32)
                    lib.attn_step(qj, k[j : j + 1], v[j : j + 1], kc, vc, p, o, scratch, *rope, **types)
                    want.append((qj[0], kc, vc, o[0]))
                got_q, got_c = q.copy(), [(a.copy(), b.copy()) for a, b in caches]
                got_o = np.full((len(pos), H * HD), np.nan, np.float32)
                lib.attn_rows(got_q, k, v, [c[0] for c in got_c], [c[1] for c in got_c], pos, 0, got_o, scratch,
                              *rope, **types)
            finally:
                lib.close()
            for j, (wq, wk, wv, wo) in enumerate(want):
                assert np.array_equal(got_q[j], wq) and np.array_equal(got_o[j], wo), (isa, t, j)
                assert np.array_equal(got_c[j][0], wk) and np.array_equal(got_c[j][1], wv), (isa, t, j)
            outs.append(got_o)
        assert all(np.array_equal(outs[0], o) for o in outs[1:]), isa
        assert np.isfinite(outs[0]).all(), isa

"""Typed attention computes the query heads that share a K/V head together: their K.q dots (8, 4 or 1 rows at a time,
the horizontal sums of 8 by one transpose-and-add tree), a long row's tile softmax (8 rows across a vector) and its V
accumulation (4 rows at a time). How many rows a work unit takes depends on the thread count (fewer rows per unit
when there are more threads than units), so every grouping must give the same bits: one decode row and 3 prompt
rows, over a short row (one pass) and long rows (chunks of 1024 positions in tiles of 64, tails included), at every
ISA unit this CPU runs, with 8 and 6 query heads per K/V head; and the result is the attention of the cache's values
(reference_ops, float64 softmax) within float rounding (an fp16 V in one pass accumulates in fp16: within 1e-2).
Units of 8, 4, 2 and 1 rows (G = 8) and of 6 and 3 (G = 6) come out of the thread counts here.
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
@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "f16"), ("lm4", "q8_0"), ("f16", "q4_0")])
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

"""GGML_DECODE_ROWS: several sequences' decode tokens in one product, each row bit-identical to its own one-token
product (llama.cpp's decode shape), for every weight type, ISA and row count; attention likewise. This is what makes
the CPU backend's multi-sequence decode step batch-invariant and its prompt logits independent of the chunk size:
MUL_MAT over T rows takes other float shapes (tinyBLAS for F32/F16, the repacked Q4_K gemm, the tiled K-quant kernels
from 8 rows), and so does attention over T >= 2 queries (tinyBLAS's output sum)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.cpu.simd import GGML_DECODE_ROWS, GGML_MUL_MAT, GGML_MUL_MAT_ID, KERNEL_TYPES
from hybridinfer.format.quant import random_blocks

QTYPES = sorted(KERNEL_TYPES)


def _weights(qtype: int, rows: int, cols: int, rng) -> np.ndarray:
    if qtype in (0, 1):
        w = random_blocks(qtype, rows * cols, rng).reshape(-1).view(np.float32 if qtype == 0 else np.float16)
        return w.reshape(rows, cols)
    blk = 256 if KERNEL_TYPES[qtype] == "q8_K" else 32
    return random_blocks(qtype, rows * cols // blk, rng).reshape(-1)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("T", [2, 5, 9, 16])
def test_decode_rows_equal_one_token_products(libs, qtype, T):
    rng = np.random.default_rng(1000 * qtype + T)
    rows, cols = 24, 512  # rows a multiple of 8 (llama.cpp repacks such Q4_K); cols a multiple of every width
    w = _weights(qtype, rows, cols, rng)
    x = (rng.standard_normal((T, cols)) * rng.uniform(0.05, 20, (T, 1))).astype(np.float32)
    for isa, lib in libs.items():
        xq = lib.quantize(x, qtype)
        got = np.zeros((T, rows), np.float32)
        lib.matmul(w, qtype, rows, cols, xq, got, GGML_DECODE_ROWS)
        want = np.zeros((T, rows), np.float32)
        for t in range(T):
            lib.matmul(w, qtype, rows, cols, lib.quantize(x[t], qtype), want[t], GGML_MUL_MAT)
        assert np.array_equal(got, want), (isa, qtype, T)
        many = np.zeros((T, rows), np.float32)
        lib.matmul_many(xq, cols, [(w, qtype, rows, many)], GGML_DECODE_ROWS)
        assert np.array_equal(many, want), (isa, qtype, T, "matmul_many")


def test_mul_mat_over_rows_is_not_batch_invariant(libs):
    """The reason for the mode: where the unit mirrors llama.cpp's prefill shapes, MUL_MAT over 8 rows differs from
    8 one-token products (if this ever holds everywhere, the mode is redundant, not wrong)."""
    rng = np.random.default_rng(3)
    rows, cols, T = 16, 512, 8
    w = _weights(0, rows, cols, rng)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    differs = []
    for isa, lib in libs.items():
        if isa not in ("avx2", "avx512vnni"):
            continue
        out = np.zeros((T, rows), np.float32)
        lib.matmul(w, 0, rows, cols, lib.quantize(x, 0), out, GGML_MUL_MAT)
        one = np.zeros((T, rows), np.float32)
        for t in range(T):
            lib.matmul(w, 0, rows, cols, lib.quantize(x[t], 0), one[t], GGML_MUL_MAT)
        differs.append(not np.array_equal(out, one))
    if not differs:
        pytest.skip("no AVX2 unit on this CPU")
    assert all(differs)


@pytest.mark.parametrize("gate_type,down_type", [(12, 14), (8, 8), (2, 12), (13, 13), (0, 1)])
def test_moe_grouped_equals_one_token_calls(libs, gate_type, down_type):
    """moe_grouped over T tokens' routed pairs sorted by expert equals, pair by pair, the one-token MoE calls
    (moe_gate_up / moe_down at MUL_MAT_ID) that decode makes, bit for bit, on every ISA."""
    rng = np.random.default_rng(gate_type * 7 + down_type)
    E, k, T, D, F = 9, 3, 6, 512, 256
    wg = np.concatenate([_weights(gate_type, F, D, rng).reshape(-1).view(np.uint8) for _ in range(E)])
    wu = np.concatenate([_weights(gate_type, F, D, rng).reshape(-1).view(np.uint8) for _ in range(E)])
    wd = np.concatenate([_weights(down_type, D, F, rng).reshape(-1).view(np.uint8) for _ in range(E)])
    x = rng.standard_normal((T, D)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    flat = idx.reshape(-1)
    order = np.argsort(flat, kind="stable")
    srt = flat[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(srt)) + 1, [srt.size]))
    for isa, lib in libs.items():
        xq = lib.quantize(x, gate_type)
        g, u = np.zeros((T * k, F), np.float32), np.zeros((T * k, F), np.float32)
        lib.moe_grouped([(wg, gate_type), (wu, gate_type)], F, D, xq[order // k], srt[starts[:-1]], starts, [g, u],
                        GGML_DECODE_ROWS)
        h = (g / (1 + np.exp(-g)) * u).astype(np.float32)
        hq = lib.quantize(h, down_type)
        y = np.zeros((T * k, D), np.float32)
        lib.moe_grouped([(wd, down_type)], D, F, hq, srt[starts[:-1]], starts, [y], GGML_DECODE_ROWS)
        for t in range(T):
            wg1, wu1 = np.zeros((k, F), np.float32), np.zeros((k, F), np.float32)
            lib.moe_gate_up(wg, gate_type, wu, gate_type, F, D, xq[t], idx[t], wg1, wu1, GGML_MUL_MAT_ID)
            rows = np.flatnonzero(order // k == t)  # this token's pairs in the sorted order, slot by slot
            slots = order[rows] % k
            assert np.array_equal(g[rows], wg1[slots]) and np.array_equal(u[rows], wu1[slots]), (isa, t)
            y1 = np.zeros((k, D), np.float32)
            lib.moe_down(wd, down_type, D, F, hq[rows][np.argsort(slots)], idx[t], y1, GGML_MUL_MAT_ID)
            assert np.array_equal(y[rows], y1[slots]), (isa, t)
    with pytest.raises(ValueError, match="starts"):
        libs[next(iter(libs))].moe_grouped([(wd, down_type)], D, F, hq, srt[starts[:-1]], starts[::-1], [y])


@pytest.mark.parametrize("T,pos0,hd", [(2, 0, 64), (7, 5, 64), (12, 30, 32)])
def test_attention_decode_rows_equal_one_token_calls(libs, T, pos0, hd):
    """Attention of T query tokens with GGML_DECODE_ROWS: each row equals the one-token call at its position, bit
    for bit, on every ISA (the CPU backend's prompt chunks; llama.cpp's T >= 2 order, tinyBLAS's output sum on the AVX
    units, is another, tested in test_simd_ggml_shapes.py)."""
    rng = np.random.default_rng(T * 31 + pos0)
    H, Hkv, n_ctx = 4, 2, 64
    q = (rng.standard_normal((T, H, hd)) * 2).astype(np.float32)
    kc = rng.standard_normal((n_ctx, Hkv, hd)).astype(np.float32)
    vc = rng.standard_normal((n_ctx, Hkv, hd)).astype(np.float32)
    kc[pos0 + T :] = np.nan  # rows past the causal window are never read
    for isa, lib in libs.items():
        scratch = np.zeros(lib.attention_scratch_size(n_ctx, hd), np.float32)
        got = np.zeros((T, H * hd), np.float32)
        lib.attention(q, kc, vc, pos0, got, scratch, GGML_DECODE_ROWS)
        want = np.zeros_like(got)
        for t in range(T):
            lib.attention(np.ascontiguousarray(q[t : t + 1]), kc, vc, pos0 + t, want[t : t + 1], scratch)
        assert np.array_equal(got, want), (isa, T, np.abs(got - want).max())
        mm = np.zeros_like(got)
        lib.attention(q, kc, vc, pos0, mm, scratch, GGML_MUL_MAT)
        if isa not in ("avx2", "avx512vnni"):  # no tinyBLAS below AVX: one order for any T
            assert np.array_equal(mm, want), isa
        elif pos0 + T > 16:  # the mode's reason: over more cache rows than a vector's lanes, tinyBLAS's order differs
            assert not np.array_equal(mm, want), isa



def _moe_rows(lib, W, types, F, D, xq, idx, op, shared, n):
    """moe_rows of the stacked experts W = (wg, wu, wd) of types (gate, down) over n work rows; the routed outputs"""
    (wg, wu, wd), (gate_type, down_type) = W, types
    T, k = idx.shape  # idx names the last expert, so that the scratch below is exactly what the call needs
    eg, eu = np.zeros((n, F), np.float32), np.zeros((n, F), np.float32)
    hq = np.zeros((n, lib.quantize(np.zeros(F, np.float32), down_type).nbytes), np.uint8)
    ys = np.full((T * k, D), np.nan, np.float32)
    scratch = np.zeros(lib.moe_rows_scratch(n, int(idx.max()) + 1, gate_type, D), np.uint8)
    lib.moe_rows((wg, gate_type), (wu, gate_type), (wd, down_type), F, D, xq, idx, eg, eu, hq, ys, scratch, op, shared)
    return ys


@pytest.mark.parametrize("gate_type,down_type,op", [(12, 14, GGML_DECODE_ROWS), (8, 8, GGML_DECODE_ROWS),
                                                    (13, 13, GGML_DECODE_ROWS), (12, 14, GGML_MUL_MAT_ID)])
def test_moe_rows_shared_expert_rides_as_its_own_products(libs, gate_type, down_type, op):
    """moe_rows with a shared expert in its pool runs: the routed outputs are those of the call without it, and the
    shared expert's rows those of its own products (quantize, gate and up, SwiGLU, quantize, down: GGML_MUL_MAT's
    shape where the routed pairs take GGML_MUL_MAT_ID's, else the same op), bit for bit, on every ISA."""
    rng = np.random.default_rng(gate_type * 11 + down_type + op)
    E, k, T, D, F = 7, 2, 5, 512, 256
    wg, wu, wd = ([_weights(q, r, c, rng).reshape(-1).view(np.uint8) for _ in range(E)]
                  for q, r, c in ((gate_type, F, D), (gate_type, F, D), (down_type, D, F)))
    sg, su, sd = wg.pop(), wu.pop(), wd.pop()  # one expert's matrices apart: the shared expert
    W, types = (np.concatenate(wg), np.concatenate(wu), np.concatenate(wd)), (gate_type, down_type)
    x = rng.standard_normal((T, D)).astype(np.float32)
    idx = np.stack([rng.choice(E - 1, k, replace=False) for _ in range(T)]).astype(np.int32)
    idx[0, 0] = E - 2 if idx[0, 1] != E - 2 else idx[0, 0]
    sop = GGML_MUL_MAT if op == GGML_MUL_MAT_ID else op
    shared = ((sg, gate_type), (su, gate_type), (sd, down_type), np.full((T, D), np.nan, np.float32))
    for isa, lib in libs.items():
        xq = lib.quantize(x, gate_type)
        alone = _moe_rows(lib, W, types, F, D, xq, idx, op, None, T * k)
        assert np.array_equal(_moe_rows(lib, W, types, F, D, xq, idx, op, shared, T * k + T), alone), isa
        g, u, want = np.zeros((T, F), np.float32), np.zeros((T, F), np.float32), np.zeros((T, D), np.float32)
        lib.matmul(sg, gate_type, F, D, xq, g, sop)
        lib.matmul(su, gate_type, F, D, xq, u, sop)
        lib.swiglu(g, u, g)
        lib.matmul(sd, down_type, D, F, lib.quantize(g, down_type), want, sop)
        assert np.array_equal(shared[3], want), (isa, np.abs(shared[3] - want).max())
    lib = libs[next(iter(libs))]
    xq = lib.quantize(x, gate_type)
    with pytest.raises(ValueError, match="shared expert's types"):
        _moe_rows(lib, W, types, F, D, xq, idx, op, shared[:2] + ((sd, 0), shared[3]), T * k + T)
    with pytest.raises(ValueError, match="eg has shape"):
        _moe_rows(lib, W, types, F, D, xq, idx, op, shared, T * k)

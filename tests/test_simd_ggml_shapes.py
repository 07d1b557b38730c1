"""The native kernels that follow llama.cpp's own float order (ggml-cpu built for this ISA level) against their
numpy references (tests/oracles/ggml_ref.py), on every ISA level this CPU runs:

- K-quant products with ggml_op MUL_MAT / MUL_MAT_ID take llama.cpp's shape (repacked Q4_K gemv / gemm, tiled
  kernels, or vec_dot), chosen as llama.cpp chooses (native/simd/dot_kq_shapes.h);
- attention (dot, softmax with ggml's vector exp, the two output sums), SwiGLU and RoPE (kernels_attn.h, attn.c).

Levels below avx2 mirror a ggml build without SIMD. The CPU backend gives every token the one-token shapes
(GGML_DECODE_ROWS, so that no result depends on the chunking); that those are llama.cpp's is checked end to end by
tests/test_cpu_backend.py (greedy continuations equal to llama.cpp's fed one token at a time). The multi-token shapes
here stay the library's for callers that want llama.cpp's batched bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import ggml_ref as gr
from oracles import numba_ops as ops

from hybridinfer.backends import actquant_k as ak
from hybridinfer.backends.cpu.simd import GGML_MUL_MAT, GGML_MUL_MAT_ID, GGML_NONE, supported_isas
from hybridinfer.format.quant import random_blocks

WIDTH = {"scalar": 1, "ssse3": 4, "avx2": 8, "avx512vnni": 16}  # ggml_vec_dot_f32's SIMD width
EXP_WIDTH = {**WIDTH, "scalar": 4}  # ggml_v_expf's: SSE2 on every x86-64 build
ISAS = supported_isas()



def _want(isa, op, qtype, xq, raw, rows, cols, T):
    """llama.cpp's choice of kernel shape (hi_kshape in hi_simd.c) and that shape's numpy reference."""
    if WIDTH[isa] < 8:  # llama.cpp built without AVX: ggml's generic vec_dot
        return "vec_dot", ak.kquant_matmul_q8_generic(xq, raw, qtype, rows, cols)
    if op == GGML_NONE:
        return "vec_dot", ak.kquant_matmul_q8(xq, raw, qtype, rows, cols)
    if qtype == ak.Q4_K and rows % 8 == 0:
        gemm = T - T % 4 if op == GGML_MUL_MAT else 0
        return "repack", gr.kq_repack_matmul(xq, raw, rows, cols, gemm)
    if T >= 8:
        return "tiled", gr.kq_tiled_matmul(xq, raw, qtype, rows, cols)
    return "vec_dot", ak.kquant_matmul_q8(xq, raw, qtype, rows, cols)


@pytest.mark.parametrize("qtype", [ak.Q4_K, ak.Q5_K, ak.Q6_K])
def test_kquant_products_take_llama_cpp_shapes(libs, qtype):
    rng = np.random.default_rng(qtype)
    shapes_seen = set()
    # T: the group kernels take 8 tokens at a time (fewer at the end of a 32-token block, or short of the repacked
    # gemm's boundary T - T % 4, past which tokens go one at a time); rows 12 and 20 turn Q4_K to the tiled shape
    for rows, cols in ((16, 256 * 3), (12, 256 * 3), (20, 256 * 5)):
        raw = random_blocks(qtype, rows * cols // 256, rng).reshape(-1)
        for T in (1, 6, 9, 10, 11, 17, 19, 24, 30, 33):
            x = (rng.standard_normal((T, cols)) * rng.uniform(0.1, 20, (T, 1))).astype(np.float32)
            xq = ak.quantize_q8_K(x)
            vec = ak.kquant_matmul_q8(xq, raw, qtype, rows, cols)
            for isa, lib in libs.items():
                for op in (GGML_NONE, GGML_MUL_MAT, GGML_MUL_MAT_ID):
                    shape, want = _want(isa, op, qtype, xq, raw, rows, cols, T)
                    out = np.zeros((T, rows), np.float32)
                    lib.matmul(raw, qtype, rows, cols, xq, out, op)
                    assert np.array_equal(out, want), (isa, op, rows, T, shape)
                    if shape != "vec_dot" and not np.array_equal(want, vec):
                        shapes_seen.add(shape)
    # the shapes are real alternatives: they round differently from vec_dot on these rows
    if any(WIDTH[i] >= 8 for i in ISAS):
        assert shapes_seen == ({"repack", "tiled"} if qtype == ak.Q4_K else {"tiled"})



def test_q6_k_groups_of_five_to_eight_in_quartets(libs):
    """The AVX2 unit's Q6_K group kernel takes 5-8 tokens in two passes of at most 4 (kernels_rows_avx2.h): every
    count 1..8 of a group's last pass, in vec_dot's shape (NONE) and the tiled one (MUL_MAT from 8 tokens), odd rows;
    each token as its reference has it, whichever quartet it falls in."""
    rng = np.random.default_rng(61)
    rows, cols = 7, 256 * 3
    raw = random_blocks(ak.Q6_K, rows * cols // 256, rng).reshape(-1)
    for T in range(2, 17):
        x = (rng.standard_normal((T, cols)) * rng.uniform(0.1, 20, (T, 1))).astype(np.float32)
        xq = ak.quantize_q8_K(x)
        for isa, lib in libs.items():
            for op in (GGML_NONE, GGML_MUL_MAT):
                _, want = _want(isa, op, ak.Q6_K, xq, raw, rows, cols, T)
                out = np.zeros((T, rows), np.float32)
                lib.matmul(raw, ak.Q6_K, rows, cols, xq, out, op)
                assert np.array_equal(out, want), (isa, op, T)

def test_moe_calls_take_the_expert_shape(libs):
    rng = np.random.default_rng(5)
    E, F, D = 3, 16, 256
    wg = random_blocks(ak.Q4_K, E * F * D // 256, rng).reshape(-1)
    x = rng.standard_normal(D).astype(np.float32)
    xq = ak.quantize_q8_K(x[None])
    for isa, lib in libs.items():
        g, u = np.zeros((2, F), np.float32), np.zeros((2, F), np.float32)
        lib.moe_gate_up(wg, ak.Q4_K, wg, ak.Q4_K, F, D, xq[0], [2, 0], g, u, GGML_MUL_MAT_ID)
        per = wg.size // E
        for i, e in enumerate((2, 0)):
            _, want = _want(isa, GGML_MUL_MAT_ID, ak.Q4_K, xq, wg[e * per:(e + 1) * per], F, D, 1)
            assert np.array_equal(g[i], want[0]) and np.array_equal(u[i], want[0]), isa


@pytest.mark.parametrize("qtype, rows", [(ak.Q4_K, 16), (ak.Q4_K, 12), (ak.Q6_K, 16), (ak.Q5_K, 8)])
def test_grouped_experts_take_each_experts_shape(libs, qtype, rows):
    """A prompt's MoE products (moe_grouped, GGML_MUL_MAT_ID): each expert's rows as one product of that expert
    over its own tokens (llama.cpp's shape for its count: vec_dot / gemv below 8 tokens, tiled from 8)."""
    rng = np.random.default_rng(rows + qtype)
    E, cols, counts = 4, 512, (1, 5, 8, 13)
    raw = random_blocks(qtype, E * rows * cols // 256, rng).reshape(-1)
    per = raw.size // E
    n = sum(counts)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.1, 20, (n, 1))).astype(np.float32)
    xq = ak.quantize_q8_K(x)
    experts = np.array([3, 0, 2, 1], np.int32)
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    for isa, lib in libs.items():
        out = np.zeros((n, rows), np.float32)
        lib.moe_grouped([(raw, qtype)], rows, cols, xq, experts, starts, [out], GGML_MUL_MAT_ID)
        for g, e in enumerate(experts):
            r = slice(starts[g], starts[g + 1])
            want = np.zeros((counts[g], rows), np.float32)
            lib.matmul(raw[e * per:(e + 1) * per], qtype, rows, cols, np.ascontiguousarray(xq[r]), want,
                       GGML_MUL_MAT_ID)
            assert np.array_equal(out[r], want), (isa, int(e), counts[g])
            assert np.array_equal(want, _want(isa, GGML_MUL_MAT_ID, qtype, xq[r], raw[e * per:(e + 1) * per], rows,
                                              cols, counts[g])[1]), (isa, int(e))


def test_grouped_experts_beyond_one_pool_task(libs):
    """More groups than one pool task holds (130 jobs: 65 groups of gate and up): the rest run in further tasks,
    each pair's products as that expert's own."""
    rng = np.random.default_rng(3)
    E, rows, cols = 150, 8, 256
    wg = random_blocks(ak.Q4_K, E * rows * cols // 256, rng).reshape(-1)
    wu = random_blocks(ak.Q4_K, E * rows * cols // 256, rng).reshape(-1)
    per = wg.size // E
    xq = ak.quantize_q8_K(rng.standard_normal((E, cols)).astype(np.float32))
    experts = rng.permutation(E).astype(np.int32)
    starts = np.arange(E + 1, dtype=np.int64)
    for isa, lib in libs.items():
        g, u = np.zeros((E, rows), np.float32), np.zeros((E, rows), np.float32)
        lib.moe_grouped([(wg, ak.Q4_K), (wu, ak.Q4_K)], rows, cols, xq, experts, starts, [g, u], GGML_MUL_MAT_ID)
        for p, e in enumerate(experts):
            for w, got in ((wg, g), (wu, u)):
                want = np.zeros((1, rows), np.float32)
                lib.matmul(w[e * per:(e + 1) * per], ak.Q4_K, rows, cols, np.ascontiguousarray(xq[p : p + 1]), want,
                           GGML_MUL_MAT_ID)
                assert np.array_equal(got[p], want[0]), (isa, p, int(e))


@pytest.mark.parametrize("T, pos0, hd, n_ctx", [(1, 0, 64, 96), (1, 70, 64, 96), (5, 3, 64, 96), (4, 20, 24, 96),
                                                (2, 0, 16, 96), (40, 150, 64, 256), (33, 0, 24, 96)])
def test_attention_matches_reference(libs, T, pos0, hd, n_ctx):
    """Each ISA unit against the Python mirror of its llama.cpp build's float order; with scratch for one row at a
    time and with room for the heads that share a K/V head to go together (40 and 33 tokens: groups enough for
    every thread, cache blocks past the first)."""
    rng = np.random.default_rng(T * 100 + pos0)
    H, Hkv = 4, 2
    q = (rng.standard_normal((T, H, hd)) * 2).astype(np.float32)
    kc = rng.standard_normal((n_ctx, Hkv, hd)).astype(np.float32)
    vc = rng.standard_normal((n_ctx, Hkv, hd)).astype(np.float32)
    kc[pos0 + T:] = np.nan  # rows past the causal window are never read
    for isa, lib in libs.items():
        want = gr.attention(q, kc, vc, pos0, WIDTH[isa], EXP_WIDTH[isa])
        for group in (1, H // Hkv):
            out = np.full((T, H * hd), -1.0, np.float32)
            lib.attention(q, kc, vc, pos0, out, np.zeros(lib.attention_scratch_size(n_ctx, hd, group), np.float32))
            assert np.array_equal(out, want), (isa, group, np.abs(out - want).max())
        # and it is attention: close to the plain-order numba op
        plain = np.zeros_like(out)
        scratch = np.zeros(ops.attention_scratch_size(n_ctx, H, Hkv, hd), np.float32)
        ops.attention(q, kc, vc, pos0, ops.NO_GATE, plain, scratch)
        assert np.allclose(out, plain, rtol=1e-4, atol=1e-5)


def test_swiglu_and_rope_match_reference(libs):
    rng = np.random.default_rng(9)
    g = (rng.standard_normal((3, 53)) * 6).astype(np.float32)
    g[0, :4] = [-200.0, 200.0, 0.0, -90.0]  # exp overflow / underflow lanes
    u = rng.standard_normal((3, 53)).astype(np.float32)
    x = rng.standard_normal((3, 4, 32)).astype(np.float32)
    ff = rng.uniform(0.5, 2.0, 8).astype(np.float32)
    # rows of many vectors and a scalar tail
    gb = (rng.standard_normal((3, 2 * 1024 + 37)) * 6).astype(np.float32)
    ub = rng.standard_normal(gb.shape).astype(np.float32)
    for isa, lib in libs.items():
        out = np.zeros_like(g)
        lib.swiglu(g, u, out)
        assert np.array_equal(out, gr.swiglu(g, u, EXP_WIDTH[isa])), isa
        outb = np.zeros_like(gb)
        lib.swiglu(gb, ub, outb)
        assert np.array_equal(outb, gr.swiglu(gb, ub, EXP_WIDTH[isa])), isa
        for neox, freqs in ((False, ops.NO_FREQS), (True, ff)):
            y = x.copy()
            lib.rope(y, 7, 16, 10000.0, neox, freqs)
            assert np.array_equal(y, gr.rope(x, 7, 16, 10000.0, neox, freqs, fused=WIDTH[isa] >= 8)), (isa, neox)
            z = x.copy()
            ops.rope(z, 7, 16, 10000.0, neox, freqs)
            assert np.allclose(y, z, atol=1e-5)

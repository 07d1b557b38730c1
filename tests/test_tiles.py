"""Tile choice and kernel classes, pure (no GPU): choose_tile never returns a tile that spills or overflows shared
memory for the class (against the ptxas table, which tests/test_ptxas.py checks against ptxas), kernel class
options, resident blocks, the loader's cache key and compile line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridinfer.backends.gpu import cards, kclass, loader
from hybridinfer.backends.gpu.k_gemm import GEMM_TYPES, TILES_BY_CLASS, choose_tile, tile_fits, tile_usage
from hybridinfer.backends.gpu.ptxas_table import USAGE
from hybridinfer.errors import KernelArgumentError
from hybridinfer.format import quant

# every class a card or profile can be: each profile, and the real cards of each compute capability
LIMITS = [cards.profile_limits(p, sms) for p in cards.PROFILES for sms in (8, 14, 56, 132)] + [
    c.limits for c in cards.CARDS.values()] + [cards.limits_for((9, 0), 132), cards.limits_for((3, 0), 0)]
# shape families: (T, N, K, rows per group): decode-like, short and long dense prompts, MoE groups of a few
# tokens to hundreds, narrow and wide outputs
SHAPES = [(1, 2048, 2048, None), (16, 248320, 2048, None), (128, 8192, 2048, None), (947, 8192, 2048, None),
          (4096, 512, 4096, None), (947 * 8, 512, 2048, 30.0), (947 * 8, 2048, 512, 30.0), (128 * 8, 512, 2048, 4.0),
          (4096 * 8, 512, 2048, 128.0), (40, 197, 256, 6.0), (3, 64, 32, None)]


@pytest.mark.parametrize("lim", LIMITS, ids=lambda lim: f"{lim.sm}x{lim.sm_count}")
def test_choose_tile_never_spills_or_overflows(lim):
    cls = kclass.kernel_class(lim)
    for q in GEMM_TYPES:
        for T, N, K, rpg in SHAPES:
            t = choose_tile(lim, T, N, K, q, rpg)
            assert t in TILES_BY_CLASS[cls], (lim.sm, t)
            regs, spill, smem = tile_usage(cls, q, t)
            assert spill == 0, f"{quant.type_name(q)} {t} spills {spill} B in class {cls}"
            assert smem <= lim.smem_per_block and regs <= lim.regs_per_thread


def test_every_weight_type_has_a_spill_free_tile_in_every_class():
    for cls in kclass.CLASSES:
        lim = cards.profile_limits("fermi" if cls == kclass.R63 else "kepler", 14)
        for q in GEMM_TYPES:
            assert any(tile_fits(lim, q, t) for t in TILES_BY_CLASS[cls]), (cls, quant.type_name(q))


def test_every_compiled_tile_is_in_the_table():
    for cls, tiles in TILES_BY_CLASS.items():
        for q in GEMM_TYPES:
            for t in tiles:
                assert tile_usage(cls, q, t) is not None, (cls, quant.type_name(q), t)


def test_r255_choices_follow_the_measured_preference():
    k40 = cards.profile_limits("kepler", 132)
    assert choose_tile(k40, 947, 8192, 2048, quant.Q4_K) == (128, 128)  # long runs: the 128 x 128 tile
    assert choose_tile(k40, 947 * 8, 512, 2048, quant.Q4_K, 30) == (32, 256)  # MoE groups of ~30 tokens
    assert choose_tile(k40, 8, 2048, 2048, quant.Q4_K) == (16, 128)  # a few tokens
    # too few tiles for the SMs at 128 x 128: a smaller tile gives every SM a block
    assert choose_tile(k40, 128, 8192, 2048, quant.Q4_K) == (64, 128)
    assert choose_tile(replace(k40, sm_count=0), 128, 8192, 2048, quant.Q4_K) == (128, 128)


def test_r63_takes_the_largest_spill_free_lean_tile():
    fermi = cards.profile_limits("fermi", 14)
    cls = kclass.R63
    for q in GEMM_TYPES:
        dense = choose_tile(fermi, 947, 8192, 2048, q)
        moe = choose_tile(fermi, 947 * 8, 512, 2048, q, 30)
        # no spill-free tile of the preference list that the shape fills is bigger than the one chosen
        for t in ((64, 128), (64, 64), (32, 256), (32, 128), (32, 64)):
            if tile_fits(fermi, q, t):
                assert dense[0] * dense[1] >= t[0] * t[1] or t == (32, 256), (quant.type_name(q), dense, t)
                break
        assert moe[0] <= 32 / 0.6 + 1e-9 and tile_usage(cls, q, moe)[1] == 0
    # the 64 x 128 lean tile (gemm_body_lean_wide) is spill-free for every type, so long runs take it, as the
    # preference has it; with too few tiles of it for the SMs, the 64 x 64 tile
    for q in GEMM_TYPES:
        assert tile_usage(cls, q, (64, 128))[1] == 0, quant.type_name(q)
        assert choose_tile(fermi, 947, 8192, 2048, q) == (64, 128), quant.type_name(q)
    assert choose_tile(fermi, 64, 1024, 2048, quant.F16) == (64, 64)


def test_choose_tile_rejects_bad_input():
    lim = cards.profile_limits("fermi", 14)
    with pytest.raises(KernelArgumentError, match="Q4_1"):
        choose_tile(lim, 10, 64, 64, quant.Q4_1)
    with pytest.raises(KernelArgumentError, match="N=0"):
        choose_tile(lim, 10, 0, 64, quant.Q4_K)


def test_kernel_class_options():
    assert kclass.kernel_class(cards.limits_for((2, 0))) == kclass.R63
    assert kclass.kernel_class(cards.limits_for((3, 0))) == kclass.R63
    assert kclass.kernel_class(cards.limits_for((3, 5))) == kclass.R255
    assert kclass.nvcc_options(kclass.R63) == ["-DHI_REG63", "-maxrregcount=63"]
    assert kclass.nvcc_options(kclass.R255) == []
    with pytest.raises(ValueError, match="r128"):
        kclass.nvcc_options("r128")
    # the delta rule's rows a thread times its block bound covers d_k = 256 in each class
    for cls in kclass.CLASSES:
        assert kclass.GDN_MAXR[cls] * kclass.GDN_MAX_THREADS[cls] >= 256 * 8


def test_delta_rule_block_fits_the_class_bound():
    from hybridinfer.backends.gpu.k_gdn import delta_rule_shape

    for cls in kclass.CLASSES:
        for d_k, d_v in ((16, 16), (128, 128), (12, 10), (256, 64), (32, 48)):
            vb, ng = delta_rule_shape(d_k, d_v, cls)
            assert vb * ng <= kclass.GDN_MAX_THREADS[cls] and ng * kclass.GDN_MAXR[cls] >= d_k, (cls, d_k)
            assert vb >= min(d_v, 8)
    with pytest.raises(KernelArgumentError, match="d_k=4096"):
        delta_rule_shape(4096, 128, kclass.R255)


def test_delta_rule_shared_memory_keeps_two_blocks_on_gk104():
    """The delta rule's outputs reuse its v rows instead of a shared buffer of their own: at Qwen3.5's heads
    (d_k = d_v = 128) a GTX 680 (sm_30, 63-register class, 48 KiB a multiprocessor) holds two 512-thread blocks,
    which 2 KiB more a block (GDN_TC x VB floats) would cut to one; every head size up to 256 fits a block."""
    from hybridinfer.backends.gpu.k_gdn import TC, delta_rule_shape, delta_rule_smem

    gk104 = cards.card("gtx680").limits
    cls = kclass.kernel_class(gk104)
    regs = USAGE[cls]["gdn_delta_rule"][0]
    vb, ng = delta_rule_shape(128, 128, cls)
    smem = delta_rule_smem(vb, ng, cls)
    assert (vb, ng, smem) == (32, 16, 22912)
    assert kclass.resident_blocks(gk104, regs, smem, vb * ng) == 2
    assert kclass.resident_blocks(gk104, regs, smem + TC * vb * 4, vb * ng) == 1
    for c in kclass.CLASSES:
        for d_k, d_v in ((128, 128), (256, 128), (256, 16), (16, 256)):
            vb, ng = delta_rule_shape(d_k, d_v, c)
            assert delta_rule_smem(vb, ng, c) <= loader.MAX_SHARED, (c, d_k, d_v)


def test_resident_blocks():
    fermi = cards.card("c2075").limits
    # 63 registers x 256 threads: 2 blocks in Fermi's 32K registers; 18 KB of shared memory: 2 in 48 KB
    assert kclass.resident_blocks(fermi, 63, 18 * 1024, 256) == 2
    assert kclass.resident_blocks(fermi, 63, 30 * 1024, 256) == 1
    k40 = cards.card("k40").limits
    assert kclass.resident_blocks(k40, 255, 0, 256) == 1
    assert kclass.resident_blocks(k40, 32, 0, 256) == 8  # 2048 threads a multiprocessor


def test_table_has_every_class_and_kernel_family():
    for cls in kclass.CLASSES:
        names = set(USAGE[cls])
        assert {"gdn_delta_rule", "attn_prefill", "moe_route", "rms_norm_f32"} <= names
        assert all(v[0] <= (63 if cls == kclass.R63 else 255) for v in USAGE[cls].values())


def test_cache_key_changes_with_every_input():
    base = ("src", "hdr", ["-O3"], "sm_90", "nvcc 13")
    k = loader.cache_key(*base)
    assert k.endswith(".cubin") and k == loader.cache_key(*base)
    for i, other in enumerate(("src2", "hdr2", ["-O3", "-DHI_REG63"], "sm_60", "nvcc 12")):
        args = list(base)
        args[i] = other
        assert loader.cache_key(*args) != k, i


def test_compile_line_says_what_was_compiled_and_how_long():
    c = loader.Compiled
    assert loader.describe_compiles([c("gemm", "r63", "sm_90", 1.0, True)]) is None
    line = loader.describe_compiles([c("gemm", "r63", "sm_90", 40.0, False), c("gdn", "r63", "sm_90", 2.5, False),
                                     c("moe", "r63", "sm_90", 0.01, True)])
    assert "compiled 2 GPU kernel source(s) for sm_90 (r63" in line and "42.5 s" in line
    assert loader.cache_dir() in line


def test_attention_splits_over_the_context_only_where_cards_idle():
    """k_attention.split_count: a call of few query rows over a long context goes in segments enough to give every
    multiprocessor about two blocks, each segment at least SPLIT_MIN_KEYS keys, the partials within SPLIT_ROWS; a call
    with blocks enough, a short context or an unknown card does not split."""
    from hybridinfer.backends.gpu.k_attention import BQ, SPLIT_MIN_KEYS, SPLIT_ROWS, split_count

    assert split_count(1, 16, 32768, 14) == 2  # one query tile, 16 heads: 16 blocks on a C2075's 14 SMs
    assert split_count(1, 16, 32768, 132) == 17  # an H200: 264 blocks wanted
    assert split_count(1, 16, 4000, 132) == 4000 // SPLIT_MIN_KEYS  # segments of at least SPLIT_MIN_KEYS keys
    assert split_count(200, 16, 32768, 14) == 1  # 208 blocks: every SM busy already
    assert split_count(1, 16, 2 * SPLIT_MIN_KEYS - 1, 132) == 1  # a short context
    assert split_count(1, 16, 32768, 0) == 1  # the card unknown
    for T, H, sms in ((1, 2, 132), (16, 64, 132), (5, 8, 80), (3, 1, 1000)):
        n = split_count(T, H, 1 << 20, sms)
        assert n * T * H <= SPLIT_ROWS and (n == 1 or -(-T // BQ) * H < 2 * sms)


def test_gemm_splits_over_k_only_where_cards_idle():
    """k_gemm.split_count: a product of too few tiles for two blocks a multiprocessor splits its k chunks into
    parts enough for that (at most MAX_SPLIT, each of MIN_PART_CHUNKS chunks at least, no more slabs than the
    scratch holds), on the tiles whose body splits; everything else runs whole."""
    from hybridinfer.backends.gpu.k_gemm import MAX_SPLIT, MIN_PART_CHUNKS, SPLIT_TILES, split_count

    fermi = cards.profile_limits("fermi", 14)
    on_h200 = cards.profile_limits("fermi", 132)
    # a 448 x 448 image's ffn_down: 784 patches x 1152 x 4320, 13 x 18 tiles of 64 x 64
    assert split_count(fermi, 784, 1152, 4320, (64, 64)) == 1  # 234 blocks on 14 SMs
    assert split_count(on_h200, 784, 1152, 4320, (64, 64)) == 2  # 234 < 264
    assert split_count(on_h200, 784, 1152, 4320, (64, 64), room=784 * 1152) == 1  # the scratch holds one slab
    assert split_count(on_h200, 784, 1152, 4320, (64, 128)) == 1  # the 128-wide lean body does not split
    assert split_count(on_h200, 64, 64, 4320, (64, 64)) == MAX_SPLIT
    assert split_count(on_h200, 64, 64, 32 * (2 * MIN_PART_CHUNKS + 1), (64, 64)) == 2
    assert split_count(on_h200, 64, 64, 32 * (2 * MIN_PART_CHUNKS - 1), (64, 64)) == 1
    assert split_count(replace(on_h200, sm_count=0), 64, 64, 4320, (64, 64)) == 1  # the card unknown
    assert split_count(on_h200, 0, 64, 4320, (64, 64)) == 1
    assert set(SPLIT_TILES) == set(kclass.CLASSES)
    for cls, tiles in SPLIT_TILES.items():
        assert set(tiles) <= set(TILES_BY_CLASS[cls]), cls
    h200 = cards.limits_for((9, 0), 132)
    for t in TILES_BY_CLASS[kclass.kernel_class(h200)]:
        assert split_count(h200, 8, 256, 8192, t) > 1, t  # every r255 tile splits

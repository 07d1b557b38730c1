"""gpu/cards.py: the limits of each compute capability, the named cards and the --card-profile limits (no GPU)."""

from __future__ import annotations

import pytest

from hybridinfer.backends.gpu import cards


def test_register_limits_by_class():
    # 63 registers a thread on Fermi and GK10x, 255 from sm_35 (CUDA's technical specifications table)
    assert cards.limits_for((2, 0)).regs_per_thread == 63
    assert cards.limits_for((2, 1)).regs_per_thread == 63
    assert cards.limits_for((3, 0)).regs_per_thread == 63
    for cc in ((3, 5), (3, 7), (5, 0), (5, 2), (6, 0)):
        assert cards.limits_for(cc).regs_per_thread == 255, cc
    assert cards.limits_for((2, 0)).regs_per_sm == 32 * 1024 and cards.limits_for((3, 7)).regs_per_sm == 128 * 1024


def test_every_class_allows_48k_of_shared_memory_a_block_and_at_least_that_a_sm():
    for cc in ((2, 0), (2, 1), (3, 0), (3, 5), (3, 7), (5, 0), (5, 2), (6, 0)):
        lim = cards.limits_for(cc)
        assert lim.smem_per_block == 48 * 1024 and lim.smem_per_sm >= lim.smem_per_block, cc
        assert lim.threads_per_sm >= 1536 and lim.blocks_per_sm >= 8


def test_modern_cards_get_sm60_limits_and_their_own_sm_count():
    lim = cards.limits_for((9, 0), sm_count=132)
    assert lim.cc == (9, 0) and lim.sm_count == 132 and lim.card_class == "modern"
    assert (lim.regs_per_thread, lim.smem_per_block) == (255, 48 * 1024)


def test_classes():
    assert [cards.class_of(cc) for cc in ((2, 0), (3, 0), (3, 7), (5, 2), (6, 0), (7, 5))] == [
        "fermi", "kepler", "kepler", "maxwell", "pascal", "modern"]
    with pytest.raises(ValueError, match="older than sm_20"):
        cards.class_of((1, 3))
    with pytest.raises(ValueError, match="1.3"):
        cards.limits_for((1, 3))


def test_named_cards_and_profiles():
    c = cards.card("Tesla C2075")
    assert c.name == "c2075" and c.card_class == "fermi" and c.limits.sm_count == 14
    assert c.vram == 6 << 30 and c.bus_bw == cards.PCIE2_X16
    assert cards.card("fermi") is c  # a profile names its card
    assert {cards.card(p).card_class for p in cards.PROFILES} == set(cards.PROFILES)
    for card in cards.CARDS.values():
        # fp32 peak / memory bandwidth within what these generations have (1..40 FLOP a byte)
        assert 1 < card.fp32_flops / card.mem_bw < 40, card.name
        assert card.limits.sm_count > 0
    with pytest.raises(ValueError, match="unknown card 'gtx9000'"):
        cards.card("gtx9000")


def test_profile_limits_keep_the_class_and_take_the_real_sm_count():
    lim = cards.profile_limits("fermi", 132)
    assert lim.regs_per_thread == 63 and lim.cc == (2, 0) and lim.sm_count == 132
    assert cards.profile_limits("kepler", 8).regs_per_thread == 255
    with pytest.raises(ValueError, match="unknown card profile 'volta'"):
        cards.profile_limits("volta", 80)


def test_paced_bus_is_the_given_rate_else_the_profiles_bus():
    assert cards.paced_bus(None) is None
    assert cards.paced_bus("fermi") == cards.PCIE2_X16
    assert cards.paced_bus("pascal") == cards.PCIE3_X16
    assert cards.paced_bus("fermi", 3e9) == 3e9 and cards.paced_bus(None, 3e9) == 3e9

"""A RAM budget split between GPU prefill and CPU decode (backends/ram_split.py) and the GPU's disk staging plan
(gpu/disk_stage.py): pure functions, no card."""

from __future__ import annotations

import pytest

from hybridinfer.backends.gpu.disk_stage import PIECE, host_need, runs, stage_layer, stage_plan
from hybridinfer.backends.gpu.placement import Placement, WeightInfo
from hybridinfer.backends.ram_split import CardsSplit, GpuHost, cpu_share, least_of, refuse, split_cards, split_ram
from hybridinfer.errors import RamBudgetError

MB = 1 << 20


def test_runs_are_the_experts_between_the_pinned_ones():
    assert runs(8, set()) == [(0, 8)]
    assert runs(8, {0, 3, 4, 7}) == [(1, 3), (5, 7)]
    assert runs(4, {0, 1, 2, 3}) == []
    assert runs(0, set()) == [(0, 1)]  # a tensor that is not stacked: one whole copy


def test_stage_layer_packs_each_run_once_and_cuts_reads_into_pieces():
    slab = 3000
    st = stage_layer(5, [("a", 10_000, slab, 6, {1, 2}), ("b", 50_000, slab, 6, set())], piece=4096)
    # a: experts 0 and 3..5 (two runs), b: all six (one run), packed in that order
    assert st.copies["a"] == ((0, 0, slab), (3 * slab, slab, 3 * slab))
    assert st.copies["b"] == ((0, 4 * slab, 6 * slab),)
    assert st.nbytes == 10 * slab
    covered = []
    for h, f, n in st.reads:
        assert 0 < n <= 4096
        covered.append((h, f, n))
    # the reads tile the buffer exactly, each byte from the file offset of its expert
    assert sorted(h for h, _, _ in covered) == [h for h, _, _ in covered]
    assert sum(n for _, _, n in covered) == st.nbytes
    for name, base in (("a", 10_000), ("b", 50_000)):
        for t_off, h0, n in st.copies[name]:
            for h, f, k in covered:
                if h0 <= h < h0 + n:
                    assert f == base + t_off + (h - h0) and h + k <= h0 + n


def _placement():
    infos = {
        "blk.0.attn_q.weight": WeightInfo("blk.0.attn_q.weight", 5 * MB, 0),
        "blk.0.ffn_up_exps.weight": WeightInfo("blk.0.ffn_up_exps.weight", 8 * MB, 0, 8),
        "blk.1.attn_q.weight": WeightInfo("blk.1.attn_q.weight", 5 * MB, 1),
        "blk.1.ffn_up_exps.weight": WeightInfo("blk.1.ffn_up_exps.weight", 8 * MB, 1, 8),
        "blk.2.ffn_up_exps.weight": WeightInfo("blk.2.ffn_up_exps.weight", 8 * MB, 2, 8),
        "output.weight": WeightInfo("output.weight", 3 * MB, 3),
    }
    p = Placement(1 << 30, resident={"blk.0.attn_q.weight", "blk.2.ffn_up_exps.weight"},
                  pinned_experts={"blk.1.ffn_up_exps.weight": {0, 1, 2}},
                  streamed={0: ["blk.0.attn_q.weight", "blk.0.ffn_up_exps.weight"],
                            1: ["blk.1.attn_q.weight", "blk.1.ffn_up_exps.weight"], 3: ["output.weight"]})
    return p, infos


def test_stage_plan_and_host_need_of_a_placement():
    p, infos = _placement()
    offsets = {n: 1000 * i for i, n in enumerate(infos)}
    plan = stage_plan(p, infos, offsets)
    assert sorted(plan) == [0, 1]  # layer 2's experts are on the card whole, layer 3 has none
    assert plan[0].nbytes == 8 * MB and plan[1].nbytes == 5 * MB  # layer 1: 3 of 8 experts pinned on the card
    assert plan[1].copies["blk.1.ffn_up_exps.weight"] == ((3 * MB, 0, 5 * MB),)
    assert plan[1].reads[0][1] == offsets["blk.1.ffn_up_exps.weight"] + 3 * MB
    assert all(n <= PIECE for _, _, n in plan[0].reads)
    need = host_need(p, infos, plan, bounce=7)
    # page-locked copies of blk.1.attn_q and the head only (blk.0.attn_q is on the card)
    assert need.dense == 8 * MB and need.layers == {0: 8 * MB, 1: 5 * MB} and need.bounce == 7
    # two layers' copies (13 MiB) take less than two staging buffers of the larger (16 MiB): the least holds them
    assert need.staging == 16 * MB and need.least == need.full == 21 * MB
    assert stage_plan(p, infos, offsets, layers={1}).keys() == {1}
    # nothing read: page-locked copies of the expert tensors too, of their streamed experts only (layer 1's 3 pinned
    # experts are on the card: the streamer's copy holds the other 5)
    assert host_need(p, infos, {}, bounce=7) == GpuHost(8 * MB + 8 * MB + 5 * MB, {}, 0)


def test_split_gives_the_cpu_its_share_first_and_keeps_what_is_left_layer_by_layer():
    g = GpuHost(dense=10, layers={0: 40, 1: 40, 2: 30, 3: 30}, bounce=5)
    assert g.staging == 80 and g.least == 95 and g.full == 150
    assert cpu_share(1000, g) == 905
    assert cpu_share(50, g) == 1  # too small: the CPU plan refuses with its own least
    # the CPU reads experts (it used all of its share but a few bytes): the GPU keeps nothing
    s = split_ram(1000, g, 900)
    assert s.held == () and s.disk == (0, 1, 2, 3) and s.gpu_bytes == 95 and s.total == 995 <= 1000
    assert s.read_per_pass == 140
    # the CPU holds everything in 700: 300 left, of which every layer's cold experts (140) beside the dense copies
    s = split_ram(1000, g, 700)
    assert s.held == (0, 1, 2, 3) and s.disk == () and s.gpu_bytes == 150 and s.read_per_pass == 0
    # 130 left beside the CPU's 860: not all; the staging (80) and readers (5) stay, the first layer's 40 fits
    s = split_ram(1000, g, 860)
    assert s.held == (0,) and s.disk == (1, 2, 3) and s.total == 995
    assert s.gpu_bytes == 10 + 40 + 2 * 40 + 5
    assert "read from the file each prompt pass" in s.summary() and "1 layers kept" in s.summary()
    with pytest.raises(RamBudgetError) as e:  # the CPU kept more than its share: the split says by how much
        split_ram(1000, g, 950)
    assert e.value.needed == 950 + 95


def test_a_budget_too_small_for_both_is_refused_with_the_total_needed():
    g = GpuHost(dense=10, layers={0: 40, 1: 40, 2: 40}, bounce=0)
    err = refuse(RamBudgetError("cpu: too small", needed=500), 300, g)
    assert isinstance(err, RamBudgetError) and err.needed == 500 + 90
    assert "at least 590 B" in str(err) and "GPU prefill takes 90 B" in str(err)
    # at exactly that budget the CPU's share is its least, and the split fits, every layer read
    assert cpu_share(590, g) == 500
    s = split_ram(590, g, 500)
    assert s.total == 590 and s.held == () and s.disk == (0, 1, 2)


def test_two_layers_are_held_rather_than_staged():
    """Two staging buffers of the largest layer take at least what two layers' copies take, and O_DIRECT's readers'
    buffers can outweigh a small model's experts: the least is then holding them, and a split that leaves the least
    holds them and reads nothing (the refusal's figure is a budget that loads, not the reading path's larger one)."""
    for g in (GpuHost(dense=10, layers={0: 40, 1: 30}, bounce=0), GpuHost(dense=10, layers={0: 5, 1: 5}, bounce=64)):
        assert g.least == g.full < g.dense + g.staging + g.bounce
        s = split_ram(600, g, 600 - g.least)
        assert s.held == (0, 1) and s.disk == () and s.total == 600 - g.least + g.full <= 600


# two cards of a layer split (each its own layers) and of an expert split (each its share of every layer)
LAYER_CARDS = (GpuHost(dense=10, layers={0: 40, 1: 40, 2: 40}, bounce=5),
               GpuHost(dense=20, layers={3: 30, 4: 30, 5: 30}, bounce=5))
EXPERT_CARDS = (GpuHost(dense=10, layers={0: 30, 1: 30, 2: 30, 3: 30}, bounce=4),) * 2


def test_several_cards_each_count_their_own_staging_and_readers():
    a, b = LAYER_CARDS
    assert least_of(LAYER_CARDS) == a.least + b.least == (10 + 80 + 5) + (20 + 60 + 5) == 180
    assert cpu_share(1000, LAYER_CARDS) == 1000 - 180 and cpu_share(100, LAYER_CARDS) == 1
    assert least_of([a]) == least_of(a) == a.least  # one card in a list is that card
    # everything fits beside the CPU's 700: every card holds all, reads nothing
    s = split_cards(1000, LAYER_CARDS, 700)
    assert isinstance(s, CardsSplit) and s.held == ((0, 1, 2), (3, 4, 5)) and s.disk == ((), ())
    assert s.read_per_pass == 0 and s.gpu_bytes == a.full + b.full and s.total == 700 + 240
    # the CPU took its whole share: every card reads every layer, each with its own two buffers and readers
    s = split_cards(1000, LAYER_CARDS, 820)
    assert s.held == ((), ()) and s.disk == ((0, 1, 2), (3, 4, 5)) and s.total == 1000
    assert [c.gpu_bytes for c in s.cards] == [a.least, b.least] and s.read_per_pass == 210
    # 40 left over the leasts: layer 0 (card 0's first) is kept, card 1's layer 3 (30) does not fit after it
    s = split_cards(1000, LAYER_CARDS, 780)
    assert s.held == ((0,), ()) and s.disk == ((1, 2), (3, 4, 5)) and s.total == 780 + a.least + 40 + b.least == 1000
    assert "gpu prefill on 2 cards" in s.summary() and "in 5 card layers read" in s.summary()
    with pytest.raises(RamBudgetError) as e:  # the CPU kept more than its share
        split_cards(1000, LAYER_CARDS, 900)
    assert e.value.needed == 900 + 180


def test_an_expert_split_keeps_layers_first_then_cards():
    s = split_cards(1000, EXPERT_CARDS, 1000 - least_of(EXPERT_CARDS) - 70)
    # 70 over the leasts: layer 0 on card 0 and on card 1 (30 each), then layer 1's 30 does not fit in the last 10
    assert s.held == ((0,), (0,)) and s.disk == ((1, 2, 3), (1, 2, 3)) and s.total == 1000 - 10


def test_a_split_over_several_cards_honours_every_budget_that_loads():
    """Every budget from the least up to all held, the CPU taking all of its share or less: within the budget, and
    each card's bytes are its dense copies, its held layers and (while it reads) its staging and readers."""
    for gpus in (LAYER_CARDS, EXPERT_CARDS, (GpuHost(dense=10, layers={0: 5, 1: 5}, bounce=64), LAYER_CARDS[1])):
        for budget in range(least_of(gpus) + 1, least_of(gpus) + 400, 7):
            for cpu in {cpu_share(budget, gpus), cpu_share(budget, gpus) // 2, 1}:
                s = split_cards(budget, gpus, cpu)
                assert s.total <= budget and s.cpu_bytes == cpu
                for g, c in zip(gpus, s.cards, strict=True):
                    assert sorted(c.held + c.disk) == sorted(g.layers)
                    read = 2 * max((g.layers[i] for i in c.disk), default=0) + g.bounce if c.disk else 0
                    assert c.gpu_bytes == g.dense + sum(g.layers[i] for i in c.held) + read
    # a card whose experts weigh less than its staging and readers holds them at the least (GpuHost.least)
    small = (GpuHost(dense=10, layers={0: 5, 1: 5}, bounce=64), LAYER_CARDS[1])
    s = split_cards(1000, small, cpu_share(1000, small))
    assert s.held == ((0, 1), ()) and s.total == 1000


def test_several_cards_refusal_names_the_least_and_each_cards_share():
    err = refuse(RamBudgetError("cpu: too small", needed=500), 300, LAYER_CARDS)
    assert isinstance(err, RamBudgetError) and err.needed == 500 + 180
    msg = str(err)
    assert "at least 680 B" in msg and "GPU prefill takes 180 B" in msg and "over 2 cards (95 B + 85 B" in msg
    assert cpu_share(680, LAYER_CARDS) == 500  # that budget leaves the CPU its least, and the split fits
    s = split_cards(680, LAYER_CARDS, 500)
    assert s.total == 680 and s.held == ((), ())
    # the one-card refusal's wording is unchanged
    assert "over" not in str(refuse(RamBudgetError("x", needed=5), 3, LAYER_CARDS[0]))

"""The split of a model's layers over several cards (gpu/multi_card.py) and `hybridinfer plan --cards`: pure, no GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridinfer.backends.gpu import calibration, cards, multi_card, timemodel
from hybridinfer.backends.gpu.multi_card import CardBudgetError, CardSlot, pipeline_total, split_cards
from hybridinfer.backends.gpu.placement import BudgetError, WeightInfo, plan_placement
from hybridinfer.cli import main
from hybridinfer.errors import ParameterError
from hybridinfer.models import model_args
from hybridinfer.tools.card_plan import plan_for_card
from hybridinfer.tools.multi_plan import card_list, plan_cards
from hybridinfer.tools.shape_model import ShapeModel

MB = 1 << 20
EFF = calibration.Efficiency(1.0, 1.0, "test")


def layers(n: int, nbytes: int = 100 * MB, head: int = 0) -> list[WeightInfo]:
    """n equal layers of two matrices each; a head of `head` bytes as layer n (none at 0)."""
    ws = [WeightInfo(f"blk.{i}.{t}.weight", nbytes // 2, i) for i in range(n) for t in ("a", "b")]
    return ws + ([WeightInfo("output.weight", head, n)] if head else [])


def card_slot(k: int, budget: int, bus: float = 12e9, flops: float = 4e12, reserved: int = 0) -> CardSlot:
    c = replace(cards.card("k40"), bus_bw=bus, fp32_flops=flops)
    return CardSlot(c, budget, reserved, EFF, f"card {k} (k40)")


def test_pipeline_total_worked_by_hand():
    assert pipeline_total([1.0, 2.0], 1) == 3
    # card 1 is the bottleneck: micro-batches leave it every 2 s after the first reaches it at 1 s
    assert pipeline_total([1.0, 2.0], 3) == 7
    assert pipeline_total([2.0, 1.0], 3) == 7  # card 0 feeds every 2 s, the last leaves card 1 at 6 + 1
    assert pipeline_total([5.0], 4) == 20
    with pytest.raises(ParameterError, match="at least 1, got 0"):
        pipeline_total([1.0], 0)


@pytest.mark.parametrize("n_cards", [2, 3, 4])
def test_equal_cards_split_evenly_by_bytes(n_cards):
    ws = layers(12)
    flops = [1e9] * 12
    plan = split_cards(ws, flops, [card_slot(k, 64 * MB * 4) for k in range(n_cards)], 512, 4096)
    assert [e - f for f, e in plan.ranges] == [12 // n_cards] * n_cards
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == 12
    assert all(a[1] == b[0] for a, b in zip(plan.ranges, plan.ranges[1:], strict=False))  # contiguous, in order
    assert len({s.stream_bytes for s in plan.shares}) == 1  # each bus the same share
    for s in plan.shares:
        assert s.placement.total_bytes <= s.slot.vram_budget


def test_a_card_with_half_the_bus_gets_about_half_the_bytes():
    ws = layers(30)
    flops = [1e6] * 30  # transfer-bound: the bus decides
    fast, slow = card_slot(0, 256 * MB, bus=12e9), card_slot(1, 256 * MB, bus=6e9)
    plan = split_cards(ws, flops, [fast, slow], 947, 4096)
    b0, b1 = (s.stream_bytes for s in plan.shares)
    assert 0.4 <= b1 / b0 <= 0.6
    assert plan.ranges == [(0, 20), (20, 30)]
    # the other order: the slow card first still carries about half of the fast one's bytes
    b0, b1 = (s.stream_bytes for s in split_cards(ws, flops, [slow, fast], 947, 4096).shares)
    assert 0.4 <= b0 / b1 <= 0.6


def test_a_card_with_half_the_compute_gets_about_half_the_layers_when_compute_bound():
    ws = layers(24, nbytes=MB)
    flops = [1e12] * 24
    plan = split_cards(ws, flops, [card_slot(0, 1 << 30, flops=8e12), card_slot(1, 1 << 30, flops=4e12)], 4096, 4096)
    n0, n1 = (e - f for f, e in plan.ranges)
    assert (n0, n1) == (16, 8)
    assert plan.micro_batches > 1  # compute-bound: cards overlap only with the prompt cut in micro-batches


def test_a_budget_too_small_is_an_error_naming_the_card():
    ws = layers(8)
    ok = card_slot(0, 1 << 30)
    tiny = replace(card_slot(1, 150 * MB), label="card 1 (k40)")  # a layer's double staging is 200 MB
    with pytest.raises(CardBudgetError, match=r"card 1 \(k40\).*150000000|card 1 \(k40\)") as e:
        split_cards(ws, [1e9] * 8, [ok, tiny], 128, 4096)
    assert e.value.card == "card 1 (k40)" and isinstance(e.value, BudgetError)
    assert str(150 * MB) in str(e.value)
    # the reserve counts: a card whose buffers alone take its budget
    with pytest.raises(CardBudgetError, match=r"card 0 \(k40\)"):
        split_cards(ws, [1e9] * 8, [card_slot(0, 1 << 30, reserved=1 << 30), ok], 128, 4096)


def test_bad_splits_are_named():
    ws = layers(3)
    with pytest.raises(ParameterError, match="4 cards for 3 layers"):
        split_cards(ws, [1.0] * 3, [card_slot(k, 1 << 30) for k in range(4)], 16, 64)
    with pytest.raises(ParameterError, match="no cards"):
        split_cards(ws, [1.0] * 3, [], 16, 64)
    with pytest.raises(ParameterError, match="positive count, got 0"):
        split_cards(ws, [1.0] * 3, [card_slot(0, 1 << 30)], 0, 64)
    with pytest.raises(ParameterError, match=r"card 0 \(k40\): vram budget must be more than 0"):
        split_cards(ws, [1.0] * 3, [card_slot(0, 0)], 16, 64)


def test_one_card_is_the_single_card_plan_exactly():
    ws = layers(6, head=30 * MB)
    flops = [3e10] * 6 + [1e9]
    s = card_slot(0, 400 * MB, reserved=20 * MB)
    plan = split_cards(ws, flops, [s], 947, 4096)
    p = plan_placement(ws, s.vram_budget, s.reserved)
    assert plan.micro_batches == 1 and plan.ranges == [(0, 7)]
    assert plan.shares[0].placement == p
    byname = {w.name: w for w in ws}
    comp, tr = timemodel.layer_times(flops, [p.layer_stream_bytes(byname, i) for i in range(7)], s.card.fp32_flops,
                                     s.card.bus_bw, 1.0, 1.0)
    assert plan.seconds == timemodel.pipeline_seconds(comp, tr)


@pytest.fixture(scope="module")
def m35():
    gm = ShapeModel("qwen35moe", "35b-a3b", "q4_k_m")
    return gm, model_args(gm)


def test_plan_cards_one_card_equals_plan_for_card(m35):
    gm, a = m35
    one = plan_for_card(gm, a, "c2075", prompts=(128, 947))
    pl = plan_cards(gm, a, ["c2075"], prompts=(128, 947))
    for sp, r in zip(pl.splits, one.prefill, strict=True):
        assert sp.seconds == r.seconds and sp.micro_batches == 1
        assert sp.shares[0].placement == one.placement


def test_two_fermi_cards_beat_one_and_each_fits_its_budget(m35):
    gm, a = m35
    pl = plan_cards(gm, a, ["c2075", "c2075"], vram_budget=4 << 30, prompts=(947, 4096))
    for sp, one in zip(pl.splits, pl.one.prefill, strict=True):
        assert sp.seconds < one.seconds
        assert sum(s.end - s.first for s in sp.shares) == a.n_layer + 1
        for s in sp.shares:
            assert s.placement.total_bytes <= s.slot.vram_budget == 4 << 30
        # about half the bytes each (the head's layer makes the difference)
        b0, b1 = (s.stream_bytes for s in sp.shares)
        assert 0.75 <= b0 / b1 <= 1.33
    with pytest.raises(ParameterError, match="2 VRAM budgets for 3 cards"):
        plan_cards(gm, a, ["c2075"] * 3, vram_budget=[4 << 30, 4 << 30], prompts=(64,))
    with pytest.raises(ParameterError, match=r"card 1 \(c2075\)"):
        plan_cards(gm, a, ["k40", "c2075"], vram_budget=8 << 30, prompts=(64,))


def test_card_list():
    assert card_list("3", "c2075") == ["c2075"] * 3
    assert card_list("c2075, k80", None) == ["c2075", "k80"]
    with pytest.raises(ParameterError, match="give --card"):
        card_list("2", None)
    with pytest.raises(ParameterError, match="unknown card 'gtx9000'"):
        card_list("c2075,gtx9000", None)
    with pytest.raises(ParameterError, match="at least 1, got 0"):
        card_list("0", "c2075")


def test_plan_command_with_cards(capsys):
    assert main(["plan", "--shape", "35b-a3b", "--card", "c2075", "--cards", "2", "--prompts", "947"]) == 0
    out = capsys.readouterr().out
    assert "| card 0 (c2075) | 0.." in out and "| card 1 (c2075) |" in out and "(head)" in out
    assert "c2075 alone" in out and "prompt of 947 tokens" in out
    # the expert split beside it: each card's experts; a real C2075 is compute-bound, so the choice is the pipeline
    assert "split mode expert: " in out and "| card 0 (c2075) | 0.." in out and "..255 | 5." in out
    assert "split mode (auto): layer" in out
    assert main(["plan", "--shape", "35b-a3b", "--cards", "c2075,k80", "--prompts", "128"]) == 0
    assert "card 1 (k80)" in capsys.readouterr().out
    assert main(["plan", "--shape", "35b-a3b", "--cards", "c2075,k80", "--vram-budget", "5GiB,11GiB", "--prompts",
                 "128"]) == 0
    out = capsys.readouterr().out
    assert "| card 0 (c2075) |" in out and "| 5.00 |" in out and "| 11.00 |" in out
    assert main(["plan", "--shape", "35b-a3b", "--card", "c2075", "--vram-budget", "1GiB,2GiB", "--host-bw", "10",
                 "--prompts", "128"]) == 2
    assert "one size for --card" in capsys.readouterr().err
    assert main(["plan", "--shape", "35b-a3b", "--cards", "c2075,k80", "--vram-budget", "5GiB,13GiB", "--prompts",
                 "128"]) == 2
    assert "card 1 (k80) exceeds its 12.00 GiB" in capsys.readouterr().err
    assert main(["plan", "--shape", "35b-a3b", "--cards", "2", "--prompts", "128"]) == 2
    assert "give --card" in capsys.readouterr().err
    assert main(["plan", "--shape", "35b-a3b", "--prompts", "128"]) == 2
    assert "plan takes --card" in capsys.readouterr().err


def test_slot_uses_the_card_table_and_its_calibration():
    s = multi_card.slot("fermi", 1 << 30, 5, 2)
    assert s.card.name == "c2075" and s.label == "card 2 (c2075)" and s.reserved == 5
    assert s.eff == calibration.efficiency_for(s.card.limits)
    assert s.bus == pytest.approx(s.card.bus_bw * s.eff.bus)


def test_a_cards_buffers_keep_only_its_layers_state(m35):
    from hybridinfer.backends.gpu.backend import Buffers

    _, a = m35
    whole = Buffers.layout(a, 64, 512)
    mine = Buffers.layout(a, 64, 512, layers=range(10, 20))
    states = {k[1][1] for k in whole if isinstance(k, tuple) and k[0] == "state"}
    assert states == set(range(a.n_layer))
    assert {k[1][1] for k in mine if isinstance(k, tuple) and k[0] == "state"} == set(range(10, 20))
    assert {k: v for k, v in mine.items() if not (isinstance(k, tuple) and k[0] == "state")} == \
        {k: v for k, v in whole.items() if not (isinstance(k, tuple) and k[0] == "state")}
    streamed = Buffers.layout(a, 64, 512, True, 128, layers=range(10, 20))
    assert ("slot", "k") in streamed and not any(isinstance(k, tuple) and k[0] == "state" and a.layer_types[k[1][1]]
                                                 == "attention" for k in streamed)


def test_the_multi_gpu_micro_batch_rows_follow_its_plan(m35):
    from hybridinfer.backends.gpu.multi_gpu import MultiGPUModel

    gm, a = m35
    pl = plan_cards(gm, a, ["c2075", "c2075"], vram_budget=4 << 30, prompts=(4096,)).splits[0]
    m = object.__new__(MultiGPUModel)
    m.plan, m.micro_batch, m.n_rows = pl, None, 100_000
    want = multi_card.micro_batch_count(pl.shares, 4096, 4096)
    assert want > 1 and m.rows_for(4096) == -(-4096 // want)
    m.n_rows = -(-4096 // want) - 1
    assert m.rows_for(4096) == m.n_rows  # never more than a card's pass holds
    m.micro_batch = 64
    assert m.rows_for(4096) == 64

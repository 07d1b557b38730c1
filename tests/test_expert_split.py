"""The expert split of a MoE prefill over several cards (gpu/expert_card.py): which experts each card owns, its
placement, the lockstep time model and the choice against the layer pipeline; and a card's share of the experts
reaching the card through the Streamer (on test_gpu_disk_stage's numpy stand-in for pycuda). Pure, no GPU."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from test_gpu_disk_stage import card  # noqa: F401  (the stand-in card fixture)
from test_multi_card import EFF

from hybridinfer.backends.gpu import cards, expert_card, multi_card, timemodel
from hybridinfer.backends.gpu.expert_card import (
    check_split_mode,
    expert_counts_of,
    expert_ranges,
    lockstep_seconds,
    own_weights,
    plan_split,
    predict_experts,
)
from hybridinfer.backends.gpu.multi_card import CardBudgetError, CardSlot, split_cards
from hybridinfer.backends.gpu.placement import WeightInfo, plan_placement, staged
from hybridinfer.errors import ParameterError

MB = 1 << 20
E = 16
SLAB = MB  # one expert of one tensor
TYPES = ("gate", "up", "down")


def moe_layers(n: int, dense: int = 4 * MB, head: int = 8 * MB) -> list[WeightInfo]:
    """n MoE layers, each two dense matrices of `dense` bytes and three expert tensors of E experts; the head as
    layer n."""
    ws = []
    for i in range(n):
        ws += [WeightInfo(f"blk.{i}.attn_{t}.weight", dense // 2, i) for t in ("a", "b")]
        ws += [WeightInfo(f"blk.{i}.ffn_{t}_exps.weight", E * SLAB, i, E) for t in TYPES]
    return ws + [WeightInfo("output.weight", head, n)]


def slot(k: int, budget: int, bus: float = 6e9, flops: float = 1e15, reserved: int = 0) -> CardSlot:
    c = replace(cards.card("c2075"), bus_bw=bus, fp32_flops=flops)
    return CardSlot(c, budget, reserved, EFF, f"card {k} (c2075)")


def test_split_mode_names():
    assert check_split_mode(None) == "auto"
    assert [check_split_mode(m) for m in ("auto", "layer", "expert")] == ["auto", "layer", "expert"]
    with pytest.raises(ParameterError, match="'row' is not one of auto, layer, expert .*llama.cpp"):
        check_split_mode("row")
    with pytest.raises(ParameterError, match="'experts'"):
        check_split_mode("experts")


def test_counts_and_ranges():
    assert expert_counts_of(16, 2) == [8, 8] and expert_counts_of(10, 3) == [3, 3, 4]
    assert expert_counts_of(16, 2, first=5) == [5, 11] and expert_counts_of(16, 3, first=4) == [4, 6, 6]
    assert expert_ranges([5, 11]) == [(0, 5), (5, 16)]
    with pytest.raises(ParameterError, match="2 experts a layer cannot be split over 3 cards"):
        expert_counts_of(2, 3)
    with pytest.raises(ParameterError, match="card 0's 16 experts"):
        expert_counts_of(16, 2, first=16)


def test_own_weights_cut_each_expert_tensor_to_the_cards_ids():
    ws = moe_layers(2)
    mine = {w.name: w for w in own_weights(ws, (4, 10))}
    w = mine["blk.1.ffn_up_exps.weight"]
    assert (w.n_expert, w.first_expert, w.nbytes, w.slab) == (6, 4, 6 * SLAB, SLAB)
    assert mine["blk.0.attn_a.weight"] == ws[0] and "output.weight" in mine
    assert "output.weight" not in {w.name for w in own_weights(ws, (4, 10), head_layer=2)}  # a card without the head
    again = own_weights([w], (1, 3))[0]  # a share of a share: ids stay the file's
    assert (again.first_expert, again.n_expert) == (5, 2)
    with pytest.raises(ParameterError, match="'blk.0.ffn_gate_exps.weight' has 16 experts, the split gives a card "
                                             "ids 8..19"):
        own_weights(ws, (8, 20))


def test_a_card_pins_its_experts_by_the_files_ids():
    """The prompts' expert counts are by the file's expert ids; a card owning 8..15 pins file expert 12 (its 4th)."""
    mine = own_weights(moe_layers(1, head=0)[:-1], (8, 16))
    dense = sum(w.nbytes for w in mine if not w.n_expert)
    budget = dense + 2 * 3 * staged(mine[-1]) + 3 * SLAB  # the dense part, the staging and three experts
    p = plan_placement(mine, budget, 0, {(0, 12): 100, (0, 3): 500})  # expert 3 is another card's
    assert p.pinned_experts == {f"blk.0.ffn_{t}_exps.weight": {4} for t in TYPES}
    assert p.stream_bytes_per_pass == 3 * 7 * SLAB


def test_lockstep_of_one_card_is_the_one_card_schedule():
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(1, 9)
        comp = [rng.choice([0.0, rng.random()]) for _ in range(n)]
        tr = [rng.choice([0.0, rng.random()]) for _ in range(n)]
        assert lockstep_seconds([comp], [tr]) == pytest.approx(timemodel.pipeline_seconds(comp, tr), abs=1e-12)


def test_lockstep_worked_by_hand():
    # layer 0: card 0 computes 1 s, card 1 waits 2 s for its upload then computes 0.5 s: both leave at 2.5;
    # layer 1: card 0 computes 1 s more (3.5), card 1's 0.5 s ends at 3: the pass ends at 3.5
    assert lockstep_seconds([[1, 1], [0.5, 0.5]], [[0, 0], [2, 0]]) == 3.5
    # card 0 streams each layer in 1 s: layer 0 computes 1..2, layer 1 2..3 (its upload ran 1..2), layer 2's upload
    # reuses slot 0, free at 2, and runs 2..3: it computes 3..4; card 1, all resident, keeps step
    assert lockstep_seconds([[1, 1, 1], [1, 1, 1]], [[1, 1, 1], [0, 0, 0]]) == 4
    # card 1's slow layer 1 holds card 0 back: layer 2 starts on both at 1 + 3
    assert lockstep_seconds([[1, 1, 1], [1, 3, 1]], [[0, 0, 0], [0, 0, 0]]) == 5
    with pytest.raises(ParameterError, match="same layers"):
        lockstep_seconds([[1, 1], [1]], [[0, 0], [0]])


def _flops(ws, T: int, per_row: float = 1e6) -> tuple[list[float], dict[int, float]]:
    """Each layer: T rows of dense work and T rows of routed work (half of it), the head last."""
    n = max(w.layer for w in ws)
    return [2 * T * per_row] * n + [T * per_row], dict.fromkeys(range(n), T * per_row)


def test_equal_cards_stream_about_equal_bytes_and_the_head_card_owns_fewer():
    ws = moe_layers(8)
    budget = 120 * MB
    counts, pls = plan_split(ws, [slot(0, budget), slot(1, budget)], head_layer=8)
    assert sum(counts) == E and counts[0] <= counts[1]
    one = 3 * SLAB * 8  # one expert id over every layer
    s0, s1 = (p.stream_bytes_per_pass for p in pls)
    assert s0 > 0 and s1 > 0 and abs(s0 - s1) <= one
    for p in pls:
        assert p.total_bytes <= budget
    both = s0 + s1
    alone = plan_placement(ws, budget, 0).stream_bytes_per_pass
    assert both < alone  # the cards' summed VRAM keeps more on the cards (the dense part is on both)


def test_a_card_with_half_the_bus_streams_about_half():
    ws = moe_layers(8, head=0)[:-1]
    fast, slow = slot(0, 120 * MB, bus=12e9), slot(1, 120 * MB, bus=6e9)
    counts, pls = plan_split(ws, [fast, slow], head_layer=8)
    s0, s1 = (p.stream_bytes_per_pass for p in pls)
    assert counts[0] > counts[1]
    assert abs(s0 / fast.bus - s1 / slow.bus) <= 3 * SLAB * 8 / slow.bus  # within one expert id over the layers


def test_three_cards_split_evenly_and_a_card_too_small_is_named():
    ws = moe_layers(4)
    counts, pls = plan_split(ws, [slot(k, 200 * MB) for k in range(3)], head_layer=4)
    assert counts == [5, 5, 6] and len(pls) == 3
    with pytest.raises(CardBudgetError, match=r"card 1 \(c2075\): experts 8..15 of each layer: vram budget"):
        plan_split(ws, [slot(0, 200 * MB), slot(1, 8 * MB)], head_layer=4)
    with pytest.raises(ParameterError, match=r"routed experts \(this one has none\)"):
        plan_split([w for w in ws if not w.n_expert], [slot(0, 200 * MB)], head_layer=4)


def test_one_card_of_an_expert_split_is_the_one_card_model():
    ws = moe_layers(6)
    T = 256
    flops, routed = _flops(ws, T)
    s = slot(0, 200 * MB, flops=2e12)
    ep = predict_experts(ws, flops, routed, [s], [E], T, 4096)
    assert ep.shares[0].exchange_s == 0
    assert ep.seconds == pytest.approx(split_cards(ws, flops, [s], T, 4096, micro_batches=1).seconds, rel=1e-12)


def test_the_exchange_is_on_each_cards_bus_once_a_moe_layer():
    ws = moe_layers(6)
    T, row = 512, 4096
    flops, routed = _flops(ws, T)
    slots = [slot(0, 100 * MB), slot(1, 100 * MB)]
    ep = predict_experts(ws, flops, routed, slots, [8, 8], T, row)
    for sh in ep.shares:  # its partial down and the other's up, in 6 MoE layers
        assert sh.exchange_s == pytest.approx(6 * 2 * T * row / sh.slot.bus)
        assert sh.transfer_s == pytest.approx((sh.stream_bytes + 6 * T * row) / sh.slot.bus)
    # the routed work is shared, the dense work is not: each card computes half the routed rows, card 0 the head
    half = sum(routed.values()) / 2
    assert ep.shares[0].compute_s == pytest.approx((sum(flops) - half) / slots[0].flops)
    assert ep.shares[1].compute_s == pytest.approx((sum(flops[:6]) - half) / slots[1].flops)


def test_the_choice_is_expert_when_bus_bound_and_layer_when_compute_bound():
    ws = moe_layers(8)
    T = 512
    flops, routed = _flops(ws, T, per_row=2e6)
    for card_flops, want in ((1e15, "expert"), (2e10, "layer")):
        slots = [slot(k, 120 * MB, flops=card_flops) for k in range(2)]
        counts, pls = plan_split(ws, slots, head_layer=8)
        ep = predict_experts(ws, flops, routed, slots, counts, T, 4096, placements=pls)
        lay = split_cards(ws, flops, slots, T, 4096)
        assert expert_card.choose(lay.seconds, ep.seconds) == want, (card_flops, lay.seconds, ep.seconds)
    bus_bound = [slot(k, 120 * MB) for k in range(2)]
    one = split_cards(ws, flops, bus_bound[:1], T, 4096).seconds
    counts, pls = plan_split(ws, bus_bound, head_layer=8)
    ep = predict_experts(ws, flops, routed, bus_bound, counts, T, 4096, placements=pls)
    assert one / ep.seconds > 1.9  # both buses at once, and more of the model on the cards


def test_plan_experts_from_a_shape():
    from hybridinfer.backends.gpu.placement import weights_of
    from hybridinfer.models import model_args
    from hybridinfer.tools.card_plan import card_reserve
    from hybridinfer.tools.shape_model import ShapeModel

    gm = ShapeModel("qwen35moe", "35b-a3b", "q4_k_m")
    a = model_args(gm)
    ws = weights_of(gm, a, matrices_only=True)
    c = replace(cards.card("fermi"), fp32_flops=60e12)  # the fermi profile's bus on a fast card
    res = card_reserve(gm, a, ws, 5 << 30, 1024, 4096)
    slots = [expert_card.with_link(CardSlot(c, 5 << 30, res, EFF, f"card {k}"), a, 1024) for k in range(2)]
    plans = expert_card.plan_experts(gm, a, ws, slots, [947, 4096])
    assert [p.tokens for p in plans] == [947, 4096]
    assert plans[0].shares[0].experts[0] == 0 and plans[0].shares[1].experts[1] == a.n_expert
    assert plans[0].shares[0].placement is plans[1].shares[0].placement  # one split for every length
    lay = multi_card.split_cards(ws, _shape_flops(gm, a, 947), slots, 947, 4 * a.n_embd)
    assert expert_card.choose(lay.seconds, plans[0].seconds) == "expert"


def _shape_flops(gm, a, T):
    from hybridinfer.backends.gpu.work import prefill_work

    w = prefill_work(gm, a, T)
    return [w.by_layer.get(i, 0.0) for i in range(a.n_layer + 1)]


def test_a_cards_share_of_the_experts_reaches_it_through_the_streamer(card, tmp_path):  # noqa: F811
    """Resident, pinned and streamed expert tensors cut to experts 4..11: the card sees [8, N, K] tensors holding
    the file's bytes of those experts."""
    from test_gpu_disk_stage import SHAPE

    from hybridinfer.backends.gpu.placement import Placement, weights_of
    from hybridinfer.backends.gpu.streamer import Streamer, file_bytes
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args
    from hybridinfer.tools.synth import synth_model

    path = tmp_path / "moe.gguf"
    synth_model(path, "qwen35moe", SHAPE, "q8_0", seed=4)
    gm = GGUFModel(str(path))
    a = model_args(gm)
    infos = {w.name: w for w in own_weights(weights_of(gm, a, matrices_only=True), (4, 12))}
    exps = {n for n, w in infos.items() if w.n_expert}
    streamed = {i: sorted(n for n in exps if infos[n].layer == i) for i in (1, 2, 3)}
    p = Placement(1 << 40, resident=set(infos) - exps | {n for n in exps if infos[n].layer == 0},
                  pinned_experts={n: {0, 5} for n in streamed[1]}, streamed=streamed)
    st = Streamer(gm, p, infos, card.drv.Stream())
    assert len(st.pinned) == 3 and all(dw.shape[0] == 2 for dw, _ in st.pinned.values())
    st.prefetch(0)
    for i in range(a.n_layer):
        st.prefetch(i + 1)
        names = [n for n in infos if infos[n].layer == i]
        W = st.weights(i, names)
        for n in names:
            t, w = gm.tensor(n), infos[n]
            raw = np.asarray(t.raw()).view(np.uint8).reshape(-1)
            want = raw[4 * w.slab : 12 * w.slab] if w.n_expert else raw
            assert np.array_equal(np.asarray(W[n].data), want), f"layer {i}: {n} is not the file's experts 4..11"
            assert np.array_equal(file_bytes(gm, w), want)
            if w.n_expert:
                assert W[n].shape == (8, int(t.ne[1]), int(t.ne[0]))
        st.release(i)
    streamed_bytes = sum(infos[n].nbytes for i in (2, 3) for n in streamed[i]) + sum(
        infos[n].nbytes - 2 * infos[n].slab for n in streamed[1])
    assert st.bytes_h2d == streamed_bytes  # only its own experts, and not the pinned ones, cross the bus


def test_a_later_cards_copy_of_a_state_is_kept_while_the_state_is_as_left(tmp_path):
    """ExpertParallelModel.view: card k's own copy (its kernels write it, not the host's arrays), the same copy while
    the host state is where the last pass left it, a new one once it moved (CPU decode)."""
    from test_gpu_disk_stage import SHAPE

    from hybridinfer.backends.gpu.expert_gpu import ExpertParallelModel
    from hybridinfer.backends.state import DecoderState
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args
    from hybridinfer.tools.synth import synth_model

    path = tmp_path / "moe.gguf"
    synth_model(path, "qwen35moe", SHAPE, "q8_0", seed=4)
    st = DecoderState.new(model_args(GGUFModel(str(path))), 64)
    st.tokens[:3], st.pos = [1, 2, 3], 3
    name = next(n for n, arrs in st.arrays.items() if any(x is not None for x in arrs))
    i = next(j for j, x in enumerate(st.arrays[name]) if x is not None)
    st.arrays[name][i][...] = 1.5
    m = object.__new__(ExpertParallelModel)
    m._views = {}
    v = m.view(1, st)
    assert v is not st and v.pos == 3 and not np.shares_memory(v.arrays[name][i], st.arrays[name][i])
    assert np.array_equal(v.arrays[name][i][:3], st.arrays[name][i][:3])
    assert m.view(1, st) is v and m.view(2, st) is not v  # another card: its own copy
    st.tokens[3], st.pos = 7, 4  # a decoded token
    w = m.view(1, st)
    assert w is not v and w.pos == 4 and w.tokens[3] == 7


def test_plan_of_a_dense_model_has_no_expert_split(capsys):
    from hybridinfer.cli import main

    assert main(["plan", "--shape", "0.8b", "--arch", "qwen35", "--card", "c2075", "--cards", "2", "--prompts",
                 "128"]) == 0
    out = capsys.readouterr().out
    assert "split mode layer" in out and "split mode (auto): layer" in out and "split mode expert" not in out


def test_a_deferred_exchange_is_done_before_its_rows_are_read():
    from hybridinfer.backends.gpu.expert_gpu import due

    # a layer's last chunk (rows 64..96) stays pending while the next layer's mixer reads rows 0..64
    assert due(0, 32, [(64, 96)]) == 0 and due(32, 64, [(64, 96)]) == 0
    assert due(64, 96, [(64, 96)]) == 1 and due(80, 100, [(64, 96)]) == 1
    # the next chunk of the same branch does not wait for the one before it ...
    assert due(32, 64, [(0, 32)]) == 0
    # ... and the exchanges are done in order: one meeting the rows takes those deferred before it along
    assert due(40, 50, [(0, 32), (32, 64)]) == 2 and due(0, 8, [(0, 32), (32, 64)]) == 1
    assert due(0, 8, []) == 0

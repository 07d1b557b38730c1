"""plan_placement: pure budget arithmetic, no GPU."""

from __future__ import annotations

import pytest

from hybridinfer.backends.gpu.placement import BudgetError, WeightInfo, plan_placement, streamed_bytes, weights_of

MiB = 1 << 20


def _model(n_layer=4, n_expert=8, slab=4 * MiB, dense=6 * MiB, small=64 << 10):
    ws = [WeightInfo("token_embd.weight", 300 * MiB, -1), WeightInfo("output.weight", 40 * MiB, n_layer),
          WeightInfo("output_norm.weight", small, -1)]
    for i in range(n_layer):
        ws += [WeightInfo(f"blk.{i}.attn_norm.weight", small, i), WeightInfo(f"blk.{i}.attn_qkv.weight", dense, i),
               WeightInfo(f"blk.{i}.ffn_down_shexp.weight", dense // 2, i)]
        ws += [WeightInfo(f"blk.{i}.ffn_{k}_exps.weight", slab * n_expert, i, n_expert) for k in ("gate", "up", "down")]
    return ws


def _check(p, ws, budget, reserved):
    by = {w.name: w for w in ws}
    resident = sum(by[n].nbytes for n in p.resident)
    resident += sum(by[n].slab * len(es) for n, es in p.pinned_experts.items())
    assert resident == p.resident_bytes
    per_layer, staged = {}, {}
    for w in ws:
        if w.name != "token_embd.weight":
            per_layer[w.layer] = per_layer.get(w.layer, 0) + streamed_bytes(w, p)
            staged[w.layer] = staged.get(w.layer, 0) + (0 if w.name in p.resident else -(-w.nbytes // 256) * 256)
    assert p.staging_bytes == 2 * max(staged.values())
    assert p.stream_bytes_per_pass == sum(per_layer.values())
    assert p.reserved_bytes == reserved
    assert p.total_bytes <= budget
    assert "token_embd.weight" not in p.resident


@pytest.mark.parametrize("budget_mib", [230, 260, 300, 400, 10_000])
def test_budget_is_honoured_exactly(budget_mib):
    ws = _model()
    p = plan_placement(ws, budget_mib * MiB, reserved=10 * MiB)
    _check(p, ws, budget_mib * MiB, 10 * MiB)
    if budget_mib == 10_000:  # everything fits: nothing streams
        assert not p.streamed and p.stream_bytes_per_pass == 0 and p.staging_bytes == 0


def test_small_and_dense_before_experts_and_pinning_follows_counts():
    ws = _model()
    counts = {(2, 5): 900, (2, 1): 800, (0, 3): 700}
    p = plan_placement(ws, 320 * MiB, reserved=10 * MiB, expert_counts=counts)
    assert all(w.name in p.resident for w in ws if w.nbytes < MiB)  # all small tensors
    assert all(f"blk.{i}.attn_qkv.weight" in p.resident for i in range(4))
    pinned = {(int(n.split(".")[1]), e) for n, es in p.pinned_experts.items() for e in es}
    assert pinned, "some budget is left for experts"
    # the most used experts go first
    assert {(2, 5), (2, 1), (0, 3)} <= pinned


def test_more_budget_never_streams_more():
    ws = _model()
    prev = None
    for b in range(222, 500, 7):
        p = plan_placement(ws, b * MiB, reserved=5 * MiB)
        _check(p, ws, b * MiB, 5 * MiB)
        if prev is not None:
            assert p.stream_bytes_per_pass <= prev
        prev = p.stream_bytes_per_pass


def test_too_small_a_budget_is_a_clear_error():
    with pytest.raises(BudgetError, match="vram budget"):
        plan_placement(_model(), 150 * MiB, reserved=10 * MiB)


def test_weights_of_a_real_layout(oracle_gguf):
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args

    gm = GGUFModel(str(oracle_gguf("qwen35moe", "q8_0")))
    args = model_args(gm)
    ws = weights_of(gm, args)
    exps = [w for w in ws if w.n_expert]
    assert exps and all(w.n_expert == args.n_expert for w in exps)
    total = sum(w.nbytes for w in ws)
    assert total == sum(t.nbytes for t in gm.tensors.values())
    p = plan_placement(ws, int(total * 0.6), reserved=0)
    _check(p, ws, int(total * 0.6), 0)
    assert p.stream_bytes_per_pass > 0


@pytest.mark.parametrize("budget_mib", [340, 400, 480])
def test_experts_without_counts_are_pinned_evenly_over_the_layers(budget_mib):
    """A fresh model (no routing counts) pins expert 0 of every layer, then expert 1 ..., so each MoE layer streams
    about the same bytes: the two staging slots then overlap every layer's upload with the layer before's compute,
    rather than the first layers running with the bus idle and the last ones waiting on it."""
    ws = _model(n_layer=6)
    p = plan_placement(ws, budget_mib * MiB, reserved=10 * MiB)
    _check(p, ws, budget_mib * MiB, 10 * MiB)
    pins = {i: {e for n, es in p.pinned_experts.items() if f"blk.{i}." in n for e in es} for i in range(6)}
    assert any(pins.values()), "the budget leaves room for some experts"
    for i, es in pins.items():
        assert es == set(range(len(es))), f"layer {i} pins its lowest ids first: {sorted(es)}"
    assert max(map(len, pins.values())) - min(map(len, pins.values())) <= 1
    by = {w.name: w for w in ws}
    moe = [sum(streamed_bytes(by[n], p) for n in by if n.startswith(f"blk.{i}.ffn_") and "_exps" in n)
           for i in range(6)]
    assert max(moe) - min(moe) <= 3 * 4 * MiB  # one expert's three slabs at most

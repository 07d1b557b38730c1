"""Prefill split by experts over several cards (gpu/expert_gpu.py, split_mode="expert") against one card: the same
logits and states within the single-card GPU tests' tolerance, resident and streamed, fresh and continued states,
several prompts in one pass, CPU decode after it; each card streams only its own experts (about half of what one
card streams), and the cards' copies of a state stay bit for bit the same (each card routes its rows itself, so the
split is exact only while they do). `[0, 0]` runs two cards in one GPU's context; `[0, 1]` needs two GPUs."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_profile import PROFILE
from test_gpu_cards import N, _load, _need, _same_states
from test_gpu_prefill import _close, _ids, _streaming_budget

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.gpu


def _cards_agree(gm, states) -> None:
    """Every later card's copy of each state is the host state (card 0's) bit for bit."""
    for k in range(1, len(gm.cards)):
        for st in states:
            ref, v = gm._views[k, id(st)]  # the copy the last pass left (not view(): a new copy is equal trivially)
            assert ref() is st and v.pos == st.pos and np.array_equal(v.tokens[: st.pos], st.tokens[: st.pos])
            for name in ("conv", "ssm", "k", "v"):
                for i, (x, y) in enumerate(zip(v.arrays[name], st.arrays[name], strict=True)):
                    if x is not None:
                        assert np.array_equal(x[: st.pos] if name in ("k", "v") else x,
                                              y[: st.pos] if name in ("k", "v") else y), \
                            f"card {k}'s {name} of layer {i} differs from card 0's: the cards' rows diverged"


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]])
@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_expert_split_matches_one_card(devices, mode, oracle_gguf):
    from hybridinfer.backends.gpu.expert_gpu import ExpertParallelModel

    _need(devices)
    path = oracle_gguf("qwen35moe", "q8_0", layers=8 if mode == "streamed" else None)
    budget = _streaming_budget(path, frac=16) if mode == "streamed" else None
    one = _load(path, budget)
    many = _load(path, [budget] * len(devices) if budget else None, devices=devices, split_mode="expert")
    gm, a = many.backend.gpu, many.args
    assert isinstance(gm, ExpertParallelModel)
    assert [c.m.own for c in gm.cards] == [(0, gm.counts[0]), (gm.counts[0], a.n_expert)]
    assert [(c.m.first, c.m.end) for c in gm.cards] == [(0, a.n_layer + 1), (0, a.n_layer)]  # the head on card 0
    for c in gm.cards:
        if budget:
            assert c.m.allocated_bytes + c.m.link.nbytes <= budget
        ex = [w for w in c.m.infos.values() if w.n_expert]
        assert ex and all((w.first_expert, w.first_expert + w.n_expert) == c.m.own for w in ex)
    ids = _ids(a.n_vocab, N)
    for p0 in (0, 20):  # a fresh state, and one continuing 20 tokens the cards prefilled
        sa, sb = one.new_state(), many.new_state()
        if p0:
            one.prefill(ids[:p0], sa, all_logits=False)
            many.prefill(ids[:p0], sb, all_logits=False)
        want = one.prefill(ids[p0:], sa, all_logits=True)
        got = many.prefill(ids[p0:], sb, all_logits=True)
        _close(got, want, f"expert split {devices} vs one card [{mode} from {p0}]")
        _same_states(sb, sa, N)
        _cards_agree(gm, [sb])
    t = gm.last_timing
    assert t["tokens"] == N - 20 and t["prompts"] == 1
    # each MoE layer, each card takes the other's partial of every row up once
    moe_layers = {w.layer for w in gm.cards[0].m.infos.values() if w.n_expert}
    assert t["exchange_bytes"] == 2 * len(moe_layers) * (N - 20) * 4 * a.n_embd
    if mode == "streamed":
        mine = [c.m.placement.stream_bytes_per_pass for c in gm.cards]
        assert [c["bytes_h2d"] for c in t["cards"]] == mine and all(b > 0 for b in mine)
        alone = one.backend.gpu.placement.stream_bytes_per_pass
        print(f"streamed per pass: one card {alone / 1e6:.1f} MB, the cards {[b / 1e6 for b in mine]} MB")
        # its own experts only and the dense part: about half of one card (the oracle's dense part is a quarter of it)
        assert all(b <= 0.65 * alone for b in mine)
    # CPU decode goes on from the cards' state as from one card's
    ta, tb = one.backend.decode_batch([ids[0]], [sa]), many.backend.decode_batch([ids[0]], [sb])
    _close(tb, ta, "decode after the expert split's prefill")
    # and the next prefill continues after the decoded token: card 1's copy goes up again (the host state moved)
    want = one.prefill(ids[:8], sa, all_logits=False)
    got = many.prefill(ids[:8], sb, all_logits=False)
    _close(got, want, "prefill after decode")
    _cards_agree(gm, [sb])
    many.close()
    one.close()


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]])
def test_several_prompts_in_one_expert_split_pass(devices, oracle_gguf):
    _need(devices)
    path = oracle_gguf("qwen35moe", "q8_0")
    one = _load(path, None)
    many = _load(path, None, devices=devices, split_mode="expert")
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(0, many.args.n_vocab, n)] for n in (40, 5, 33)]
    sa, sb = [one.new_state() for _ in prompts], [many.new_state() for _ in prompts]
    want = one.backend.prefill_many([(p, s, (), None) for p, s in zip(prompts, sa, strict=True)])
    got = many.backend.prefill_many([(p, s, (), None) for p, s in zip(prompts, sb, strict=True)])
    assert many.backend.gpu.last_timing["prompts"] == 3  # one pass of the three
    for w, g, a, b in zip(want, got, sa, sb, strict=True):
        _close(g, w, f"several prompts, expert split on {devices}")
        _same_states(b, a, 40)
    _cards_agree(many.backend.gpu, sb)
    many.close()
    one.close()


def test_auto_takes_the_time_models_choice(oracle_gguf, monkeypatch):
    import hybridinfer.backends.gpu.multi_gpu as mg
    from hybridinfer.backends.gpu.expert_gpu import ExpertParallelModel

    real, seen = mg.choose_split, []
    monkeypatch.setattr(mg, "choose_split", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    path = oracle_gguf("qwen35moe", "q8_0", layers=8)
    budget = _streaming_budget(path, frac=16)
    many = _load(path, [budget] * 2, devices=[0, 0])
    assert seen in (["layer"], ["expert"])  # the time model's, from the cards' budgets, reserves and FMA peaks
    assert isinstance(many.backend.gpu, ExpertParallelModel) == (seen[0] == "expert")
    ids = _ids(many.args.n_vocab, 40)
    one = _load(path, budget)
    _close(many.prefill(ids, many.new_state(), all_logits=True), one.prefill(ids, one.new_state(), all_logits=True),
           f"auto ({seen[0]}) vs one card")
    dense = Engine.load(str(oracle_gguf("qwen35", "q8_0")), backend="reference").args
    assert real(None, dense, 256, [0, 0]) == "layer"  # no experts to split
    many.close()
    one.close()


def test_bench_prefill_runs_each_split_mode(oracle_gguf):
    from hybridinfer.backends.gpu.backend import DEFAULT_CHUNK, Buffers
    from hybridinfer.backends.gpu.expert_card import link_bytes
    from hybridinfer.tools.benchmarks import prefill

    path = oracle_gguf("qwen35moe", "q4_k_m")
    args = Engine.load(str(path), backend="reference").args
    # room for the exchange's buffers beside the pass's, so the expert split streams as the layer split does
    budget = _streaming_budget(path) + Buffers.nbytes(args, DEFAULT_CHUNK, 200) + link_bytes(args, DEFAULT_CHUNK)
    res = prefill.run(str(path), prompts=(40, 160), budget=budget, resident=False, threads=2, card_profile=PROFILE,
                      devices=[0, 0], split_modes=("layer", "expert"))
    print(prefill.markdown(res))
    rows = [r for r in res["rows"] if r["engine"] == "hybridinfer" and r["config"].startswith("2 GPU(s)")]
    assert [r["tokens"] for r in rows if ", split layer," in r["config"]] == [40, 160]
    assert [r["tokens"] for r in rows if ", split expert," in r["config"]] == [40, 160]
    assert all(r["tok_s"] > 0 and r["counts_agree"] and r["flops"] > 0 for r in rows)
    infos = {c["config"].split(", ")[2]: c for c in res["configs"] if c["config"].startswith("2 GPU")}
    assert infos["split expert"]["experts"][0][0] == 0 and infos["split layer"]["experts"] == [None, None]

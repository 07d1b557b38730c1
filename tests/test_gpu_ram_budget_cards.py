"""GPU prefill over several cards under a RAM budget (a fraction of the file), in both split modes: each card reads the
routed experts it does not pin from the GGUF through its own reader on every pass, the budget is split over the CPU
decode and every card's streamer, and the prefill logits and the CPU decode after it are those of one card with the
whole model resident (within the multi-card tests' tolerance), and bit for bit those of the same cards with the whole
model in RAM (the budget changes where a card's bytes come from, not what it computes). The CPU decode after an expert
split is compared with the same split's, not one card's: the split regroups each row's expert sums (a few ulps), and
the decode's 8-bit activations can round such a row to the next step. `[0, 0]` runs two cards in one GPU's context;
`[0, 1]` needs two GPUs."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_gpu_cards import N, _need
from test_gpu_prefill import _close, _ids, _streaming_budget

from hybridinfer.engine.api import Engine
from hybridinfer.errors import RamBudgetError
from hybridinfer.tools.synth import synth_model

pytestmark = pytest.mark.gpu

# routed experts that outweigh the rest (64 of 256 wide a layer, about 13 MB a layer at q8_0), and 8 layers: a
# layer split's card has 4, more than its two staging buffers hold, so every card reads from the file
SHAPE = dict(n_embd=256, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=64, n_expert_used=4,
             n_ff_exp=256, n_ff_shexp=256, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    p = tmp_path_factory.mktemp("ram_cards") / "wide-moe.gguf"
    synth_model(p, "qwen35moe", SHAPE, "q8_0", seed=3)
    return str(p)


def _load(path, **kw):
    from gpu_profile import PROFILE

    return Engine.load(path, backend="gpu", n_ctx=256, gpu_chunk=32, card_profile=PROFILE, spec_type="none", **kw)


def _least(path, **kw) -> int:
    """The least RAM budget that loads: its refusal names it."""
    try:
        _load(path, ram_budget=1, **kw).close()
    except RamBudgetError as e:
        return e.needed
    raise AssertionError("a 1-byte RAM budget loaded")


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]])
@pytest.mark.parametrize("mode", ["layer", "expert"])
def test_cards_under_a_ram_budget_match_one_resident_card(wide, mode, devices):
    _need(devices)
    one = _load(wide)  # one card, the whole model on it, no RAM budget
    ids = _ids(one.args.n_vocab, N)
    want = one.prefill(ids, one.new_state(), all_logits=True)
    one.close()
    vram = [_streaming_budget(wide, frac=16)] * 2  # the cards stream most of their share
    ram = _load(wide, devices=devices, split_mode=mode, vram_budget=vram)  # the same cards, the model in RAM
    st_ram = ram.new_state()
    exact = ram.prefill(ids, st_ram, all_logits=True)
    kw = dict(devices=devices, split_mode=mode, vram_budget=vram, expert_io="pread")
    budget = _least(wide, **kw)
    assert budget < os.path.getsize(wide), "the least RAM budget is not a fraction of the file"
    eng = _load(wide, ram_budget=budget, **kw)
    try:
        gm = eng.backend.gpu
        split = gm.ram_split
        assert len(split.cards) == 2 and split.total <= budget and split.read_per_pass > 0
        assert eng.backend.cpu.ram_plan.on_disk
        for c, part in zip(gm.cards, split.cards, strict=True):
            assert c.m.held == part.held
            # its streamer's page-locked bytes: what the split gave it, less the readers' buffers (not page-locked)
            assert c.m.streamer.host_bytes == part.gpu_bytes - (part.gpu.bounce if part.disk else 0)
        for k in range(2):  # every pass reads the cold experts again, every card its own
            st = eng.new_state()
            before = gm.disk_stats()["bytes_read"]
            got = eng.prefill(ids, st, all_logits=True)
            _close(got, want, f"{mode} split on {devices} under a {budget} B RAM budget, pass {k}")
            assert np.array_equal(got, exact), f"pass {k}: the budget changed what the cards compute"
            assert gm.disk_stats()["bytes_read"] - before == gm.last_timing["micro_batches"] * split.read_per_pass
        # greedy CPU decode from the cards' state, each step fed the in-RAM run's token: the same logits
        tok = int(exact[-1].argmax())
        for step in range(4):
            a = ram.backend.decode_batch([tok], [st_ram])
            b = eng.backend.decode_batch([tok], [st])
            assert np.array_equal(a, b), f"decode step {step} after the {mode} split's prefill under the budget"
            tok = int(a[0].argmax())
    finally:
        eng.close()
        ram.close()

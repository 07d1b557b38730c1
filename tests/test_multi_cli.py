"""--devices / Engine.load(devices=[...]) reach the multi-card prefill (a stand-in for it here: no GPU) with a VRAM
budget a device; bad lists are typed errors naming the value."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.cli import main
from hybridinfer.engine.api import Engine
from hybridinfer.errors import ParameterError


@pytest.fixture
def cards(monkeypatch):
    import hybridinfer.backends.gpu.multi_gpu as mg

    class Seen(list):
        choice: dict

    seen = Seen()

    class StandIn:
        compiled: list = []

        def __init__(self, gm, args, n_ctx, devices, vram_budget=None, **kw):
            seen.append((devices, vram_budget, kw))
            self.n_ctx, self.vram_budget, self.n_vocab = n_ctx, vram_budget, args.n_vocab

        def forward(self, tokens, state, all_logits=True, snapshot_at=(), on_snapshot=None):
            """Flat logits; the state moves on as a prefill moves it (its arrays are not this test's)."""
            state.tokens[state.pos : state.pos + len(tokens)] = tokens
            state.pos += len(tokens)
            return np.zeros((len(tokens) if all_logits else 1, self.n_vocab), np.float32)

        def close(self):
            pass

    class ExpertStandIn(StandIn):
        def __init__(self, gm, args, n_ctx, devices, vram_budget=None, **kw):
            super().__init__(gm, args, n_ctx, devices, vram_budget, split="expert", **kw)

    import hybridinfer.backends.gpu.expert_gpu as eg

    monkeypatch.setattr(mg, "MultiGPUModel", StandIn)
    monkeypatch.setattr(eg, "ExpertParallelModel", ExpertStandIn)
    # auto: the time model's choice needs the cards' budgets and peaks; here it says what the test sets
    choice = {"mode": "layer"}
    monkeypatch.setattr(mg, "choose_split", lambda *a, **k: seen.append(("chose", choice["mode"])) or choice["mode"])
    seen.choice = choice
    return seen


def test_engine_load_devices_reaches_the_multi_card_prefill(cards, smollm_path):
    from hybridinfer.backends import GPUPrefillCPUDecode

    eng = Engine.load(smollm_path, backend="gpu", n_ctx=64, n_threads=1, devices=[0, 1],
                      vram_budget=[1 << 30, 2 << 30], micro_batch=128, card_profile="fermi")
    assert isinstance(eng.backend, GPUPrefillCPUDecode)
    devices, budget, kw = cards[-1]
    assert devices == [0, 1] and budget == [1 << 30, 2 << 30]
    assert kw["micro_batch"] == 128 and kw["card_profile"] == "fermi"
    eng.close()


@pytest.mark.parametrize("kw,match", [
    (dict(devices=[0, 1], vram_budget=[1 << 30]), "1 VRAM budgets for 2 devices"),
    (dict(devices=[], vram_budget=None), "non-empty list"),
    (dict(devices=[0, -2]), "-2 is not a CUDA device"),
    (dict(vram_budget=[1 << 30, 1 << 30]), "needs devices"),
    (dict(devices=[0, 1], device=1), "not both"),
])
def test_bad_device_lists_are_named(kw, match):
    with pytest.raises(ParameterError, match=match):
        Engine.load("/nonexistent/model.gguf", backend="gpu", n_ctx=64, n_threads=1, **kw)  # before loading


def test_cli_devices_and_a_budget_a_device(cards, smollm_path, capsys):
    base = ["run", "-m", smollm_path, "--backend", "gpu", "-t", "1", "-c", "64", "-n", "1", "-p", "hi"]
    assert main([*base, "--devices", "0,0", "--vram-budget", "1GiB,512MiB"]) == 0
    assert cards[-1][:2] == ([0, 0], [1 << 30, 512 << 20])
    assert main([*base, "--devices", "1,0", "--vram-budget", "3GiB"]) == 0
    assert cards[-1][:2] == ([1, 0], 3 << 30)
    capsys.readouterr()
    assert main([*base, "--devices", "0,x"]) == 2
    assert "'0,x'" in capsys.readouterr().err
    assert main([*base, "--devices", "0,1", "--vram-budget", "1GiB,2GiB,3GiB"]) == 2
    assert "3 VRAM budgets for 2 devices" in capsys.readouterr().err


def test_split_mode_reaches_the_expert_split_or_the_pipeline(cards, smollm_path):
    def load(**kw):
        eng = Engine.load(smollm_path, backend="gpu", n_ctx=64, n_threads=1, devices=[0, 1], card_profile="fermi",
                          **kw)
        eng.close()
        return cards[-1]

    assert load(split_mode="expert")[2] == {"split": "expert", "chunk": 1024, "card_profile": "fermi",
                                             "bus_bw": None, "fit_n_ctx": False, "kv_stream": None}
    assert "split" not in load(split_mode="layer")[2]
    cards.choice["mode"] = "expert"
    assert load()[2]["split"] == "expert" and cards[-2] == ("chose", "expert")  # auto: the time model's choice
    n = len(cards)
    assert "split" not in load(micro_batch=64)[2] and len(cards) == n + 1  # micro-batches: the pipeline, no choice


@pytest.mark.parametrize("kw,match", [
    (dict(devices=[0, 1], split_mode="row"), "split mode 'row' is not one of auto, layer, expert .*llama.cpp"),
    (dict(devices=[0, 1], split_mode="Expert"), "'Expert'"),
    (dict(split_mode="expert"), "needs devices"),
    (dict(devices=[0, 1], split_mode="expert", micro_batch=32), "micro_batch 32 is the layer pipeline's"),
])
def test_bad_split_modes_are_named(kw, match):
    with pytest.raises(ParameterError, match=match):
        Engine.load("/nonexistent/model.gguf", backend="gpu", n_ctx=64, n_threads=1, **kw)  # before loading


def test_cli_split_mode(cards, smollm_path, capsys):
    base = ["run", "-m", smollm_path, "--backend", "gpu", "-t", "1", "-c", "64", "-n", "1", "-p", "hi", "--devices",
            "0,1"]
    assert main([*base, "-sm", "expert"]) == 0
    assert cards[-1][2]["split"] == "expert"
    assert main([*base, "--split-mode", "layer"]) == 0
    assert "split" not in cards[-1][2]
    capsys.readouterr()
    assert main([*base, "--split-mode", "row"]) == 2
    err = capsys.readouterr().err
    assert "'row'" in err and "Traceback" not in err
    assert main(["bench", "prefill", "-m", smollm_path, "--devices", "0,1", "--split-mode", "layer,bogus"]) == 2
    err = capsys.readouterr().err
    assert "'bogus'" in err and "Traceback" not in err and err.count("\n") == 1

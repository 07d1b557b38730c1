"""`hybridinfer synth` end to end: write a small synthetic qwen35moe with a borrowed vocabulary, inspect it,
run it on the reference, and check it against llama.cpp on the same file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridinfer.cli import main
from hybridinfer.engine.api import Engine

SHAPE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=49152, n_expert=4,
             n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)


@pytest.fixture(scope="module")
def synth_file(tmp_path_factory, smollm_path):
    p = tmp_path_factory.mktemp("synth") / "moe.gguf"
    rc = main(["synth", "--arch", "qwen35moe", "--shape", json.dumps(SHAPE), "--quant", "q8_0", "--seed", "3",
               "--vocab-from", smollm_path, "-o", str(p)])
    assert rc == 0
    return str(p)


def test_synth_info(synth_file, capsys):
    assert main(["info", "-m", synth_file]) == 0
    out = capsys.readouterr().out
    assert "architecture:  qwen35moe" in out and "pattern GGGA  + a multi-token-prediction block" in out
    assert "Q8_0" in out
    assert "n_expert           4" in out


def test_synth_runs_on_reference_and_matches_llama_cpp(synth_file):
    eng = Engine.load(synth_file, backend="reference", n_ctx=128)
    ids = eng.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    assert len(ids) > 20
    lg = eng.logits(ids)
    assert np.isfinite(lg).all() and lg.std() > 0
    g = eng.generate("Hello", max_tokens=5, temperature=0.0)
    assert len(g.tokens) == 5 and eng.detokenize(g.tokens) == g.text
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=synth_file, n_ctx=128, logits_all=True, verbose=False)
    assert llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 3, add_bos=False) == ids
    llm.eval(ids)
    ll = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    emu = Engine.load(synth_file, backend="reference", n_ctx=128, act_quant=True).logits(ids)
    agree = float(np.mean(emu.argmax(-1) == ll.argmax(-1)))
    print(f"synthetic qwen35moe q8_0: reference(act_quant) vs llama.cpp top-1 {agree:.1%}, "
          f"max|dlogit| {np.abs(emu - ll).max():.3g} of {np.abs(ll).max():.3g}")
    assert agree >= 0.9


def test_synth_f32_reads_identically_in_llama_cpp(tmp_path, smollm_path):
    """No rounding anywhere: the synthetic file means the same model to llama.cpp and to the reference."""
    llama_cpp = pytest.importorskip("llama_cpp")
    p = str(tmp_path / "moe-f32.gguf")
    assert main(["synth", "--arch", "qwen35moe", "--shape", json.dumps(SHAPE), "--quant", "f32", "--seed", "4",
                 "--vocab-from", smollm_path, "-o", p]) == 0
    eng = Engine.load(p, backend="reference", n_ctx=128)
    ids = eng.tokenize("Synthetic weights, real tokenizer: 1234 ünïcödé, done.")
    llm = llama_cpp.Llama(model_path=p, n_ctx=128, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(ids)
    ll = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    d = float(np.abs(eng.logits(ids) - ll).max())
    print(f"synthetic qwen35moe f32: reference vs llama.cpp max|dlogit| {d:.3g} of {np.abs(ll).max():.3g}")
    assert d <= 1e-4 * np.abs(ll).max()


def test_synth_bad_shape_is_a_clean_error(tmp_path, capsys):
    rc = main(["synth", "--arch", "qwen35moe", "--shape", "36b-a3b", "-o", str(tmp_path / "x.gguf")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "36b-a3b" in err and "35b-a3b" in err


def test_synth_quiet_pads_flag(tmp_path, smollm_path):
    """--quiet-pads reaches the writer: the padding tokens past the borrowed vocabulary score exactly 0."""
    from hybridinfer.format.gguf_model import GGUFModel

    p = str(tmp_path / "quiet.gguf")
    shape = dict(SHAPE, n_vocab=49152 + 512)
    assert main(["synth", "--arch", "qwen35moe", "--shape", json.dumps(shape), "--quant", "q8_0", "--quiet-pads",
                 "--vocab-from", smollm_path, "-o", p]) == 0
    m = GGUFModel(p)
    name = "output.weight" if "output.weight" in m.tensors else "token_embd.weight"
    w = m.dequant(name).reshape(shape["n_vocab"], -1)
    assert not w[49152:].any() and w[:49152].any()

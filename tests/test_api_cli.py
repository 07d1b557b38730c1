"""Engine API and CLI on the embedded default model and tiny models; architecture-level load errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf_edit import rewrite

from hybridinfer.engine.api import Engine
from hybridinfer.errors import (
    BackendNotAvailableError,
    ContextLengthError,
    MissingMetadataError,
    MissingTensorError,
    ParameterError,
    TensorShapeError,
    UnsupportedArchitectureError,
)


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridinfer", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.isa  # the CLI computes at the level HYBRIDINFER_ISA forces: re-run at each (.ci/run)
def test_cli_run_default_model_says_paris():
    r = _cli("run", "--raw", "-p", "The capital of France is", "-n", "8", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout, r.stdout


@pytest.mark.isa  # the CLI computes at the level HYBRIDINFER_ISA forces: re-run at each (.ci/run)
def test_readme_quick_start_answers_paris():
    """The README's first command (chat-templated, default backend and sampling) answers as the README says."""
    r = _cli("run", "-p", "Name the capital of France.")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris.", r.stdout


def test_cli_info_and_logits(tmp_path, smollm_path, smollm_ref):
    r = _cli("info")
    assert r.returncode == 0, r.stderr
    assert "architecture:  llama" in r.stdout and "pattern AAAA" in r.stdout and "Q4_1" in r.stdout
    assert "simd path:" in r.stdout and "cpu:" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hybridinfer", "info"], capture_output=True, text=True,
                       env={**os.environ, "HYBRIDINFER_ISA": "ssse3"})
    assert "simd path:     ssse3 (forced by HYBRIDINFER_ISA)" in r.stdout, r.stdout
    out = tmp_path / "l.npy"
    r = _cli("logits", "-m", smollm_path, "--tokens", "1,504,3458", "-o", str(out), "--backend", "reference")
    assert r.returncode == 0, r.stderr
    lg = np.load(out)
    assert lg.shape == (3, smollm_ref.args.n_vocab) and lg.dtype == np.float32
    assert np.allclose(lg, smollm_ref.logits([1, 504, 3458]), atol=1e-4)


def test_cli_errors_are_clean(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("hello")
    r = _cli("info", "-m", str(bad))
    assert r.returncode == 2 and "not a GGUF" in r.stderr and "Traceback" not in r.stderr
    r = _cli("logits", "-m", str(bad), "--tokens", "1,x", "-o", str(tmp_path / "o.npy"))
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_generate_stream_and_stop(smollm_ref):
    eng = smollm_ref
    g = eng.generate("Once upon a time", max_tokens=12, temperature=0.7, seed=3)
    pieces = list(eng.stream("Once upon a time", max_tokens=12, temperature=0.7, seed=3))
    # a sample may meet the end of text before 12 tokens: what holds for any sample
    assert "".join(pieces) == g.text and (len(g.tokens) == 12) == (g.finish_reason == "length")
    assert eng.detokenize(g.tokens) == g.text
    g2 = eng.generate("Once upon a time", max_tokens=12, temperature=0.7, seed=3)
    assert g2.tokens == g.tokens  # seeded
    # a stop string cuts the text before it and ends generation
    word = g.text.strip().split()[1] if len(g.text.split()) > 1 else g.text.strip()[:3]
    g3 = eng.generate("Once upon a time", max_tokens=12, temperature=0.7, seed=3, stop=[word])
    assert word not in g3.text and g3.finish_reason == "stop"
    assert g.text.startswith(g3.text)


def test_chat_messages_are_templated(smollm_ref):
    eng = smollm_ref
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = eng.chat_prompt(msgs)
    assert "<|im_start|>user" in text and text.rstrip().endswith("assistant")
    g = eng.generate(msgs, max_tokens=16, temperature=0.0)
    assert "Paris" in g.text, g.text
    assert g.prompt_tokens == len(eng.encode_prompt(msgs))


def test_chat_template_override(smollm_path, tmp_path, capsys):
    """A template file replaces the GGUF's (Engine.load(chat_template=...), --chat-template-file); a bad one is a
    typed error before any request, naming the fault."""
    from hybridinfer.cli import main
    from hybridinfer.errors import TemplateError

    tmpl = ("{% for m in messages %}<<{{ m.role }}:{{ m.content }}>>{% endfor %}"
            "{% if add_generation_prompt %}=>{% endif %}")
    eng = Engine.load(smollm_path, backend="reference", n_ctx=256, chat_template=tmpl)
    assert eng.chat_prompt([{"role": "user", "content": "hi"}]) == "<<user:hi>>=>"
    for bad, match in (("", "empty"), ("{% for x in %}", "syntax error")):
        with pytest.raises(TemplateError, match=match):
            Engine.load(smollm_path, backend="reference", n_ctx=256, chat_template=bad)
    path = tmp_path / "t.jinja"
    path.write_text(tmpl)
    assert main(["run", "-m", smollm_path, "--backend", "reference", "--chat-template-file", str(path), "-n", "1",
                 "--stats", "-p", "hi"]) == 0
    assert f"[prompt {len(eng.tokenize('<<user:hi>>=>'))} tok" in capsys.readouterr().err
    path.write_bytes(b"\xff\xfe{{")
    assert main(["run", "-m", smollm_path, "--chat-template-file", str(path), "-p", "hi"]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    assert main(["run", "-m", smollm_path, "--chat-template-file", str(tmp_path / "none.jinja"), "-p", "hi"]) == 2
    assert "none.jinja" in capsys.readouterr().err


@pytest.mark.parametrize("opt,bad,match", [("card_profile", "tesla", "card_profile 'tesla'"),
                                           ("bus_bw", -6e9, "bus_bw must be a positive"),
                                           ("bus_bw", "fast", "bus_bw must be bytes per second")])
def test_bad_gpu_options_refused_before_loading(opt, bad, match):
    with pytest.raises(ParameterError, match=match):
        Engine.load("/nonexistent/model.gguf", backend="gpu", **{opt: bad})


def test_engine_bad_input(smollm_ref, smollm_path):
    eng = smollm_ref
    with pytest.raises(ContextLengthError, match="n_ctx=1024"):
        eng.generate([1] * 1000, max_tokens=100)
    with pytest.raises(ContextLengthError):
        eng.logits([1] * 1025)
    with pytest.raises(ValueError, match="token id 999999"):
        eng.logits([1, 999999])
    with pytest.raises(ValueError, match="temperature"):
        eng.generate("hi", temperature=-1)
    from hybridinfer_gpu_probe import has_gpu

    if not has_gpu():  # backend="gpu" says why it cannot run; "auto" falls back to the CPU, saying so once
        with pytest.raises(BackendNotAvailableError, match="pycuda|CUDA"):
            Engine.load(smollm_path, backend="gpu")
        import hybridinfer.backends as bk

        bk._warned = False
        with pytest.warns(UserWarning, match="prefill runs on the CPU"):
            auto = Engine.load(smollm_path, backend="auto")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # only once
            Engine.load(smollm_path, backend="auto")
        assert type(auto.backend).__name__ == "CPUModel"
        assert auto.generate("The capital of France is", max_tokens=3, temperature=0).text
    with pytest.raises(BackendNotAvailableError, match="unknown backend 'tpu'"):
        Engine.load(smollm_path, backend="tpu")
    with pytest.raises(TypeError, match="bogus"):
        Engine.load(smollm_path, bogus=1)


def test_architecture_level_errors(tmp_path, oracle_gguf):
    src = oracle_gguf("qwen35")
    p = tmp_path / "a.gguf"
    rewrite(src, str(p), arch="mamba3")
    with pytest.raises(UnsupportedArchitectureError, match="'mamba3'"):
        Engine.load(str(p))
    rewrite(src, str(p), drop={"blk.1.ssm_a"})
    with pytest.raises(MissingTensorError, match="blk.1.ssm_a"):
        Engine.load(str(p))
    rewrite(src, str(p), replace={"blk.3.attn_k.weight": np.zeros((5, 64), np.float32)})
    with pytest.raises(TensorShapeError, match="blk.3.attn_k.weight"):
        Engine.load(str(p))
    rewrite(src, str(p), meta={"qwen35.ssm.state_size": None})
    with pytest.raises(MissingMetadataError, match="qwen35.ssm.state_size"):
        Engine.load(str(p))


def test_cli_default_backend_is_auto(monkeypatch):
    """No --backend: every command asks the library for `auto` (the reference only when asked for)."""
    import hybridinfer.engine.api as api
    from hybridinfer import cli

    seen = []
    monkeypatch.delenv("HYBRIDINFER_BACKEND", raising=False)
    monkeypatch.setattr(api.Engine, "load", classmethod(lambda c, path, backend, **kw: seen.append(backend)))
    cli._engine(cli.build_parser().parse_args(["run", "-p", "x"]))
    cli._engine(cli.build_parser().parse_args(["logits", "--tokens", "1", "-o", "x.npy"]))
    cli._engine(cli.build_parser().parse_args(["run", "-p", "x", "--backend", "reference"]))
    assert seen == ["auto", "auto", "reference"]


def test_auto_backend_with_and_without_gpu(monkeypatch, smollm_path):
    """`auto` (the library's default): GPU prefill + CPU decode where the GPU backend can start, else the CPU
    backend, never the numpy reference. The GPU is mocked so both branches run on any machine."""
    import inspect

    import hybridinfer.backends.gpu.backend as gb
    from hybridinfer.backends import Backend, GPUPrefillCPUDecode
    from hybridinfer.backends.cpu.backend import CPUModel
    from hybridinfer.errors import BackendNotAvailableError

    assert inspect.signature(Engine.load).parameters["backend"].default == "auto"

    class NoCard:
        def __init__(self, *a, **k):
            raise BackendNotAvailableError("no CUDA device (mocked)")

    class FakeCard:
        def __init__(self, gm, args, n_ctx, **kw):
            self.kw = kw

    import hybridinfer.backends as backends

    monkeypatch.setattr(backends, "_warned", False)  # the fallback is said once per process
    monkeypatch.setattr(gb, "GPUModel", NoCard)
    with pytest.warns(UserWarning, match="no usable GPU"):
        eng = Engine.load(smollm_path, n_ctx=64)
    assert type(eng.backend) is CPUModel and isinstance(eng.backend, Backend)
    assert eng.generate("Hi", max_tokens=2, temperature=0).tokens  # it runs
    monkeypatch.setattr(gb, "GPUModel", FakeCard)
    eng = Engine.load(smollm_path, n_ctx=64, vram_budget=1 << 30)
    assert isinstance(eng.backend, GPUPrefillCPUDecode) and isinstance(eng.backend.cpu, CPUModel)
    assert eng.backend.gpu.kw["vram_budget"] == 1 << 30
    assert eng.backend.numeric_path == f"gpu-prefill+cpu:{eng.backend.cpu.simd.isa}"


def test_cli_bench_commands_write_tables(tmp_path, oracle_gguf, capsys):
    """`hybridinfer bench decode` and `bench prefix` on a tiny model (no llama.cpp binaries): table, JSON, PNG."""
    from hybridinfer.cli import main

    path = str(oracle_gguf("qwen35", "q8_0"))
    assert main(["bench", "decode", "-m", path, "-t", "2", "-n", "4", "--out-dir", str(tmp_path)]) == 0
    assert main(["bench", "prefix", "-m", path, "-t", "2", "--workloads", "a", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "% of floor" in out and "| a | hybridinfer |" in out
    names = sorted(p.name for p in tmp_path.iterdir())
    res = json.loads((tmp_path / "decode-qwen35-wide-s0-q8_0-t2.json").read_text())
    rd = res["read_bw_readings_gb_s"]  # 4 steps in 4 segments: a reading before each and one after
    assert len(rd) == 5 and res["read_bw_gb_s"] == max(rd)
    (row,) = res["rows"]  # each of the 4 one-step runs' floor time at the mean of the readings around it
    assert row["probe_readings_gb_s"] == rd
    assert row["probe_gb_s"] == pytest.approx(4 / sum(2 / (a + b) for a, b in zip(rd, rd[1:], strict=False)))
    assert row["floor_frac"] == pytest.approx(row["tok_s"] * res["bytes_per_token"] / (row["probe_gb_s"] * 1e9))
    # each run's own fraction: the row's is their floor times' sum over the runs' time, so it lies among them
    runs = row["run_floor_fracs"]
    assert len(runs) == 4
    assert min(runs) <= row["floor_frac"] * (1 + 1e-9) and max(runs) >= row["floor_frac"] * (1 - 1e-9)
    assert f"{100 * row['floor_frac']:.0f}% ({100 * min(runs):.0f}-{100 * max(runs):.0f})" in out
    assert names == ["decode-qwen35-wide-s0-q8_0-t2.json", "decode-qwen35-wide-s0-q8_0-t2.png",
                     "prefix-qwen35-wide-s0-q8_0.json", "prefix-qwen35-wide-s0-q8_0.png"]
    assert main(["bench", "prefix", "-m", path, "--workloads", "z"]) == 2  # a clear error, not a traceback


def test_effective_bandwidth_weighs_each_run_by_its_floor_time():
    from hybridinfer.tools.benchmarks.decode import effective_bandwidth

    assert effective_bandwidth([100.0, 100.0], [7]) == pytest.approx(100.0)
    # 8 steps at 50 then 8 at 150 (means of the readings around each run): floor times 8/50 + 8/150
    assert effective_bandwidth([40.0, 60.0, 140.0, 160.0], [8, 0, 8]) == pytest.approx(16 / (8 / 50 + 8 / 150))
    assert effective_bandwidth([100.0, 50.0, 150.0], [1, 3]) == pytest.approx(4 / (1 / 75 + 3 / 100))
    for readings, counts in (([100.0], [4]), ([100.0, 90.0], [0]), ([100.0, -1.0], [4])):
        with pytest.raises(ValueError, match="one more positive reading"):
            effective_bandwidth(readings, counts)


def test_run_floor_fracs_hold_each_run_to_its_own_readings():
    from hybridinfer.tools.benchmarks.decode import run_floor_fracs

    # 2 tokens of 1e9 bytes at 50 GB/s (readings 40, 60) in 0.05 s: 80%; 0 tokens left out; 1 token at 150 in 0.01 s
    fr = run_floor_fracs([40e9, 60e9, 140e9, 160e9], [2, 0, 1], [0.05, 0.01, 0.01], 10**9)
    assert fr == pytest.approx([(2 / 50) / 0.05, (1 / 150) / 0.01])
    with pytest.raises(ValueError, match="positive time per run"):
        run_floor_fracs([1e9, 1e9], [1], [0.0], 10)
    with pytest.raises(ValueError, match="one more positive reading"):
        run_floor_fracs([1e9], [1], [1.0], 10)


def test_bandwidth_probe_size_outgrows_the_cache():
    from hybridinfer.tools.benchmarks.decode import probe_bytes

    gib = 1 << 30
    assert probe_bytes(300 << 20, 100 * gib) == 8 * (300 << 20)  # 8x a 300 MiB L3
    assert probe_bytes(8 << 20, 100 * gib) == gib  # at least 1 GiB
    assert probe_bytes(300 << 20, 8 * gib) == 2 * gib  # at most a quarter of the available memory
    assert probe_bytes(300 << 20, 2 * gib) == gib
    assert probe_bytes(300 << 20, 0) == 8 * (300 << 20)  # unknown memory: no cap


def test_serve_snapshots_turns_not_strides():
    """serve's default snapshot stride is 0 (turn boundaries, prompt ends and shared prefixes only), so many long
    conversations' useful snapshots are not evicted by stride snapshots; run keeps the backend's stride."""
    from hybridinfer.cli import build_parser

    assert build_parser().parse_args(["serve"]).snapshot_stride == 0
    assert build_parser().parse_args(["serve", "--snapshot-stride", "128"]).snapshot_stride == 128
    assert build_parser().parse_args(["run", "-p", "x"]).snapshot_stride is None

"""K/V cache types and the context length on the command line (issue 31: -ctk / -ctv / --no-cache-rotate and
-c/--ctx-size on every engine command and `plan`), the context chooser (engine/context.py) and the GPU pass fit,
all without hardware: the embedded SmolLM2 on the CPU backend, a mocked card, published shapes."""

from __future__ import annotations

import re

import pytest

from hybridinfer.cli import build_parser, main
from hybridinfer.engine.api import Engine
from hybridinfer.engine.context import CTX_STEP, MIN_CTX, ContextChoice, choose_n_ctx, gpu_cut
from hybridinfer.errors import ContextLengthError, ParameterError
from hybridinfer.format.quant_types import CACHE_TYPES
from hybridinfer.models import model_args
from hybridinfer.models.state_kinds import kv_rotation, state_bytes, with_cache_types
from hybridinfer.tools.shape_model import ShapeModel

ENGINE_COMMANDS = (["run", "-p", "x"], ["chat"], ["logits", "--tokens", "1", "-o", "x.npy"], ["serve"],
                   ["batch", "in.jsonl", "-o", "out.jsonl"])


@pytest.fixture(scope="module")
def smol_args(smollm_path):
    from hybridinfer.format.gguf_model import GGUFModel

    return model_args(GGUFModel(smollm_path))


@pytest.fixture(scope="module")
def hybrid_args():
    """A Qwen3.5 shape: GDN layers (recurrent state a sequence) beside attention (K/V a token)."""
    return model_args(ShapeModel("qwen35", "0.8b", "q4_k_m"))


def _spy_load(monkeypatch) -> list:
    """Engine.load as it is, each engine it makes (and the keywords it got) recorded."""
    made, real = [], Engine.load.__func__

    def load(cls, *a, **kw):
        eng = real(cls, *a, **kw)
        made.append((eng, kw))
        return eng

    monkeypatch.setattr(Engine, "load", classmethod(load))
    return made


# ---- flags ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", ENGINE_COMMANDS, ids=lambda a: a[0])
def test_every_engine_command_takes_the_llama_cpp_flags(argv, monkeypatch):
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    p = build_parser()
    a = p.parse_args(argv)
    assert (a.cache_type_k, a.cache_type_v, a.no_cache_rotate, a.n_ctx) == ("f32", "f32", False, None)
    a = p.parse_args([*argv, "-ctk", "q8_0", "-ctv", "q4_0", "--no-cache-rotate", "-c", "2048"])
    assert (a.cache_type_k, a.cache_type_v, a.no_cache_rotate, a.n_ctx) == ("q8_0", "q4_0", True, 2048)
    for flag in ("--ctx-size", "--n-ctx"):  # llama.cpp's long name, and this engine's old one
        assert p.parse_args([*argv, flag, "512"]).n_ctx == 512
    a = p.parse_args([*argv, "--cache-type-k", "f16", "--cache-type-v", "q8_0"])
    assert (a.cache_type_k, a.cache_type_v) == ("f16", "q8_0")


def test_flag_choices_are_the_cache_types_and_help_names_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "-ctk TYPE, --cache-type-k TYPE" in out and "(default: f32)" in out
    assert all(t in out for t in CACHE_TYPES)
    assert "LLAMA_ATTN_ROT_DISABLE" in out and "-c N_CTX, --ctx-size N_CTX, --n-ctx N_CTX" in out


@pytest.mark.parametrize("value,off", [("1", True), ("0", False), ("", False), ("yes", False), ("2x", True)])
def test_rotation_env_as_llama_cpp_reads_it(value, off, monkeypatch):
    """LLAMA_ATTN_ROT_DISABLE is read with atoi, as llama.cpp reads it: a nonzero number turns rotation off."""
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", value)
    assert build_parser().parse_args(["run", "-p", "x"]).no_cache_rotate is off


@pytest.mark.parametrize("argv", [["run", "-p", "x", "-ctk", "q5_9"], ["serve", "-ctv", "q5_9"],
                                  ["plan", "--shape", "0.8b", "--card", "k80", "-ctk", "q5_9"]],
                         ids=["run", "serve", "plan"])
def test_bad_cache_type_is_one_usage_line(argv, capsys):
    assert main(argv) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "'q5_9'" in lines[0] and "q8_0" in lines[0], lines


@pytest.mark.parametrize("kw", [{"cache_type_k": "q5_9"}, {"cache_type_v": "q5_9"}])
def test_bad_cache_type_is_refused_before_the_model_is_read(kw):
    with pytest.raises(ParameterError, match=r"cache_type_[kv].*'q5_9'"):
        Engine.load("/nonexistent/model.gguf", **kw)


def test_flags_reach_the_engine(monkeypatch, capsys):
    made = _spy_load(monkeypatch)
    argv = ["run", "--backend", "cpu", "-t", "1", "--raw", "-p", "Hello", "-n", "2", "--prefix-cache-ram", "0"]
    assert main([*argv, "-ctk", "q8_0", "-ctv", "q4_0", "-c", "300"]) == 0
    eng, kw = made[-1]
    assert (eng.args.cache_type_k, eng.args.cache_type_v, eng.n_ctx) == ("q8_0", "q4_0", 300)
    assert kw["cache_rotate"] is True and kv_rotation(eng.args) == (64, 64)  # SmolLM2's heads of 64 values
    assert capsys.readouterr().out.strip()  # it generated
    assert main([*argv, "-ctk", "q8_0", "--no-cache-rotate", "--n-ctx", "256"]) == 0
    eng, _ = made[-1]
    assert eng.args.cache_rotate is False and kv_rotation(eng.args) == (0, 0) and eng.n_ctx == 256


# ---- the context chooser -------------------------------------------------------------------------------------------

def test_trained_length_where_it_fits(smol_args):
    trained = smol_args.context_length
    assert choose_n_ctx(smol_args, 8, 8 * state_bytes(smol_args, trained)) == ContextChoice(trained, "")
    assert choose_n_ctx(smol_args, 8, None) == ContextChoice(trained, "")  # memory unknown: taken to fit


@pytest.mark.parametrize("which", ["smol", "hybrid"])
@pytest.mark.parametrize("max_seqs,tokens", [(8, 3000), (1, 5000), (3, 1000)])
def test_longest_multiple_that_fits(which, max_seqs, tokens, smol_args, hybrid_args):
    args = smol_args if which == "smol" else hybrid_args
    avail = max_seqs * state_bytes(args, tokens) + 123
    c = choose_n_ctx(args, max_seqs, avail)
    want = tokens // CTX_STEP * CTX_STEP
    assert c.n_ctx == want < args.context_length
    assert max_seqs * state_bytes(args, c.n_ctx) <= avail < max_seqs * state_bytes(args, c.n_ctx + CTX_STEP)
    assert c.note.startswith(f"n_ctx {want}: ") and f"{max_seqs} sequences" in c.note
    assert f"trained {args.context_length}" in c.note and "even this" not in c.note


def test_too_little_memory_still_gives_the_least_and_says_so(hybrid_args):
    c = choose_n_ctx(hybrid_args, 8, 1000)
    assert c.n_ctx == MIN_CTX and "does not fit" in c.note


def test_cache_types_count_in_the_choice(smol_args):
    avail = 4 * state_bytes(smol_args, 2000)
    f32 = choose_n_ctx(smol_args, 4, avail)
    q4 = choose_n_ctx(with_cache_types(smol_args, "q4_0", "q4_0"), 4, avail)
    assert f32.n_ctx == 1792 and q4.n_ctx == smol_args.context_length  # q4_0 rows: 18 bytes a 32 values, not 128


def test_explicit_value_is_kept_or_clamped(smol_args):
    trained = smol_args.context_length
    assert choose_n_ctx(smol_args, 8, 1, requested=1000) == ContextChoice(1000, "")  # memory not consulted
    c = choose_n_ctx(smol_args, 8, None, requested=trained + 5)
    assert c.n_ctx == trained and str(trained + 5) in c.note


def test_engine_chooses_and_says_why(monkeypatch, smol_args):
    import hybridinfer.engine.api as api

    room = 2 * state_bytes(smol_args, 700)
    monkeypatch.setattr(api, "room_beside", lambda model_bytes: room)
    eng = Engine.load(None, backend="cpu", n_threads=1, max_seqs=2)
    try:
        assert eng.n_ctx == 512 and eng.ctx_note.startswith("n_ctx 512: ")
        with pytest.raises(ContextLengthError, match="n_ctx=512"):  # a request past the chosen context: typed
            eng.make_request([1] * 500, max_tokens=20)
        with pytest.raises(ContextLengthError):
            eng.logits([1] * 513)
    finally:
        eng.close()
    eng = Engine.load(None, backend="cpu", n_threads=1, n_ctx=600, max_seqs=2)  # given: kept, memory aside
    assert (eng.n_ctx, eng.ctx_note) == (600, "")
    eng.close()
    with pytest.raises(ParameterError, match="max_seqs must be a whole number >= 1, got 0"):
        Engine.load("/nonexistent/model.gguf", max_seqs=0)


def test_cli_says_the_choice_on_stderr(monkeypatch, capsys, smol_args):
    import hybridinfer.engine.api as api

    argv = ["run", "--backend", "cpu", "-t", "1", "--raw", "-p", "Hi", "-n", "1", "--prefix-cache-ram", "0"]
    monkeypatch.setattr(api, "room_beside", lambda model_bytes: 8 * state_bytes(smol_args, 1000))
    assert main(argv) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("hybridinfer: n_ctx 768: ") and "8 sequences" in err[0], err
    monkeypatch.setattr(api, "room_beside", lambda model_bytes: 1 << 50)  # the trained length fits: nothing said
    assert main(argv) == 0 and capsys.readouterr().err == ""


# ---- a GPU prefill's pass ------------------------------------------------------------------------------------------

def test_pass_fit_is_exact_and_the_placement_takes_it(hybrid_args):
    from hybridinfer.backends.gpu.backend import Buffers, pass_tokens_fitting
    from hybridinfer.backends.gpu.placement import plan_placement, staged, weights_of

    gm = ShapeModel("qwen35", "0.8b", "q4_k_m")
    a, C = hybrid_args, 256
    ws = weights_of(gm, a, matrices_only=True)
    by_layer: dict = {}
    for w in ws:
        if w.name != "token_embd.weight":
            by_layer[w.layer] = by_layer.get(w.layer, 0) + staged(w)
    least = 2 * max(by_layer.values())
    fixed = Buffers.nbytes(a, C, 0)
    for n in (1, 3000, 40_000):  # a pass takes half of what the least staging leaves; the rest keeps weights
        budget = fixed + 2 * (Buffers.nbytes(a, C, n) - fixed) + least
        assert pass_tokens_fitting(a, C, budget, ws) == n
        assert pass_tokens_fitting(a, C, budget - 1, ws) == n - 1
        plan_placement(ws, budget, Buffers.nbytes(a, C, n))  # fits: no BudgetError
    assert pass_tokens_fitting(a, C, least, ws) == 0


def test_engine_takes_the_cards_shorter_pass(monkeypatch, smollm_path):
    """A GPU prefill asked to fit (n_ctx not given) may hold fewer tokens than the host would: the engine takes its
    n_ctx and says so; with n_ctx given the card is not asked to fit (a budget too small stays an error there)."""
    import hybridinfer.backends.gpu.backend as gb

    seen = []

    class FittingCard:
        def __init__(self, gm, args, n_ctx, fit_n_ctx=False, **kw):
            seen.append((n_ctx, fit_n_ctx))
            self.n_ctx, self.vram_budget = (min(n_ctx, 1024) if fit_n_ctx else n_ctx), 3 << 30

    monkeypatch.setattr(gb, "GPUModel", FittingCard)
    eng = Engine.load(smollm_path, backend="gpu", n_threads=1)
    assert eng.n_ctx == 1024 and "VRAM budget of 3.0 GiB" in eng.ctx_note and seen[-1][1] is True
    eng.close()
    eng = Engine.load(smollm_path, backend="gpu", n_threads=1, n_ctx=4096)
    assert (eng.n_ctx, eng.ctx_note, seen[-1]) == (4096, "", (4096, False))
    eng.close()
    assert gpu_cut(ContextChoice(512, "x"), None) == ContextChoice(512, "x")


# ---- plan ----------------------------------------------------------------------------------------------------------

def _kv_line(out: str) -> tuple[float, str]:
    m = re.search(r"^K/V: +\S+ K, \S+ V: ([\d.]+) (\w+) a token", out, re.M)
    assert m, out
    return float(m.group(1)), m.group(2)


def test_plan_shows_kv_bytes_a_token_and_the_longest_prompt(capsys, hybrid_args):
    from hybridinfer.engine.context import size_text

    base = ["plan", "--arch", "qwen35", "--shape", "0.8b", "--card", "k80", "--host-bw", "10", "--prompts", "64",
            "--ram", "16GiB"]
    assert main(base) == 0
    f32 = capsys.readouterr().out
    per = state_bytes(hybrid_args, 1) - state_bytes(hybrid_args, 0)
    assert f"f32 K, f32 V: {size_text(per)} a token" in f32
    assert f"{size_text(state_bytes(hybrid_args, 0))} of recurrent state a sequence" in f32
    assert re.search(r"^host: .*16\.0 GiB of RAM", f32, re.M) and re.search(r"^GPU pass: .*holds a prompt of", f32,
                                                                             re.M)
    assert main([*base, "--vram-budget", "2GiB"]) == 0
    two = capsys.readouterr().out
    kept = int(re.search(r"budget holds a prompt of (\d+) tokens", two).group(1))
    streamed = int(re.search(r"^K/V stream: .* in passes of (\d+) tokens: the budget holds a context of (\d+) tokens",
                             two, re.M).group(2))
    assert kept * 5 < streamed <= hybrid_args.context_length
    assert main([*base, "-ctk", "q8_0", "-ctv", "q4_0"]) == 0
    q = capsys.readouterr().out
    assert "q8_0 K, q4_0 V:" in q and _kv_line(q) != _kv_line(f32)
    q_args = with_cache_types(hybrid_args, "q8_0", "q4_0")
    assert size_text(state_bytes(q_args, 1) - state_bytes(q_args, 0)) == " ".join(map(str, _kv_line(q)))


def test_plan_longest_prompts_follow_the_budgets(hybrid_args):
    from hybridinfer.tools.card_plan import plan_for_card

    gm = ShapeModel("qwen35", "0.8b", "q4_k_m")
    small = plan_for_card(gm, hybrid_args, "k80", vram_budget=2 << 30, prompts=(64,), ram_bytes=4 << 30).kv
    big = plan_for_card(gm, hybrid_args, "k80", vram_budget=8 << 30, prompts=(64,), ram_bytes=64 << 30).kv
    assert 0 < small.longest_pass < big.longest_pass
    # a longer context streams its K/V through the card: one layer's rows there instead of six layers'
    assert small.longest_pass * 5 < small.longest_stream <= small.trained
    assert small.card_stream_per_token * 6 == small.card_kv_per_token
    assert 0 < small.longest_host < big.longest_host
    per, rec = small.host_per_token, small.recurrent_bytes
    assert rec + small.longest_host * per <= (4 << 30) - small.model_bytes < rec + (small.longest_host + 1) * per


# ---- bench: both engines get the types -----------------------------------------------------------------------------

def test_bench_flags_name_types_for_both_engines(monkeypatch):
    from hybridinfer.cli.bench import _kv

    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    p = build_parser()
    for cmd in (["bench", "decode", "-m", "m.gguf"], ["bench", "batch", "-m", "m.gguf"]):
        assert _kv(p.parse_args(cmd)) is None  # none named: each engine its own defaults, as before
        assert _kv(p.parse_args([*cmd, "-ctv", "q8_0", "--no-cache-rotate"])) == {
            "cache_type_k": "f32", "cache_type_v": "q8_0", "cache_rotate": False}


def test_llama_cpp_gets_the_types_flash_attention_and_rotation(tmp_path):
    import stat

    from hybridinfer.tools.benchmarks import batch
    from hybridinfer.tools.benchmarks.decode import llama_kv, measure_llama

    assert llama_kv(None) == ([], None)
    assert llama_kv({"cache_type_k": "f32", "cache_type_v": "f32"})[0] == ["-ctk", "f32", "-ctv", "f32", "-fa", "0"]
    flags, env = llama_kv({"cache_type_k": "q8_0", "cache_type_v": "q4_0", "cache_rotate": False})
    assert flags == ["-ctk", "q8_0", "-ctv", "q4_0", "-fa", "1"] and env["LLAMA_ATTN_ROT_DISABLE"] == "1"
    cmd = batch.batched_bench_cmd("x", "m.gguf", 2, (1, 2), 8, 4, {"cache_type_k": "f16", "cache_type_v": "f16"})
    assert cmd[cmd.index("-fa") + 1] == "on" and cmd.count("-fa") == 1 and cmd[cmd.index("-ctk") + 1] == "f16"
    assert batch.batched_bench_cmd("x", "m.gguf", 2, (1, 2), 8, 4)[-4:-2] == ["-fa", "off"]  # as before
    fake = tmp_path / "llama-bench"  # records what it was given, answers as llama-bench -o json
    fake.write_text(f"#!/bin/sh\necho \"$@ rot=$LLAMA_ATTN_ROT_DISABLE\" > {tmp_path}/argv\n"
                    "echo '[{\"avg_ts\": 12.5}]'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    kv = {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "cache_rotate": False}
    assert measure_llama(str(fake), "m.gguf", 2, 8, 0, kv=kv) == 12.5
    got = (tmp_path / "argv").read_text()
    assert "-ctk q8_0 -ctv q8_0 -fa 1" in got and "rot=1" in got
    assert measure_llama(str(fake), "m.gguf", 2, 8, 0) == 12.5
    assert "-ctk" not in (tmp_path / "argv").read_text()
    # llama-bench takes no f32 cache type: f32 K/V send none (llama.cpp keeps its f16), never a rejected -ctk f32
    assert llama_kv({"cache_type_k": "f32", "cache_type_v": "f32"}, f32=False)[0] == ["-fa", "0"]
    assert measure_llama(str(fake), "m.gguf", 2, 8, 0, kv={"cache_type_k": "f32", "cache_type_v": "f32"}) == 12.5
    assert "-ctk" not in (tmp_path / "argv").read_text()


def test_a_pass_too_long_for_its_kv_on_the_card_streams_them(hybrid_args, smol_args):
    """plan_pass: K/V stay on the card up to what fits there (n_res); a longer context streams them, in passes of as
    many new rows, and holds about as many times more as the model has attention layers in the same reserve."""
    from hybridinfer.backends.gpu.backend import FIT_STEP, Buffers, PassPlan, pass_tokens_fitting, plan_pass
    from hybridinfer.backends.gpu.placement import plan_placement, weights_of

    for gm, a in ((ShapeModel("qwen35", "0.8b", "q4_k_m"), hybrid_args), (None, smol_args)):
        C, budget = 256, 2 << 30
        ws = weights_of(gm, a, matrices_only=True) if gm is not None else []
        res = pass_tokens_fitting(a, C, budget, ws)
        assert 1000 < res < a.context_length * 8
        assert plan_pass(a, C, budget, ws, res) == PassPlan(res, res, res)  # fits: never streams
        assert plan_pass(a, C, budget, ws, 3 * res) == PassPlan(res, res, 3 * res)
        assert plan_pass(a, C, budget, ws, 3 * res, kv_stream=True) == PassPlan(0, res, 3 * res)
        assert plan_pass(a, C, budget, ws, res // 2, kv_stream=True) == PassPlan(0, res // 2, res // 2)
        kept = res // FIT_STEP * FIT_STEP
        assert plan_pass(a, C, budget, ws, 3 * res, kv_stream=False, fit=True) == PassPlan(kept, kept, kept)
        p = plan_pass(a, C, budget, ws, 1 << 40, fit=True)
        most = pass_tokens_fitting(a, C, budget, ws, kv_stream=True, n_rows=res)
        assert (p.n_res, p.n_rows) == (res, res) and p.n_ctx % FIT_STEP == 0 and most - FIT_STEP < p.n_ctx <= most
        n_attn = sum(t == "attention" for t in a.layer_types)
        assert p.n_ctx >= (n_attn - 1) * res  # one layer's K/V on the card instead of n_attn layers'
        # the reserve is the larger layout, and each fits where pass_tokens_fitting said
        assert p.reserve(a, C) == max(Buffers.nbytes(a, C, res), Buffers.nbytes(a, C, p.n_ctx, True, res))
        if gm is not None:
            plan_placement(ws, budget, p.reserve(a, C))  # no BudgetError


def test_no_kv_offload_flag_streams_every_pass(monkeypatch, smollm_path):
    """-nkvo / --no-kv-offload (llama.cpp's name: K/V kept in host memory) reaches the GPU backend as kv_stream=True
    on every engine command; without it the backend decides (None)."""
    import hybridinfer.backends.gpu.backend as gb

    got = []

    class Card:
        def __init__(self, gm, args, n_ctx, kv_stream=None, **kw):
            got.append(kv_stream)
            self.n_ctx, self.vram_budget = n_ctx, 1 << 30

    monkeypatch.setattr(gb, "GPUModel", Card)
    p = build_parser()
    for argv in ENGINE_COMMANDS:
        assert p.parse_args(argv).no_kv_offload is False
        assert p.parse_args([*argv, "-nkvo"]).no_kv_offload is True
        assert p.parse_args([*argv, "--no-kv-offload"]).no_kv_offload is True
    from hybridinfer.cli import _engine as open_engine

    for flag, want in (([], None), (["-nkvo"], True)):
        eng = open_engine(p.parse_args(["run", "-m", smollm_path, "-p", "x", "--backend", "gpu", "-t", "1", *flag]),
                          quiet=True)
        eng.close()
        assert got[-1] is want
    with pytest.raises(ParameterError, match="kv_stream must be None, True or False, got 'yes'"):
        Engine.load(smollm_path, backend="gpu", kv_stream="yes")

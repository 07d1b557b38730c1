"""`hybridinfer bench context`: pp / tg at context depths per K/V type on a tiny hybrid model, next to a stand-in for
llama-bench that records how it was called (speeds are the benchmark's, not asserted; rows, bytes and calls are)."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys

import numpy as np
import pytest

from hybridinfer.cli import main
from hybridinfer.errors import ParameterError
from hybridinfer.tools.benchmarks import context

SHAPE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512, ssm_d_state=64,
             ssm_n_group=2, ssm_dt_rank=4)

# answers as `llama-bench -o json` does (tools/llama-bench: json_printer, one object per test, -fa values as ints),
# pp (where -p > 0) and tg at the asked depth for each -ngl and -fa value, and appends its arguments to argv.log;
# a layer on the card adds 1000 tok/s, and the -ngl values come in ascending order, so a CPU (-ngl 0) row read
# without the n_gpu_layers filter would be overwritten by the card's; FAIL_AFTER=k: prints k tests, then exits 1
# mid-list as llama-bench does when a test fails
FAKE = """\
import json, os, sys
a = sys.argv[1:]
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "argv.log"), "a") as f:
    f.write(" ".join(a) + "\\n")
o = dict(zip(a[::2], a[1::2]))
tests = []
for ngl in sorted(map(int, o.get("-ngl", "0").split(","))):
    for fa in o["-fa"].split(","):
        for p, n in ((int(o["-p"]), 0), (0, int(o["-n"]))):
            if p or n:
                tests.append({"build_commit": "fake", "model_filename": o["-m"], "n_threads": int(o["-t"]),
                              "n_gpu_layers": ngl, "type_k": o["-ctk"], "type_v": o["-ctv"], "flash_attn": int(fa),
                              "n_prompt": p, "n_gen": n, "n_depth": int(o["-d"]), "avg_ns": 1000, "stddev_ns": 0,
                              "avg_ts": 100.0 + 10 * int(fa) + n + 1000 * (ngl > 0), "stddev_ts": 0.0,
                              "samples_ns": [1000], "samples_ts": [1.0]})
stop = int(os.environ.get("FAIL_AFTER", "-1"))
body = ",\\n".join("  " + json.dumps(t) for t in (tests if stop < 0 else tests[:stop]))
if stop >= 0:
    sys.stdout.write("[\\n" + body)
    sys.stderr.write("main: error: failed to run depth\\n")
    sys.exit(1)
print("[\\n" + body + "\\n]")
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from hybridinfer.tools.synth import synth_model

    p = tmp_path_factory.mktemp("ctx") / "q35.gguf"
    synth_model(p, "qwen35", SHAPE, "q8_0", seed=1)
    return str(p)


def _fake(tmp_path) -> str:
    exe = tmp_path / "llama-bench"
    exe.write_text(f"#!{sys.executable}\n{FAKE}")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def _bench(model: str, out_dir, *extra: str) -> tuple[int, dict | None]:
    rc = main(["bench", "context", "-m", model, "-t", "2", "--depths", "256,64", "--cache-types", "f32,f16,q8_0",
               "-p", "16", "-n", "4", "-r", "1", "--probe-bytes", "16MiB", "--out-dir", str(out_dir), *extra])
    path = os.path.join(out_dir, f"context-{os.path.splitext(os.path.basename(model))[0]}-t2.json")
    if not os.path.exists(path):
        return rc, None
    with open(path) as f:
        return rc, json.load(f)


def _table(out: str) -> list[list[str]]:
    return [[c.strip() for c in r.strip("|").split("|")] for r in out.splitlines()
            if r.startswith("| ") and not r.startswith("| K/V ")]


def test_bench_context(model, tmp_path, capsys):
    exe = _fake(tmp_path)
    rc, res = _bench(model, tmp_path / "out", "--llama-bench", exe)
    out = capsys.readouterr().out
    assert rc == 0
    rows = res["rows"]
    assert [(r["type"], r["depth"]) for r in rows] == [(t, d) for t in ("f32", "f16", "q8_0") for d in (64, 256)]
    for r in rows:
        assert r["pp_tok_s"] > 0 and r["tg_tok_s"] > 0 and r["pp_gflop_s"] > 0 and not r.get("skipped")
        assert r["kv_bytes"] == r["kv_bytes_per_token"] * r["depth"]
        assert r["kv_read_per_token"] == r["kv_bytes_per_token"] * (r["depth"] + 2.5)  # steps at depth .. depth+3
        assert r["tg_bytes_per_token"] == res["weights_bytes_per_token"] + res["recurrent_bytes"] + \
            r["kv_read_per_token"]
        assert r["probe_gb_s"] > 0 and 0 < r["tg_floor_frac"]
        assert r["tg_vs_first"] == pytest.approx(r["tg_tok_s"] / next(x["tg_tok_s"] for x in rows
                                                                       if x["type"] == r["type"]))
    f32, q8 = rows[0]["kv_bytes_per_token"], rows[4]["kv_bytes_per_token"]
    assert f32 == 2 * 2 * 64 * 4  # one attention layer of four (GGGA): K and V, 2 heads of 64 floats
    assert q8 * 128 == f32 * 34  # a q8_0 block: 32 values in 34 bytes
    # llama-bench at each depth with the types, flash attention off and on, or only on for a quantized V
    calls = (tmp_path / "argv.log").read_text().splitlines()
    assert len(calls) == 4  # none for f32: llama-bench's -ctk takes no f32
    for call, (t, d, fa) in zip(calls, [("f16", 64, "0,1"), ("f16", 256, "0,1"), ("q8_0", 64, "1"),
                                        ("q8_0", 256, "1")], strict=True):
        o = dict(zip(call.split()[::2], call.split()[1::2], strict=True))
        assert (o["-d"], o["-ctk"], o["-ctv"], o["-fa"]) == (str(d), t, t, fa)
        assert (o["-m"], o["-p"], o["-n"], o["-t"], o["-r"], o["-o"]) == (model, "16", "4", "2", "1", "json")
    for r in rows[:2]:
        assert "llama" not in r and "takes no f32" in r["llama_note"]
    for r in rows[2:]:
        assert r["llama_error"] is None and all(x.pop("tg_floor_frac") > 0 for x in r["llama"].values())
    assert rows[2]["llama"] == {"0": {"pp_tok_s": 100.0, "tg_tok_s": 104.0},
                                "1": {"pp_tok_s": 110.0, "tg_tok_s": 114.0}}
    assert rows[4]["llama"] == {"1": {"pp_tok_s": 110.0, "tg_tok_s": 114.0}}
    assert rows[2]["tg_vs_llama"] == pytest.approx(rows[2]["tg_tok_s"] / 114.0)  # against the faster setting
    table = _table(out)
    assert [(t[0], t[1]) for t in table] == [(r["type"], str(r["depth"])) for r in rows]
    assert [t[2] for t in table] == ["1024", "1024", "512", "512", "272", "272"]
    assert all(t[9].endswith("%)") and "(llama.cpp " in t[9] for t in table[2:])
    assert table[0][10:12] == ["n/a", "n/a"] and "- llama-bench, f32 at 64: not run" in out
    assert table[2][10:12] == ["100.0 / 110.0", "104.0 / 114.0"] and table[4][10:12] == ["- / 110.0", "- / 114.0"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(tmp_path / "out" / "context-q35-t2.png") > 0


def test_failed_llama_bench_is_reported(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAIL_AFTER", "1")  # the pp test of the first -fa value printed, then exit 1
    rc, res = _bench(model, tmp_path / "out", "--llama-bench", _fake(tmp_path), "--depths", "64")
    out = capsys.readouterr().out
    assert rc == 0
    for r in res["rows"][1:]:
        assert r["tg_tok_s"] > 0 and r["llama_error"].startswith("exit status 1: main: error: failed to run depth")
        assert "tg_vs_llama" not in r
    f16 = res["rows"][1]
    assert f16["llama"] == {"0": {"pp_tok_s": 100.0}}  # what it printed before it stopped
    assert f16["pp_vs_llama"] == pytest.approx(f16["pp_tok_s"] / 100.0)
    assert "- llama-bench, f16 at 64: exit status 1" in out and "- llama-bench, q8_0 at 64: exit status 1" in out
    monkeypatch.setenv("FAIL_AFTER", "0")
    rc, res = _bench(model, tmp_path / "out2", "--llama-bench", _fake(tmp_path), "--depths", "64", "--cache-types",
                     "q4_0")
    assert rc == 0 and res["rows"][0]["llama"] == {} and _table(capsys.readouterr().out)[0][10:12] == ["failed"] * 2


def test_missing_llama_bench(model, tmp_path, capsys):
    rc, res = _bench(model, tmp_path / "out", "--llama-bench", str(tmp_path / "nowhere" / "llama-bench"))
    assert rc == 2 and res is None and "--llama-bench" in capsys.readouterr().err  # said before anything runs
    got, err = context.measure_llama(str(tmp_path / "gone"), model, 2, 4, 2, 64, "f32", "f32", 1)
    assert got == {} and err.startswith("could not run")


def test_bench_context_llama_bench_cuda(model, tmp_path, capsys):
    """--llama-bench-cuda: -ngl 99,0 --no-host 1 -p 0, one call per depth and -fa value, the -ngl 0 rows alone."""
    rc, res = _bench(model, tmp_path / "out", "--llama-bench-cuda", _fake(tmp_path), "--cache-types", "f32,f16,q8_0")
    out = capsys.readouterr().out
    assert rc == 0 and res["llama_bench"] is None and res["llama_bench_cuda"].endswith("llama-bench")
    calls = [c.split() for c in (tmp_path / "argv.log").read_text().splitlines()]
    want = [("f16", 64, "0"), ("f16", 64, "1"), ("f16", 256, "0"), ("f16", 256, "1"), ("q8_0", 64, "1"),
            ("q8_0", 256, "1")]
    assert len(calls) == len(want)
    for call, (t, d, fa) in zip(calls, want, strict=True):
        o = dict(zip(call[::2], call[1::2], strict=True))
        assert (o["-d"], o["-ctk"], o["-ctv"], o["-fa"]) == (str(d), t, t, fa)
        assert (o["-p"], o["-n"], o["-ngl"], o["--no-host"], o["-t"], o["-r"]) == ("0", "4", "99,0", "1", "2", "1")
    rows = res["rows"]
    assert "takes no f32" in rows[0]["llama_note"]
    for r in rows[2:]:
        assert r["llama_error"] is None and all(x.pop("tg_floor_frac") > 0 for x in r["llama"].values())
    assert rows[2]["llama"] == {"0": {"tg_tok_s": 104.0}, "1": {"tg_tok_s": 114.0}}  # not the card's 1104 / 1114
    assert rows[4]["llama"] == {"1": {"tg_tok_s": 114.0}}
    assert rows[4]["tg_vs_llama"] == pytest.approx(rows[4]["tg_tok_s"] / 114.0) and "pp_vs_llama" not in rows[4]
    assert "-ngl 99,0 --no-host 1" in out and "n_gpu_layers 0" in out
    assert main(["bench", "context", "-m", model, "--llama-bench", "x", "--llama-bench-cuda", "y"]) == 2
    assert "not both" in capsys.readouterr().err


def test_llama_bench_cuda_command_and_rows():
    cmd = context.llama_cmd("lb", "m.gguf", 16, 512, 32, 131072, "q8_0", "q8_0", 1, cuda=True, fa=1)
    assert cmd == ["lb", "-m", "m.gguf", "-p", "0", "-n", "32", "-d", "131072", "-ctk", "q8_0", "-ctv", "q8_0",
                   "-fa", "1", "-ngl", "99,0", "--no-host", "1", "-t", "16", "-r", "1", "-o", "json"]
    assert "-ngl" not in context.llama_cmd("lb", "m.gguf", 16, 512, 32, 1024, "q8_0", "q8_0", 1)
    # a made-up `-ngl 99,0 -o json` answer: the card's instance (prefilling the depth) first, then the CPU's
    card = {"n_gpu_layers": 99, "type_k": "q8_0", "type_v": "q8_0", "flash_attn": 1, "n_prompt": 0, "n_gen": 32,
            "n_depth": 32768, "avg_ts": 150.0}
    cpu = dict(card, n_gpu_layers=0, avg_ts=21.5)
    for rows in ([card, cpu], [cpu, card]):
        got = context.llama_results(context.parse_llama_json(json.dumps(rows, indent=2)), 32768, "q8_0", "q8_0",
                                    cpu_only=True)
        assert got == {"1": {"tg_tok_s": 21.5}}
    assert context.llama_results([card], 32768, "q8_0", "q8_0", cpu_only=True) == {}
    assert context.llama_results([card], 32768, "q8_0", "q8_0") == {"1": {"tg_tok_s": 150.0}}  # a CPU build's


def test_rewind_gives_the_state_at_its_mark(model):
    """pp and tg timings start from the state at the depth: rewound, decode gives what a fresh state gives there."""
    from hybridinfer.engine.api import Engine

    eng = Engine.load(model, backend="cpu", n_ctx=128, n_threads=2, cache_type_k="q8_0", cache_type_v="q8_0")
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 512, 40)]
    st = eng.new_state()
    eng.prefill(ids, st)
    mark = context.Mark(st)
    eng.prefill(ids[:9], st)
    eng.backend.forward([5], st, all_logits=False)
    mark.rewind(st)
    got = np.array(eng.backend.forward([7], st, all_logits=False)[-1])
    fresh = eng.new_state()
    eng.prefill(ids, fresh)
    want = np.array(eng.backend.forward([7], fresh, all_logits=False)[-1])
    assert st.pos == fresh.pos == 41 and np.array_equal(got, want)
    eng.close()


def test_cache_types_and_depth_plan(model):
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args
    from hybridinfer.models.state_kinds import with_cache_types

    assert context.parse_cache_types("f32, Q8_0,q8_0/q4_0,f32") == [("f32", "f32"), ("q8_0", "q8_0"),
                                                                   ("q8_0", "q4_0")]
    for bad in ("q5_0", "q8_0/q4_0/f16", ",", "f32/"):
        with pytest.raises(ParameterError):
            context.parse_cache_types(bad)
    assert not context.llama_knows("f32") and all(context.llama_knows(t) for t in ("f16", "q8_0", "q4_0"))
    assert context.fa_values("q8_0", "f16") == (0, 1) and context.fa_values("f16", "q4_0") == (1,)
    args = with_cache_types(model_args(GGUFModel(model)), "q4_0", "q4_0")
    assert context.kv_bytes(args, 1) * 128 == 1024 * 18
    trained = int(args.context_length)
    keep, skipped = context.plan_depths(args, [trained, 64, 1024, 64], 16, 4, room=None)
    assert keep == [64, 1024] and "trained context" in skipped[trained]
    keep, skipped = context.plan_depths(args, [64, 1024], 16, 4, room=context.state_bytes(args, 100))
    assert keep == [64] and "memory available" in skipped[1024]


def test_parse_llama_json_formats():
    one = {"type_k": "f16", "type_v": "f16", "flash_attn": 1, "n_prompt": 0, "n_gen": 32, "n_depth": 8192,
           "avg_ts": 21.5}
    older = dict(one, flash_attn=False, n_gen=0, n_prompt=512, avg_ts=300.0)  # older llama-bench: a bool
    text = json.dumps([one, older], indent=2)
    assert context.parse_llama_json(text) == [one, older]
    assert context.parse_llama_json("\n".join(json.dumps(x) for x in (one, older))) == [one, older]  # -o jsonl
    assert context.parse_llama_json(text[: text.rindex("{")]) == [one]  # cut short
    assert context.llama_results([one, older], 8192, "f16", "f16") == {"1": {"tg_tok_s": 21.5},
                                                                        "0": {"pp_tok_s": 300.0}}
    assert context.llama_results([one], 1024, "f16", "f16") == {}  # another depth
    assert context.llama_results([one], 8192, "q8_0", "q8_0") == {}  # other types


def test_bench_context_bad_flags(capsys):
    assert main(["bench", "context", "-m", "x.gguf", "--depths", "64,0"]) == 2
    assert "--depths" in capsys.readouterr().err
    assert main(["bench", "context", "-m", "x.gguf", "--cache-types", "q9"]) == 2
    assert "--cache-types" in capsys.readouterr().err

"""`hybridinfer bench batch`: batched decode tok/s against B on tiny models (the speeds are the benchmark's, not
asserted; the table, the JSON's fields and the weight bytes per step are), and the llama-batched-bench parser."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from hybridinfer.cli import main
from hybridinfer.tools.benchmarks import batch


def _run(path: str, out_dir: str, capsys) -> tuple[str, dict, str]:
    assert main(["bench", "batch", "-m", path, "-t", "2", "--batch-sizes", "1,2,3", "--steps", "2",
                 "--prefill-tokens", "24", "--out-dir", out_dir]) == 0
    stem = os.path.join(out_dir, f"batch-{os.path.splitext(os.path.basename(path))[0]}-t2")
    with open(stem + ".json") as f:
        return capsys.readouterr().out, json.load(f), stem


def _table(out: str) -> list[list[str]]:
    """the batched-decode table's rows (the prefill table follows it)"""
    rows = []
    for r in out.splitlines():
        if r.startswith("| engine ") or r.startswith("Through `Engine.generate_batch`"):
            break
        if r.startswith("| ") and not r.startswith("| B "):
            rows.append([c.strip() for c in r.strip("|").split("|")])
    return rows


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen35"])
def test_bench_batch(arch, oracle_gguf, tmp_path, capsys):
    path = str(oracle_gguf(arch, "q8_0"))
    out, res, stem = _run(path, str(tmp_path), capsys)
    rows = res["rows"]
    assert [r["batch"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["tok_s"] > 0 and r["per_seq_tok_s"] > 0 and r["steps"] == 2
        assert abs(r["tok_s"] - r["batch"] * r["per_seq_tok_s"]) <= 1e-9 * r["tok_s"]
    assert rows[0]["speedup"] == 1.0
    step = [r["step_bytes"] for r in rows]
    assert step[0] == res["bytes_per_token"]  # B = 1 reads what one decode token reads
    table = _table(out)
    assert [t[0] for t in table] == ["1", "2", "3"]
    assert "| B | this engine aggregate tok/s | per-seq tok/s | x vs B=1 | weight GB read per step |" in out
    assert "llama.cpp S_TG tok/s | ratio |" in out
    if arch == "qwen35moe":
        assert res["is_moe"] and (res["n_expert"], res["n_expert_used"]) == (6, 3)
        # the union of the sequences' experts: more of them, so more bytes, as B grows (seeded prompts, greedy)
        assert step[0] < step[1] < step[2]
        assert all(r["experts_source"] == "measured" for r in rows)
        assert [r["distinct_experts"] for r in rows][0] == 3.0
        assert 3.0 < rows[1]["distinct_experts"] <= 6.0 and 3.0 < rows[2]["distinct_experts"] <= 6.0
        assert rows[2]["uniform_distinct_experts"] == pytest.approx(6 * (1 - 0.5**3))
        assert batch.UNIFORM_NOTE in out
    else:
        assert not res["is_moe"] and step == [step[0]] * 3  # a dense step reads every matrix once, whatever B
        assert batch.UNIFORM_NOTE not in out
    # the same B through Engine.generate_batch: every request ran to its 2 tokens (end-of-generation masked)
    api = res["api"]
    assert [r["batch"] for r in api] == [1, 2, 3] and api[0]["speedup"] == 1.0
    for r in api:
        assert r["tokens"] == 2 * r["batch"] and r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["prefill_s"] > 0 and r["decode_tok_s"] > 0
        # None where no step had every request decoding (one admitted after the others ended)
        assert r["steady_tok_s"] is None or r["steady_tok_s"] > 0
    assert api[0]["steady_tok_s"] > 0
    assert "Through `Engine.generate_batch`" in out and "| B | wall s | tok/s | x vs B=1 | decode tok/s |" in out
    # CPU prefill: the best ISA and SSSE3 (no llama-bench given: no llama.cpp rows, no ratios)
    pre = res["prefill"]
    assert pre["tokens"] == 24 and [r["engine"] for r in pre["rows"]] == ["hybridinfer"] * 2
    assert pre["rows"][0]["build"] == res["isa"] and pre["rows"][1]["build"] == "ssse3"
    for r in pre["rows"]:
        assert r["tok_s"] == pytest.approx(24 / r["seconds"]) and r["gflop_s"] > 0 and r["vs_llama"] is None
    assert "| engine | build / ISA | tok/s | GFLOP/s of the products | x llama.cpp |" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(stem + ".png") > 0


def test_step_bytes_uniform_expectation(oracle_gguf):
    """Without the backend's routing: the expectation n_expert * (1 - (1 - k/n_expert)^B) per layer."""
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args
    from hybridinfer.tools.benchmarks.decode import bytes_per_token

    gm = GGUFModel(str(oracle_gguf("qwen35moe", "q8_0")))
    args = model_args(gm)
    assert batch.uniform_distinct(6, 3, 1) == 3.0 and batch.uniform_distinct(6, 3, 2) == 4.5
    exps = sum(t.nbytes for n, t in gm.tensors.items() if n.endswith("_exps.weight"))
    one = bytes_per_token(gm, args)
    assert batch.step_bytes(gm, args, 3.0) == pytest.approx(one)
    assert batch.step_bytes(gm, args, 6.0) == pytest.approx(one + exps / 2)  # every expert: k/E more of them
    assert batch.step_bytes(gm, args, {0: 6.0}) == pytest.approx(one + exps / 2 / args.n_layer)


# llama-batched-bench's output (tools/batched-bench/batched-bench.cpp): with `--output-format jsonl` one JSON object
# per (pp, tg, pl) on stdout; by default a markdown table after a header line. Written from its format strings.
JSONL = """\
{"n_kv_max": 2560, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 16, "n_threads_batch": 16, "pp": 128, "tg": 32, "pl": 1, "n_kv": 160, "t_pp": 0.412345, \
"speed_pp": 310.419434, "t_tg": 1.234567, "speed_tg": 25.920034, "t": 1.646912, "speed": 97.151428}
{"n_kv_max": 2560, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 16, "n_threads_batch": 16, "pp": 128, "tg": 32, "pl": 2, "n_kv": 320, "t_pp": 0.801234, \
"speed_pp": 319.507111, "t_tg": 1.600000, "speed_tg": 40.000000, "t": 2.401234, "speed": 133.264642}
{"n_kv_max": 2560, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 16, "n_threads_batch": 16, "pp": 128, "tg": 32, "pl": 16, "n_kv": 2560, "t_pp": 6.543210, \
"speed_pp": 312.995293, "t_tg": 4.000000, "speed_tg": 128.000000, "t": 10.543210, "speed": 242.811515}

llama_perf_context_print:        load time =     512.34 ms
"""

MD = """\
main: n_kv_max = 2560, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0, is_tg_separate = 0, \
n_gpu_layers = -1, n_threads = 16, n_threads_batch = 16

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     32 |    1 |    160 |    0.412 |   310.42 |    1.235 |    25.92 |    1.647 |    97.15 |
|   128 |     32 |    2 |    320 |    0.801 |   319.51 |    1.600 |    40.00 |    2.401 |   133.26 |
|   128 |     32 |   16 |   2560 |    6.543 |   313.00 |    4.000 |   128.00 |   10.543 |   242.81 |

llama_perf_context_print:        load time =     512.34 ms
"""


@pytest.mark.parametrize("text", [JSONL, MD], ids=["jsonl", "md"])
def test_parse_batched_bench(text):
    got = batch.parse_batched_bench(text)
    assert sorted(got) == [1, 2, 16]
    assert [got[b]["speed_tg"] for b in (1, 2, 16)] == pytest.approx([25.92, 40.0, 128.0], abs=0.01)
    assert got[16]["pp"] == 128 and got[16]["tg"] == 32 and got[16]["n_kv"] == 2560
    assert batch.parse_batched_bench("llama_model_load: error loading model\n") == {}


def test_batched_bench_cmd_holds_the_largest_batch():
    cmd = batch.batched_bench_cmd("llama-batched-bench", "m.gguf", 8, (1, 2, 4, 8, 16), 128, 32)
    flag = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert int(flag["-c"]) >= 16 * (128 + 32)  # a B whose sequences do not fit is skipped in silence
    want = {"-npl": "1,2,4,8,16", "-npp": "128", "-ntg": "32", "-t": "8", "-fa": "off", "-b": "2048", "-ub": "512"}
    assert {k: flag[k] for k in want} == want
    assert cmd[-2:] == ["--output-format", "jsonl"]


def test_bench_batch_bad_sizes(capsys):
    assert main(["bench", "batch", "-m", "x.gguf", "--batch-sizes", "1,0"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err


def test_all_decoding_window_counts_only_the_steps_where_every_request_decodes():
    from hybridinfer.tools.benchmarks.batch_api import all_decoding_tok_s

    # a step a second, its tokens taken 1 ms apart; request 0 decodes from step 0, request 1 from step 4 (its prompt
    # prefilled meanwhile) and to step 11: steps 5..9 are the window, 2 tokens each, 5 seconds
    a = [float(t) for t in range(10)]
    b = [t + 0.001 for t in range(4, 12)]
    assert all_decoding_tok_s([a, b]) == pytest.approx(10 / 5)
    assert all_decoding_tok_s([a]) == pytest.approx(1.0)
    assert all_decoding_tok_s([a, [20.0]]) is None and all_decoding_tok_s([a, []]) is None

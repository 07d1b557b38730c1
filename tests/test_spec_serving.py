"""Speculative decoding through the entry points: `hybridinfer run --spec-type ngram` and the server give the same
text as without drafts, and the server counts drafted and accepted tokens on /metrics. SmolLM2 told to repeat a
sentence copies its prompt, which prompt lookup drafts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.isa  # greedy answers: re-run at every ISA level (.ci/run)
ISA = os.environ.get("HYBRIDINFER_ISA")
PROMPT = ("Copy this text exactly: the quick brown fox jumps over the lazy dog and the lazy dog sleeps in the sun. "
          "Copy: the quick brown fox jumps over")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridinfer", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_cli_run_with_ngram_drafts_says_the_same():
    base = ["run", "--raw", "-p", PROMPT, "-n", "24", "--temp", "0", "--backend", "cpu"]
    plain, spec = _cli(*base), _cli(*base, "--spec-type", "ngram", "--draft-max", "4")
    assert plain.returncode == 0 and spec.returncode == 0, (plain.stderr, spec.stderr)
    assert plain.stdout.strip() and spec.stdout == plain.stdout
    llama = _cli(*base, "--spec-type", "ngram-simple", "--spec-draft-n-max", "2")  # llama.cpp's words for it
    assert llama.returncode == 0 and llama.stdout == plain.stdout, llama.stderr
    stats = _cli(*base, "--spec-type", "ngram", "--stats")
    assert re.search(r"drafts accepted [1-9]\d*/[1-9]\d*\]", stats.stderr), stats.stderr
    bad = _cli(*base, "--draft-max", "5")
    assert bad.returncode != 0 and "--draft-max" in bad.stderr


def test_server_counts_drafts_and_answers_the_same(smollm_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from hybridinfer.serving.serve import create_app

    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    texts, metrics = [], ""
    for spec in ("none", "ngram"):
        eng = Engine.load(smollm_path, backend="cpu", n_ctx=256, isa=ISA, spec_type=spec, draft_max=4)
        with TestClient(create_app(eng, close_engine=True), base_url="http://127.0.0.1") as client:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            metrics = client.get("/metrics").text
    assert texts[0] and texts[1] == texts[0]
    drafted = float(re.search(r"^hybridinfer_draft_tokens_total (\S+)$", metrics, re.M).group(1))
    accepted = float(re.search(r"^hybridinfer_draft_tokens_accepted_total (\S+)$", metrics, re.M).group(1))
    assert drafted > 0 and 0 < accepted <= drafted, (drafted, accepted)


def test_bench_spec_reports_every_row_lossless(tmp_path):
    from hybridinfer.tools.synth import synth_model

    path = str(tmp_path / "q.gguf")
    synth_model(path, "qwen35", dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                                     n_vocab=512, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4), "q8_0", seed=3)
    r = _cli("bench", "spec", "-m", path, "-t", "2", "-n", "10", "-p", "6", "--draft-max", "1,2",
             "--acceptance", "0,1", "-r", "1", "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    import json

    res = json.loads((tmp_path / "spec-q-t2.json").read_text())
    assert [(row["k"], row["acceptance"]) for row in res["rows"]] == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0),
                                                                      ("auto<=2", 0.0), ("auto<=2", 1.0)]
    assert all(row["same_tokens"] for row in res["rows"])
    full = [row for row in res["rows"] if row["acceptance"] == 1.0 and row["k"] != "auto<=2"]
    assert all(row["seen"] == 1.0 for row in full)  # every draft of the known continuation accepted
    assert all(row["seen"] == 0.0 for row in res["rows"] if row["acceptance"] == 0.0)
    assert res["costs"]["decode_s"] > 0 and res["costs"]["verify_3_s"] > 0
    assert "| verify (3 rows, rolled back) |" in r.stdout
    bad = _cli("bench", "spec", "-m", path, "--acceptance", "1.5")
    assert bad.returncode != 0 and "--acceptance" in bad.stderr


def test_bench_spec_batch_decodes_b_sequences_through_the_scheduler(tmp_path, capsys):
    """--batch 2: both sequences drafted and verified in shared steps, every row's tokens the no-draft ones; the
    step costs are a decode step of 2 rows and a verify step where one of them drafts."""
    import json

    from hybridinfer.cli import main
    from hybridinfer.tools.synth import synth_model

    path = str(tmp_path / "m.gguf")
    synth_model(path, "qwen35moe", dict(n_embd=128, n_layer=2, n_head=2, n_head_kv=1, head_dim=64, n_vocab=512,
                                        n_expert=4, n_expert_used=2, n_ff_exp=128, n_ff_shexp=128, ssm_d_state=32,
                                        ssm_n_group=1, ssm_dt_rank=2), "q8_0", seed=3)
    args = ["bench", "spec", "-m", path, "-t", "2", "-n", "8", "-p", "5", "--draft-max", "1,2", "--acceptance", "0,1",
            "-r", "1", "--batch", "2", "--out-dir", str(tmp_path), *(["--isa", ISA] if ISA else [])]
    assert main(args) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "spec-m-t2-b2.json").read_text())
    assert res["batch"] == 2 and res["n"] == 8  # end tokens masked: every run makes its n tokens
    assert [(row["k"], row["acceptance"]) for row in res["rows"]] == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0),
                                                                      ("auto<=2", 0.0), ("auto<=2", 1.0)]
    assert all(row["same_tokens"] for row in res["rows"])
    fixed = [row for row in res["rows"] if row["k"] in (1, 2)]
    assert all(row["seen"] == row["acceptance"] and row["drafted_per_token"] > 0 for row in fixed)
    assert all(row["tok_s"] > 0 and row["no_draft_tok_s"] > 0 and row["cold_speedup"] > 0 for row in res["rows"])
    # x no-draft: the best of the runs' ratios to the no-draft run beside each (one run here: the first's)
    assert all(row["speedup"] == max(row["ratios"]) == row["cold_speedup"] and len(row["ratios"]) == 1
               for row in res["rows"])
    assert "| verify (3 + 1 x 1 rows, rolled back) |" in out and "| decode (2 rows) |" in out
    assert main([*args, "--llama-server", "llama-server"]) == 2  # it runs one sequence
    assert "--batch" in capsys.readouterr().err


def test_batch_job_with_ngram_drafts_writes_the_same_answers(tmp_path):
    import json

    from batch_records import write_job

    from hybridinfer.cli import main

    job = tmp_path / "job.jsonl"
    write_job(job, [{"custom_id": f"id{i}", "prompt": PROMPT + " " * i, "max_tokens": 16, "temperature": 0}
                    for i in range(3)])
    texts = []
    for spec in ("none", "ngram"):
        out = tmp_path / f"{spec}.jsonl"
        args = ["batch", "--backend", "cpu", "--n-ctx", "256", "--prefix-cache-ram", "0", str(job), "-o", str(out),
                "--progress", "none", "--spec-type", spec, *(["--isa", ISA] if ISA else [])]
        assert main(args) == 0
        rows = [json.loads(ln) for ln in out.read_text().splitlines()]
        texts.append(sorted((r["custom_id"], r["response"]["body"]["choices"][0]["text"]) for r in rows))
    assert len(texts[0]) == 3 and all(t for _, t in texts[0]) and texts[1] == texts[0]


def test_bench_spec_llama_rows_read_llama_servers_timings():
    from hybridinfer.tools.benchmarks import spec_llama

    out = {"timings": {"predicted_per_second": 20.0, "draft_n": 40, "draft_n_accepted": 10}, "tokens": [5, 6, 7]}
    r = spec_llama.row(out, 3, [5, 6, 7])
    assert r["acceptance"] == 0.25 and r["same_tokens_as_ours"] and r["k"] == 3
    assert spec_llama.row(out, 3, [5, 6, 8])["same_tokens_as_ours"] is False
    base = spec_llama.row({"timings": {"predicted_per_second": 16.0}, "tokens": [5, 6, 7]}, None, [5, 6, 7])
    assert base["acceptance"] is None and base["k"] == "none"
    md = spec_llama.markdown({"rows": [base, r, {"k": 4, "error": "no nextn layers"}]})
    assert "| 3 | 20.00 | 1.25 | 40 | 10 | 0.25 | yes |" in md and "no nextn layers" in md
    cmd = spec_llama.server_cmd("llama-server", "m.gguf", 8080, 4, 300, 2)
    assert cmd[cmd.index("--spec-type") + 1] == "draft-mtp" and cmd[cmd.index("--spec-draft-n-max") + 1] == "2"
    assert "--spec-type" not in spec_llama.server_cmd("llama-server", "m.gguf", 8080, 4, 300, None)

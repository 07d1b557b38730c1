"""`hybridinfer bench batch-job`: the generated job (counts, ids, question lengths under a real tokenizer, the shared
system prompt), the unique-token and answer accounting, the table's arithmetic on canned rows, the NUMA statuses,
and one short real run of this engine's part on the embedded SmolLM2 (no llama-server needed)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from md_tables import md_rows

from hybridinfer.backends import numa
from hybridinfer.cli import main
from hybridinfer.tools.benchmarks import batch_job as bj
from hybridinfer.tools.benchmarks import batch_job_report as rep

pytest.importorskip("pydantic")


@pytest.fixture(scope="module")
def prompts(smollm_path):
    return bj.ModelPrompts(smollm_path)


_table = md_rows


# the job ----------------------------------------------------------------------------------------------------------
def test_make_job_with_a_tokenizer(prompts):
    lines = bj.make_job(24, 300, 16, seed=3, count=prompts.count)
    assert len(lines) == 24
    ids = [ln["custom_id"] for ln in lines]
    assert len(set(ids)) == 24
    systems, questions = set(), []
    for ln in lines:
        assert ln["method"] == "POST" and ln["url"] == "/v1/chat/completions"
        b = ln["body"]
        assert b["model"] == bj.MODEL_NAME and b["max_tokens"] == 16 and b["temperature"] == 0
        assert [m["role"] for m in b["messages"]] == ["system", "user"]
        systems.add(b["messages"][0]["content"])
        questions.append(b["messages"][1]["content"])
    assert len(systems) == 1 and abs(prompts.count(systems.pop()) - 300) <= 30
    assert len(set(questions)) == 24
    n = [prompts.count(q) for q in questions]
    assert all(30 <= k <= 100 for k in n), n
    assert max(n) - min(n) > 20  # lengths spread over the range, not all one size
    # the templated prompts share the system prompt: the trie of all of them holds it once
    ids_ = [prompts.chat_ids(ln["body"]["messages"]) for ln in lines]
    total, unique = sum(map(len, ids_)), bj.unique_prompt_tokens(ids_)
    assert unique < total - 23 * 300 and unique > total - 24 * 330
    assert bj.make_job(24, 300, 16, seed=3, count=prompts.count) == lines
    other = bj.make_job(24, 300, 16, seed=4, count=prompts.count)
    assert [ln["body"]["messages"][1]["content"] for ln in other] != questions


def test_make_job_ranges_and_errors():
    lines = bj.make_job(10, 0, 1, question_tokens=(5, 9))
    assert all(len(ln["body"]["messages"]) == 1 for ln in lines)  # no system prompt at 0 tokens
    assert all(5 <= bj.approx_tokens(ln["body"]["messages"][0]["content"]) <= 9 for ln in lines)
    for kw, name in (({"n": 0}, "requests"), ({"max_tokens": 0}, "max_tokens"),
                     ({"system_tokens": -1}, "system_tokens"), ({"question_tokens": (9, 5)}, "question tokens")):
        with pytest.raises(bj.ParameterError, match=name):
            bj.make_job(**kw)


def test_unique_prompt_tokens():
    assert bj.unique_prompt_tokens([[1, 2, 3], [1, 5], [1, 2, 4]]) == 5  # the trie 1-2-3, 2-4, 1-5
    assert bj.unique_prompt_tokens([[7, 8], [7, 8]]) == 2
    assert bj.unique_prompt_tokens([[1], [2], [3, 4]]) == 4
    assert bj.unique_prompt_tokens([]) == 0


def test_check_answers():
    ok = lambda cid: {"custom_id": cid, "response": {"status_code": 200, "body": {}}}  # noqa: E731
    recs = [ok("a"), ok("b"), ok("b"), {"custom_id": "c", "response": {"status_code": 400, "body": {}}},
            ok("zz"), {"custom_id": "e", "response": None, "error": {"message": "refused"}}]
    assert bj.check_answers(recs, ["a", "b", "c", "d", "e"]) == {
        "answered": 1, "missing": 1, "duplicates": 1, "not_ok": 2, "unknown": 1}


# rows and the table -----------------------------------------------------------------------------------------------
def _row(config, engine, answered, wall, reprocessed, generated, **kw):
    return {"config": config, "engine": engine, "numa": "off", "numa_status": "", "requests": 10,
            "answered": answered, "missing": 10 - answered, "duplicates": 0, "not_ok": 0, "unknown": 0,
            "wall_s": wall, "process_s": (wall or 0) + 2.0, "prompt_tokens": 5000 if wall else None,
            "reprocessed": reprocessed, "generated": generated, "reprocessed_usage": reprocessed, "error": None} | kw


def test_derive_and_markdown():
    rows = [_row("one at a time (max_seqs 1)", bj.OURS, 10, 20.0, 1100, 400),
            _row("scheduler (max_seqs 8)", bj.OURS, 10, 4.0, 1050, 400),
            _row("scheduler, numa bind:7", bj.OURS, 0, None, None, None, numa="bind:7",
                 numa_status="refused: numa policy bind:7: there is no node 7", error="exit 2: no node 7"),
            _row("llama-server -np 8", bj.LLAMA, 10, 16.0, 4000, 380)]
    d = rep.derive(rows, 1000)
    assert d[1]["req_s"] == pytest.approx(2.5) and d[1]["gen_tok_s"] == pytest.approx(100.0)
    assert d[1]["reprocessed_ratio"] == pytest.approx(1.05) and d[3]["reprocessed_ratio"] == pytest.approx(4.0)
    assert d[1]["x_llama"] == pytest.approx(2.5 / 0.625) and d[0]["x_llama"] == pytest.approx(0.8)
    assert d[2]["req_s"] is None and d[2]["x_llama"] is None and d[2]["reprocessed_ratio"] is None
    assert all(r["x_llama"] is None for r in rep.derive(rows[:3], 1000))  # no llama-server: no ratio
    meta = {"model": "m.gguf", "threads": 2, "backend": "cpu", "requests": 10, "system_tokens_actual": 400,
            "question_tokens": [31, 99], "max_tokens": 64, "n_ctx": 768, "numa_nodes": 1, "numa_mem_nodes": 1,
            "prompt_tokens": 5000, "unique_prompt_tokens": 1000}
    out = rep.markdown({"meta": meta, "rows": rows})
    t = _table(out, "| configuration |")
    assert [r[0] for r in t] == [r["config"] for r in rows]
    assert t[1][1:10] == ["10/10", "4.0", "6.0", "2.500", "5000", "1050", "1.05", "400", "100.0"]
    assert t[1][10] == "4.00" and t[3][10] == "1.00"
    assert t[2][1] == "0/10 (10 missing)" and t[2][2] == "-" and t[2][11].startswith("refused: ")
    assert "error" not in t[2][11]  # the refusal is said once
    assert "re-processed / unique prompt tokens 1.05 (target <= 1.1): met" in out
    assert "4.00x (target >= 2.0x): met" in out
    slow = [rows[0], dict(rows[1], wall_s=40.0, reprocessed=2000), rows[3]]
    out = rep.markdown({"meta": meta, "rows": slow})
    assert "2.00 (target <= 1.1): not met" in out and "0.40x (target >= 2.0x): not met" in out


def test_ours_row_and_llama_row(tmp_path):
    ids = ["a", "b", "c"]
    outs = []
    for j, part in enumerate((["a", "b"], ["c"])):
        p = tmp_path / f"o{j}.jsonl"
        p.write_text("".join(json.dumps({"custom_id": c, "response": {"status_code": 200, "body": {"usage": {
            "prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 60}}}}}) + "\n" for c in part))
        outs.append(str(p))
    summ = lambda w, n: {"wall_s": w, "prompt_tokens": 100 * n, "prefilled_tokens": 40 * n,  # noqa: E731
                         "generated_tokens": 8 * n}
    r = bj.ours_row("2 shards", [bj.Done(0, outs[0], summ(3.0, 2), ""), bj.Done(0, outs[1], summ(2.0, 1), "")],
                    5.5, ids)
    assert (r["answered"], r["missing"], r["wall_s"], r["process_s"]) == (3, 0, 3.0, 5.5)
    assert (r["prompt_tokens"], r["reprocessed"], r["generated"], r["reprocessed_usage"]) == (300, 120, 24, 120)
    bad = bj.ours_row("x", [bj.Done(2, str(tmp_path / "none"), None, "hybridinfer: error: --numa: no node 9\n")],
                      0.3, ids)
    assert bad["error"] == "exit 2: hybridinfer: error: --numa: no node 9" and bad["wall_s"] is None
    assert bad["missing"] == 3
    body = lambda p, n: {"usage": {"prompt_tokens": p, "completion_tokens": 5},  # noqa: E731
                         "timings": {"prompt_n": n, "cache_n": p - n}}
    recs = [{"custom_id": "a", "response": {"status_code": 200, "body": body(100, 100)}},
            {"custom_id": "b", "response": {"status_code": 200, "body": body(100, 7)}},
            {"custom_id": "c", "response": {"status_code": 500, "body": {"error": {"message": "boom"}}}}]
    r = bj.llama_row(recs, ids, 4.0, 1.5, 8)
    assert r["config"] == "llama-server -np 8" and r["process_s"] == 5.5
    assert (r["answered"], r["not_ok"], r["prompt_tokens"], r["reprocessed"], r["generated"]) == (2, 1, 200, 107, 10)
    assert "boom" in r["error"]


def test_numa_status():
    one = numa.Topology((numa.Node(0, (0, 1), 8 << 30, 6 << 30),))
    two = numa.Topology((numa.Node(0, (0,), 8 << 30, 6 << 30), numa.Node(1, (1,), 8 << 30, 6 << 30)))
    s = bj.numa_status("replicate", 1 << 30, "hybridinfer: numa: placement left to the kernel\n", one)
    assert s.startswith("falls back to off") and "applied: placement left to the kernel" in s
    assert bj.numa_status("auto", 1 << 30, "", one).startswith("chose off")
    assert bj.numa_status("bind:3", 1 << 30, "", one).startswith("refused: numa policy bind:3: there is no node 3")
    s = bj.numa_status("interleave", 1 << 30, "hybridinfer: note: --numa interleave: set_mempolicy(interleave): "
                       "Operation not permitted; the kernel's default placement is used\n", two)
    assert s.startswith("interleave;") and "refused by the kernel: --numa interleave: set_mempolicy" in s
    assert bj.numa_status("replicate", 1 << 30, "", two).startswith("falls back to interleave")


def test_bad_arguments(capsys):
    for args, name in ((["--numa-policies", "off,bind:x"], "bind:x"), (["--configs", "one,all"], "all"),
                       (["--question-tokens", "50,10"], "50,10"), (["--question-tokens", "5"], "'5'"),
                       (["-m", "/nonexistent/m.gguf"], "/nonexistent/m.gguf")):
        assert main(["bench", "batch-job", *args]) == 2
        assert name in capsys.readouterr().err


# one real run -----------------------------------------------------------------------------------------------------
def test_bench_batch_job_end_to_end(smollm_path, tmp_path, capsys):
    assert main(["bench", "batch-job", "-t", "2", "--requests", "6", "--system-tokens", "100", "--max-tokens", "4",
                 "--configs", "one,scheduler", "--numa-policies", "off,replicate", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    stem = os.path.join(str(tmp_path), f"batch-job-{os.path.splitext(os.path.basename(smollm_path))[0]}-t2")
    with open(stem + ".json") as f:
        res = json.load(f)
    m, rows = res["meta"], res["rows"]
    assert [r["config"] for r in rows] == ["one at a time (max_seqs 1)", "scheduler (max_seqs 8)",
                                           "scheduler, numa replicate"]
    assert 30 <= m["question_tokens"][0] <= m["question_tokens"][1] <= 100
    assert m["unique_prompt_tokens"] < m["prompt_tokens"] - 4 * m["system_tokens_actual"]
    for r in rows:
        assert r["error"] is None
        assert (r["answered"], r["missing"], r["duplicates"], r["not_ok"]) == (6, 0, 0, 0)
        assert r["prompt_tokens"] == m["prompt_tokens"]  # the benchmark tokenizes as the engine does
        # the shared system prompt is restored, not prefilled again: about the unique tokens are computed
        assert r["reprocessed"] == r["reprocessed_usage"]
        assert r["reprocessed"] <= 1.1 * m["unique_prompt_tokens"] < r["prompt_tokens"]
        assert 0 < r["generated"] <= 6 * 4 and r["wall_s"] > 0 and r["process_s"] > r["wall_s"]
    assert rows[2]["numa_status"].startswith("falls back to ")  # no per-node weight copies: said, not hidden
    table = _table(out, "| configuration |")
    assert [t[1] for t in table] == ["6/6"] * 3
    assert "re-processed / unique prompt tokens" in out and "llama-server" not in [t[0] for t in table]
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(stem + ".png") > 0

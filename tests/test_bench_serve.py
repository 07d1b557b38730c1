"""`hybridinfer bench serve`: a short run against a live server on the embedded SmolLM2 (the speeds are the
benchmark's, not asserted; the table, the JSON's fields and the prefix reuse of later turns are), the statistics,
and the parsing of llama-server's streamed usage and timings."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
from md_tables import md_rows

from hybridinfer.cli import main
from hybridinfer.tools.benchmarks import serve

pytest.importorskip("openai")
pytest.importorskip("fastapi")


_table = md_rows
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN35 = os.path.join(ROOT, "bench", "qwen35_chat_template.jinja")


def test_bench_serve(smollm_path, tmp_path, capsys):
    assert main(["bench", "serve", "-m", smollm_path, "-t", "2", "--max-seqs", "2", "--concurrency", "1,2",
                 "--requests", "2", "--max-tokens", "12", "--conversations", "2", "--turns", "2",
                 "--system-tokens", "200", "--out-dir", str(tmp_path), "--chat-template-file", QWEN35]) == 0
    out = capsys.readouterr().out
    stem = os.path.join(str(tmp_path), f"serve-{os.path.splitext(os.path.basename(smollm_path))[0]}-t2")
    with open(stem + ".json") as f:
        res = json.load(f)
    rows = res["rows"]
    assert [(r["engine"], r["workload"], r["concurrency"]) for r in rows] == [
        ("hybridinfer", "chat", 1), ("hybridinfer", "chat", 2), ("hybridinfer", "agent", 2)]
    table = _table(out, "| engine | workload | clients |")
    assert [t[:4] for t in table] == [["hybridinfer", "chat", "1", "2 (0)"], ["hybridinfer", "chat", "2", "4 (0)"],
                                      ["hybridinfer", "agent", "2", "4 (0)"]]
    for r in rows:
        assert r["errors"] == 0 and r["first_error"] is None
        assert r["ttft_p50_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] and r["tok_s"] > 0
        assert r["itl_p50_ms"] > 0 and r["completion_tokens"] > 0 and r["prompt_tokens"] > 0
        assert 0 < r["reprocessed"] <= r["prompt_tokens"]
    agent = rows[2]
    assert agent["conversations"] == 2 and agent["turns"] == 2 and agent["requests"] == 4
    # the prefix cache: a later turn re-processes only what its conversation added since the last turn
    assert agent["first_reprocessed"] > 0 and agent["later_reprocessed"] < agent["later_prompt_tokens"] / 2
    later = agent["per_turn"][1]
    assert later["turn"] == 1 and later["requests"] == 2 and later["reprocessed"] < later["prompt_tokens"]
    assert agent["first_turn_prompt_tokens_mean"] > 200  # system prompt and tools
    # first turns found nothing cached (one system prompt per conversation), later turns restored their history
    assert agent["cold_requests"] == 2 and agent["cached_requests"] == 2
    assert agent["cached_over_cold_ttft"] == pytest.approx(agent["cached_ttft_p50_ms"] / agent["cold_ttft_p50_ms"])
    assert res["meta"]["chat_template_file"] == QWEN35
    assert len(_table(out, "| engine | first-turn prompt tok |")) == 1
    assert "llama-server" not in [r["engine"] for r in rows] and "vs llama-server" not in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(stem + ".png") > 0


def test_both_servers_render_the_template_file():
    ours = serve.ours_cmd("m.gguf", 8080, 2, 4, 1024, "cpu", "/t/q.jinja")
    assert ours[ours.index("--chat-template-file") + 1] == "/t/q.jinja"
    theirs = serve.llama_cmd("llama-server", "m.gguf", 8080, 2, 4, 1024, "/t/q.jinja")
    assert "--jinja" in theirs and theirs[theirs.index("--chat-template-file") + 1] == "/t/q.jinja"
    assert "--chat-template-file" not in serve.ours_cmd("m.gguf", 8080, 2, 4, 1024, "cpu")
    ours = serve.ours_cmd("m.gguf", 8080, 2, 4, 1024, "cpu", None, 4 << 30)
    assert ours[ours.index("--prefix-cache-ram") + 1] == str(4 << 30)
    assert "--jinja" not in serve.llama_cmd("llama-server", "m.gguf", 8080, 2, 4, 1024)


def test_bench_serve_bad_template_file(capsys):
    assert main(["bench", "serve", "-m", "x.gguf", "--chat-template-file", "/nonexistent/t.jinja"]) == 2
    assert "--chat-template-file" in capsys.readouterr().err


def test_bench_serve_bad_concurrency(capsys):
    assert main(["bench", "serve", "-m", "x.gguf", "--concurrency", "1,0"]) == 2
    assert "--concurrency" in capsys.readouterr().err


def test_percentile_and_summarize():
    assert serve.percentile([], 50) is None
    assert serve.percentile([3.0], 99) == 3.0
    assert serve.percentile([1, 2, 3, 4], 50) == 2.5
    assert serve.percentile(list(range(101)), 99) == pytest.approx(99.0)
    s = [serve.Sample(ttft=0.1, itl=[0.01, 0.03], completion=3, prompt=10, reprocessed=4),
         serve.Sample(ttft=0.3, itl=[0.02], completion=2, prompt=12, reprocessed=12),
         serve.Sample(error="APIConnectionError: refused")]
    r = serve.summarize(s, 2.0)
    assert (r["requests"], r["errors"], r["first_error"]) == (3, 1, "APIConnectionError: refused")
    assert r["ttft_p50_ms"] == pytest.approx(200.0) and r["itl_p50_ms"] == pytest.approx(20.0)
    assert r["tok_s"] == pytest.approx(2.5) and (r["prompt_tokens"], r["reprocessed"]) == (22, 16)
    s[1].reprocessed = None  # a server that did not say: no total rather than a wrong one
    assert serve.summarize(s, 2.0)["reprocessed"] is None


# llama-server's last two chunks of a streamed chat with stream_options.include_usage (written from
# tools/server/server-task.cpp: the usage chunk has empty choices, `timings` rides on the last chunk)
LLAMA_CHUNKS = [
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
     "created": 1, "id": "chatcmpl-x", "model": "m", "system_fingerprint": "b1-0c1e570",
     "object": "chat.completion.chunk"},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Hello"}}], "created": 1,
     "id": "chatcmpl-x", "model": "m", "object": "chat.completion.chunk"},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "abc", "type": "function", "function": {"name": "read_file", "arguments": "{\"pa"}}]}}],
     "created": 1, "id": "chatcmpl-x", "model": "m", "object": "chat.completion.chunk"},
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": "th\": \"a.py\"}"}}]}}],
     "created": 1, "id": "chatcmpl-x", "model": "m", "object": "chat.completion.chunk"},
    {"choices": [{"finish_reason": "tool_calls", "index": 0, "delta": {}}], "created": 1, "id": "chatcmpl-x",
     "model": "m", "object": "chat.completion.chunk"},
    {"choices": [], "created": 1, "id": "chatcmpl-x", "model": "m", "object": "chat.completion.chunk",
     "usage": {"completion_tokens": 9, "prompt_tokens": 2113, "total_tokens": 2122,
               "prompt_tokens_details": {"cached_tokens": 2040}},
     "timings": {"cache_n": 2040, "prompt_n": 73, "prompt_ms": 101.5, "prompt_per_token_ms": 1.39,
                 "prompt_per_second": 719.2, "predicted_n": 9, "predicted_ms": 80.1,
                 "predicted_per_token_ms": 8.9, "predicted_per_second": 112.4}},
]


class _FakeClient:
    def __init__(self, chunks):
        from openai.types.chat import ChatCompletionChunk

        self.chunks = [ChatCompletionChunk.model_validate(c) for c in chunks]
        self.chat = self
        self.completions = self
        self.kw = None

    def create(self, **kw):
        self.kw = kw
        return iter(self.chunks)


def test_llama_server_usage_and_timings():
    assert serve.reprocessed_tokens(LLAMA_CHUNKS[-1]["usage"], LLAMA_CHUNKS[-1]["timings"]) == 73
    assert serve.reprocessed_tokens(LLAMA_CHUNKS[-1]["usage"], None) == 2113 - 2040
    ours = {"prompt_tokens": 500, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 480}}
    assert serve.reprocessed_tokens(ours, None) == 20
    assert serve.reprocessed_tokens({"prompt_tokens": 50, "prompt_tokens_details": None}, {}) == 50
    assert serve.reprocessed_tokens(None, None) is None
    cl = _FakeClient(LLAMA_CHUNKS)
    s, msg = serve.stream_chat(cl, "m", [{"role": "user", "content": "hi"}], 16, tools=serve.TOOLS)
    assert cl.kw["stream"] and cl.kw["stream_options"] == {"include_usage": True}
    assert cl.kw["extra_body"]["cache_prompt"] is True and cl.kw["tools"] == serve.TOOLS
    assert (s.prompt, s.completion, s.reprocessed) == (2113, 9, 73)
    assert s.ttft is not None and len(s.itl) == 2  # three deltas with content or a call: the role chunk is not one
    assert msg == {"role": "assistant", "content": "Hello", "tool_calls": [
        {"id": "abc", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a.py\"}"}}]}
    # a call cut short by max_tokens (its arguments not yet JSON) stays out of the history
    _, msg = serve.stream_chat(_FakeClient(LLAMA_CHUNKS[:3]), "m", [], 16)
    assert "tool_calls" not in msg


def test_system_prompt_and_commands():
    a, b = serve.system_prompt(2000, "ws-1"), serve.system_prompt(2000, "ws-2")
    assert a == serve.system_prompt(2000, "ws-1") and a != b and a.startswith("Workspace: ws-1\n")
    assert 1500 < len(a.split()) * 1.2 < 2600  # ~2,000 tokens of common words
    cmd = serve.llama_cmd("llama-server", "m.gguf", 1234, 8, 16, 4096)
    flag = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert {k: flag[k] for k in ("-m", "--host", "--port", "-t", "-np", "-c", "-fa")} == {
        "-m": "m.gguf", "--host": "127.0.0.1", "--port": "1234", "-t": "8", "-np": "16", "-c": str(16 * 4096),
        "-fa": "off"}
    ours = serve.ours_cmd("m.gguf", 1234, 8, 16, 4096, "cpu")
    assert ours[:4] == [sys.executable, "-m", "hybridinfer", "serve"] and "127.0.0.1" in ours


def test_server_that_exits_is_reported():
    with pytest.raises(RuntimeError, match="exited with status 3"):
        serve.Server("x", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], serve.free_port(), 30)

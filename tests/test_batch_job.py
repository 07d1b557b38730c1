"""`hybridinfer batch` with SmolLM2: each output body equals the server's answer to the same request (bodies made
by the same protocol code; compared minus ids and timestamps), bad lines become error lines and the job goes on,
shared prefixes are prefilled once, shards write disjoint outputs covering the input, --ordered and the summary."""

from __future__ import annotations

import io
import json
import os

import pytest

pytest.importorskip("pydantic")

from batch_records import write_job  # noqa: E402
from test_chat_template import QWEN35_TEMPLATE, TOOLS  # noqa: E402

from hybridinfer.cli import main  # noqa: E402
from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.engine.textstream import Generation  # noqa: E402
from hybridinfer.format.chat_text import render_for  # noqa: E402
from hybridinfer.serving.batch import run_job  # noqa: E402
from hybridinfer.serving.batch.order import shared_prefix_tokens  # noqa: E402

pytestmark = pytest.mark.isa  # sampled and greedy answers: re-run at every ISA level (.ci/run)
# the CPU unit HYBRIDINFER_ISA forces (library calls take it as an argument; only the CLI reads the variable)
ISA = os.environ.get("HYBRIDINFER_ISA")

MODEL = "SmolLM2-135M-Instruct.Q4_1"
Q = [{"role": "user", "content": "What is 2+2?"}]
CHAT, COMPL, MSGS = "/v1/chat/completions", "/v1/completions", "/v1/messages"


@pytest.fixture(scope="module")
def engine(smollm_path):
    # no prefix cache: cached_tokens in the usage then does not depend on which of the two ran a request first
    eng = Engine.load(smollm_path, backend="cpu", isa=ISA, n_ctx=512, max_seqs=4)
    yield eng
    eng.close()



def read_out(path) -> list[dict]:
    with open(path, "rb") as f:
        return [json.loads(x) for x in f]


def _norm(x):
    """Ids and timestamps differ between any two answers: the rest must not."""
    if isinstance(x, dict):
        return {k: ("<id>" if k == "id" else 0 if k == "created" else _norm(v)) for k, v in x.items()}
    if isinstance(x, list):
        return [_norm(v) for v in x]
    return x


def _compare_with_server(eng, tmp_path, requests, model_name=MODEL):
    """Run `requests` (url, body) as a batch job and through the server's app; every answer equal."""
    from fastapi.testclient import TestClient

    from hybridinfer.serving.serve import create_app

    job = tmp_path / "job.jsonl"
    write_job(job, [{"custom_id": f"r{i}", "method": "POST", "url": u, "body": b} for i, (u, b) in enumerate(requests)])
    summary = run_job(eng, str(job), str(tmp_path / "out.jsonl"), model_name=model_name)
    assert not summary["interrupted"] and summary["written"] == len(requests)
    got = {r["custom_id"]: r for r in read_out(tmp_path / "out.jsonl")}
    with TestClient(create_app(eng, model_name=model_name), base_url="http://127.0.0.1") as client:
        for i, (url, body) in enumerate(requests):
            rec = got[f"r{i}"]
            want = client.post(url, json=body)
            assert rec["error"] is None and rec["response"]["status_code"] == want.status_code, (body, rec)
            assert _norm(rec["response"]["body"]) == _norm(want.json()), body
    return got


def test_bodies_equal_the_servers(engine, tmp_path):
    g = {"temperature": 0}
    reqs = [
        (CHAT, {"model": MODEL, "messages": Q, "max_tokens": 12, **g}),
        (CHAT, {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}] + Q, "max_tokens": 16,
                "stop": ["4"], **g}),
        (CHAT, {"model": MODEL, "messages": [{"role": "developer", "content": [{"type": "text", "text": "Hi"}]},
                                             {"role": "user", "content": "Say hi."}], "max_completion_tokens": 6,
                "temperature": 0.7, "seed": 3}),
        (COMPL, {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, **g}),
        (COMPL, {"model": MODEL, "prompt": [504, 3458, 282, 4649, 314], "max_tokens": 8, **g}),
        (MSGS, {"model": MODEL, "max_tokens": 12, "system": "You are terse.", "messages": Q, **g}),
        (MSGS, {"model": MODEL, "max_tokens": 20, "messages": Q, "stop_sequences": ["."], **g}),
        (CHAT, {"model": "gpt-4o", "messages": Q, "max_tokens": 4, **g}),  # any name: the served one answers
        # the server's refusals: the same status and error body
        (CHAT, {"model": MODEL, "messages": Q, "n": 2}),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        (CHAT, {"model": MODEL, "messages": Q, "max_tokens": "12"}),
        (CHAT, {"model": MODEL, "messages": Q, "frequency_penalty": 3.5}),
        (COMPL, {"model": MODEL, "prompt": "x " * 300, "max_tokens": 400}),
        (MSGS, {"model": MODEL, "messages": Q}),
        (CHAT, {"model": MODEL, "messages": Q, "top_logprobs": 2}),
        (CHAT, {"model": MODEL, "messages": Q, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, **g}),
    ]
    try:
        import llguidance  # noqa: F401

        reqs.append((CHAT, {"model": MODEL, "messages": Q, "max_tokens": 12, "response_format": {"type": "json_object"},
                            **g}))
    except ImportError:
        pass
    got = _compare_with_server(engine, tmp_path, reqs)
    assert got["r0"]["response"]["body"]["choices"][0]["message"]["content"]
    assert got["r7"]["response"]["body"]["model"] == MODEL  # asked for gpt-4o
    assert got["r12"]["response"]["body"]["error"]["code"] == \
        "context_length_exceeded"
    assert got["r13"]["response"]["body"]["type"] == "error"  # the Anthropic error shape on /v1/messages


# tool calls and reasoning: a canned Qwen3.5 engine (SmolLM2 writes neither reliably), for the batch and the server
class _Handle:
    def __init__(self, req, text, eng):
        self.request, self.text = req, text
        self.generation = Generation(text, eng.tokenize(text, add_bos=False), len(req.ids), "stop",
                                     {"reused_tokens": 0})

    def __iter__(self):
        for i in range(0, len(self.text), 3):  # small pieces: tags arrive split
            yield self.text[i : i + 3]

    def done(self):
        return True

    def cancel(self):
        pass

    def result(self, timeout=None):
        return self.generation


class _Canned:
    """SmolLM2 with Qwen3.5's template; its scheduler answers a prompt by the first key of `answers` it holds."""

    def __init__(self, eng, answers):
        self._eng, self.answers = eng, answers
        self.scheduler, self.state_budget, self.running, self.waiting = self, None, 0, 0

    def __getattr__(self, name):
        return getattr(self._eng, name)

    def chat_text(self, messages, add_generation_prompt=True, enable_thinking=None, tools=None):
        return render_for(self._eng.tokenizer, QWEN35_TEMPLATE, messages, tools,
                          add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)

    def chat_prompt(self, messages, add_generation_prompt=True, enable_thinking=None, tools=None):
        return self.chat_text(messages, add_generation_prompt, enable_thinking, tools).text

    def request_bytes(self, req):
        return 0

    def submit(self, req):
        prompt = self._eng.detokenize(req.ids)
        return _Handle(req, next(v for k, v in self.answers.items() if k in prompt), self._eng)

    def submit_many(self, reqs):
        return [self.submit(r) for r in reqs]


def test_tool_calls_and_reasoning_equal_the_servers(engine, tmp_path):
    call = ("I will look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n</function>\n</tool_call>")
    canned = _Canned(engine, {"Paris": call, "Rome": "Warm.\n</think>\n\nSunny, 21 C.", "": "Hi!"})
    atool = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    w = lambda city: [{"role": "user", "content": f"Weather in {city}?"}]  # noqa: E731
    reqs = [
        (CHAT, {"model": "m", "messages": w("Paris"), "tools": TOOLS}),
        (CHAT, {"model": "m", "messages": w("Paris"), "tools": TOOLS, "parallel_tool_calls": False}),
        (CHAT, {"model": "m", "messages": w("Rome"), "tools": TOOLS, "tool_choice": "none"}),
        (CHAT, {"model": "m", "messages": w("Oslo"), "chat_template_kwargs": {"enable_thinking": False}}),
        (MSGS, {"model": "m", "max_tokens": 32, "messages": w("Paris"), "tools": atool}),
        (MSGS, {"model": "m", "max_tokens": 32, "messages": w("Rome"), "thinking": {"type": "enabled",
                                                                                    "budget_tokens": 16}}),
        (CHAT, {"model": "m", "messages": w("Paris"), "tools": TOOLS, "tool_choice": {"type": "function",
                                                                                     "function": {"name": "nope"}}}),
    ]
    got = _compare_with_server(canned, tmp_path, reqs, model_name="m")
    msg = got["r0"]["response"]["body"]["choices"][0]["message"]
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert msg["reasoning_content"].strip() == "I will look it up."
    assert got["r4"]["response"]["body"]["stop_reason"] == "tool_use"
    assert got["r6"]["response"]["status_code"] == 400


def test_bad_lines_and_the_job_goes_on(engine, tmp_path):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    good = {"max_tokens": 4, "temperature": 0}
    write_job(job, [
        {"custom_id": "a", "messages": Q, **good},
        "this is not json",
        "",  # blank lines are no requests and get no answer
        {"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "x"}},
        {"custom_id": "a", "prompt": "again", **good},
        {"custom_id": "c", "method": "POST", "url": CHAT, "body": {"model": MODEL, "messages": "hi"}},
        {"custom_id": "d", "prompt": "one two " * 400, **good},
        {"prompt": "no id"},
        {"custom_id": "e", "method": "POST", "url": CHAT},
        {"custom_id": "f", "prompt": "The sky is", **good},
        {"custom_id": "b", "prompt": "a good line, but b was taken by the refused line 4", **good},
    ])
    err = io.StringIO()
    s = run_job(engine, str(job), str(out), progress="json", progress_stream=err)
    recs = {r["id"]: r for r in read_out(out)}
    assert sorted(recs) == sorted(f"batch_req_{n}" for n in (1, 2, 4, 5, 6, 7, 8, 9, 10, 11))
    assert recs["batch_req_1"]["response"]["status_code"] == 200 and recs["batch_req_10"]["error"] is None
    assert recs["batch_req_2"]["error"]["code"] == "invalid_json"
    assert recs["batch_req_4"]["error"]["code"] == "invalid_url" and recs["batch_req_4"]["custom_id"] == "b"
    assert "used by line 1" in recs["batch_req_5"]["error"]["message"]
    assert recs["batch_req_6"]["response"]["body"]["error"]["param"] == "messages"
    assert recs["batch_req_7"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert recs["batch_req_8"]["error"]["code"] == "missing_custom_id"
    assert "body is missing" in recs["batch_req_9"]["response"]["body"]["error"]["message"]
    assert "used by line 4" in recs["batch_req_11"]["error"]["message"]
    assert s["by_status"] == {"200": 2, "400": 3, "error": 5} and s["total"] == 10 and not s["interrupted"]
    lines = [json.loads(x) for x in err.getvalue().splitlines()]
    assert lines[-1]["event"] == "summary" and lines[-1]["done"] == 10
    # run again: everything is done, nothing is written twice (and the bar shows it)
    bar = io.StringIO()
    s = run_job(engine, str(job), str(out), progress="bar", progress_stream=bar)
    assert "10/10" in bar.getvalue()
    assert s["written"] == 0 and s["done_before"] == 10 and len(read_out(out)) == 10


def test_shared_prefix_is_prefilled_once(smollm_path, tmp_path):
    eng = Engine.load(smollm_path, backend="cpu", isa=ISA, n_ctx=1024, max_seqs=4,
                      prefix_cache={"ram_bytes": 256 << 20})
    system = "You answer questions about arithmetic for a school. Be brief and exact. " * 8
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    # interleaved with prompts that share nothing, so only the order brings the system prompt's requests together
    lines = []
    for i in range(12):
        lines.append({"custom_id": f"s{i}", "messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": f"What is {i} + {2 * i}?"}],
                      "max_tokens": 2, "temperature": 0})
        lines.append({"custom_id": f"o{i}", "prompt": f"{i} bottles of {'milk' if i % 2 else 'water'}",
                      "max_tokens": 2, "temperature": 0})
    write_job(job, lines)
    s = run_job(eng, str(job), str(out), window=64, max_inflight=8)
    eng.scheduler.close()
    recs = read_out(out)
    sys_prompt = [r["response"]["body"]["usage"] for r in recs if r["custom_id"].startswith("s")]
    n_sys = len(eng.tokenize(eng.chat_prompt([{"role": "system", "content": system}], add_generation_prompt=False)))
    # every request but the first restored the system prompt
    assert sum(u["prompt_tokens_details"]["cached_tokens"] >= n_sys - 8 for u in sys_prompt) >= 11
    # the prompts' trie: tokens that are in no earlier prompt; the job prefilled little more than those
    ids = sorted(eng.make_request(ln.get("messages") or ln["prompt"], max_tokens=2).ids for ln in lines)
    unique = sum(len(x) for x in ids) - shared_prefix_tokens(ids)
    assert unique < s["prompt_tokens"] / 3 and s["prefilled_tokens"] <= 1.1 * unique, (s, unique)


def test_cli_shards_partition_and_ordered(tmp_path, capsys):
    job = tmp_path / "job.jsonl"
    write_job(job, [{"custom_id": f"id{i}", "prompt": f"Count: {i},", "max_tokens": 2, "temperature": 0}
                    for i in range(10)] + ["oops"])
    common = ["batch", "--backend", "cpu", "--n-ctx", "256", "--prefix-cache-ram", "0", str(job)]
    seen = []
    for i in range(3):
        out = tmp_path / f"part{i}.jsonl"
        assert main(common + ["-o", str(out), "--shard", f"{i}/3", "--ordered", "--progress", "none"]) == 0
        ids = [r["id"] for r in read_out(out)]
        assert ids == sorted(ids, key=lambda x: int(x.split("_")[-1]))  # --ordered: input order
        seen += ids
    assert sorted(seen) == sorted(f"batch_req_{n}" for n in range(1, 12))  # each line in exactly one shard
    assert "written this run" in capsys.readouterr().err
    assert main(common + ["-o", str(tmp_path / "x.jsonl"), "--shard", "3/3"]) == 2
    assert main(common + ["-o", str(job)]) == 2  # the input is not an output
    assert main(["batch", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "y.jsonl")]) == 2

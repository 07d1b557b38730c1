"""The server under bad input and load, live on 127.0.0.1 with SmolLM2: every bad request gets its 4xx (never a
500) and the server then answers a good one; the API key; the queue bound (429 with Retry-After); a client that
disconnects frees its sequence; a bounded load test; /metrics parses."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from test_serve_api import MODEL, an_client, oa_client, running  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402

Q = [{"role": "user", "content": "What is 2+2?"}]
COUNT = "1, 2, 3, 4, 5,"  # greedy SmolLM2 counts on to any length: a request that runs until stopped
CHAT, MSGS, COMP = "/v1/chat/completions", "/v1/messages", "/v1/completions"


def _wait(cond, timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=1024, max_seqs=4, prefix_cache={"ram_bytes": 64 << 20})
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def app(engine):
    # strict: a name other than the served one is a 404 (the default answers any name: test_model_names.py)
    return create_app(engine, model_name=MODEL, strict_model_name=True, max_queue=8, max_body_bytes=64 << 10)


@pytest.fixture(scope="module")
def base(app):
    with running(app) as url:
        yield url


@pytest.fixture
def client(base):
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c


def _good(client) -> None:
    r = client.post(CHAT, json={"model": MODEL, "messages": Q, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


LONG = "word " * 1500  # well past n_ctx=1024 tokens
BAD = [
    # (path, body (bytes: sent as is), status, what the message or param names)
    (CHAT, b"{\"model\": ", 400, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, "JSON object"),
    (CHAT, b"", 400, "empty"),
    (CHAT, {"messages": Q}, 400, "model"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": Q, "max_tokens": "10"}, 400, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user"}], "max_tokens": 2}, 200, ""),  # no content: empty text
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0].image_url"),  # an image part without its url
    (CHAT, {"model": "gpt-4o", "messages": Q}, 404, "model"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400, "n_ctx=1024"),
    (CHAT, {"model": MODEL, "messages": Q, "max_tokens": 1000}, 400, "max_tokens 1000"),
    (CHAT, {"model": MODEL, "messages": Q, "temperature": -1}, 400, "temperature"),
    (CHAT, {"model": MODEL, "messages": Q, "top_p": 0}, 400, "top_p"),
    (CHAT, {"model": MODEL, "messages": Q, "frequency_penalty": 3.5}, 400, "frequency_penalty"),
    (CHAT, {"model": MODEL, "messages": Q, "n": 17}, 400, "n"),  # past MAX_N choices
    (COMP, {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),  # one choice per completion
    (CHAT, {"model": MODEL, "messages": Q, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": Q, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": Q, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    (CHAT, {"model": MODEL, "messages": Q, "stop": [""]}, 400, "stop"),
    (CHAT, {"model": MODEL, "messages": Q, "logit_bias": {"42": 100}}, 400, "logit_bias"),
    (CHAT, {"model": MODEL, "messages": Q, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"model": MODEL, "messages": Q, "chat_template_kwargs": {"enable_thinking": "no"}}, 400,
     "enable_thinking"),
    (CHAT, {"model": MODEL, "messages": Q, "seed": 1.5}, 400, "seed"),
    (COMP, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": [1, 10 ** 9]}, 400, "token id"),
    (COMP, {"model": MODEL, "prompt": LONG}, 400, "n_ctx=1024"),
    (COMP, {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
    (MSGS, {"model": MODEL, "messages": Q}, 400, "max_tokens"),
    (MSGS, {"model": "claude-x", "messages": Q, "max_tokens": 4}, 404, "model"),
    (MSGS, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            "max_tokens": 4}, 400, "messages[0].content[0].source"),  # an image block without its source
    (MSGS, {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 4}, 400, "n_ctx=1024"),
    (MSGS, {"model": MODEL, "messages": Q, "max_tokens": 4, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    (MSGS + "/count_tokens", {"model": MODEL}, 400, "messages"),
    (MSGS, {"model": MODEL, "messages": Q, "max_tokens": 4, "output_config": {"format": {"type": "json_schema",
                                                                                         "schema": {"type": 7}}}},
     400, "response_format"),
    (CHAT, b"{\"model\": \"" + b"x" * (65 << 10) + b"\"}", 413, "limit"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_request_then_good(client, i):
    path, body, status, names = BAD[i]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        if path.startswith(MSGS):
            assert r.json()["type"] == "error" and err["type"] in ("invalid_request_error", "not_found_error")
        else:
            assert set(err) == {"message", "type", "param", "code"}
        assert names in err["message"] or names == err.get("param"), err
    _good(client)


def test_bad_methods_and_routes(client):
    assert client.get(CHAT).status_code == 405
    assert client.post("/v1/nothing", json={}).status_code == 404
    # a body over the limit sent without Content-Length (chunked) is refused as it arrives
    r = client.post(CHAT, content=iter([b"{" + b" " * (40 << 10)] * 2), headers={"content-type": "application/json"})
    assert r.status_code == 413
    _good(client)


def test_api_key(engine):
    with running(create_app(engine, api_key="s3cret", model_name=MODEL)) as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").status_code == 200  # open: a load balancer's probe has no key
            body = {"model": MODEL, "messages": Q, "max_tokens": 2}
            assert c.post(CHAT, json=body).status_code == 401
            r = c.post(CHAT, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert c.post(MSGS, json=body, headers={"x-api-key": "nope"}).json()["type"] == "error"
            assert c.get("/metrics").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            oa_client(url, key="wrong").models.list()
        oa = oa_client(url, key="s3cret", timeout=30)
        assert oa.chat.completions.create(model=MODEL, messages=Q, max_tokens=2).choices[0].message.content
        an = an_client(url, key="s3cret", timeout=30)  # sends x-api-key
        assert an.messages.create(model=MODEL, messages=Q, max_tokens=2).content[0].text


def _record_handles(monkeypatch, engine) -> list:
    handles, submit = [], engine.scheduler.submit

    def recording(req):
        h = submit(req)
        handles.append(h)
        return h

    monkeypatch.setattr(engine.scheduler, "submit", recording)
    return handles


def test_disconnect_frees_the_sequence(engine, base, monkeypatch):
    handles = _record_handles(monkeypatch, engine)
    with httpx.Client(base_url=base, timeout=60) as c:
        # a stream left after a few chunks
        body = {"model": MODEL, "prompt": COUNT, "max_tokens": 900, "temperature": 0, "stream": True}
        with c.stream("POST", COMP, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for _, line in zip(range(12), lines, strict=False)]
            assert any(line.startswith("data: {") for line in got)
            assert engine.scheduler.running == 1
        _wait(lambda: handles[-1].done(), what="the stream's sequence to end")
        assert handles[-1].generation.finish_reason == "cancelled" and len(handles[-1].generation.tokens) < 900
        # a non-streaming request whose client gives up
        with pytest.raises(httpx.ReadTimeout):
            c.post(COMP, json={**body, "stream": False}, timeout=1.5)
        _wait(lambda: len(handles) == 2 and handles[-1].done(), what="the abandoned request's sequence to end")
        assert handles[-1].generation.finish_reason == "cancelled"
        _wait(lambda: engine.scheduler.running == 0 and engine.scheduler.waiting == 0, what="an idle scheduler")
        _good(c)


def test_queue_bound_429(engine):
    """max_seqs=4 running + max_queue=1 waiting: the sixth request at once is refused with Retry-After."""
    app = create_app(engine, model_name=MODEL, max_queue=1)
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        body = {"model": MODEL, "prompt": COUNT, "max_tokens": 900, "temperature": 0, "stream": True}
        streams = []
        try:
            for _ in range(5):
                cm = c.stream("POST", COMP, json=body)
                r = cm.__enter__()
                streams.append(cm)
                assert r.status_code == 200
            r = c.post(CHAT, json={"model": MODEL, "messages": Q, "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            r = c.post(MSGS, json={"model": MODEL, "messages": Q, "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        finally:
            for cm in streams:
                cm.__exit__(None, None, None)
        _wait(lambda: app.state.service.held == 0, what="the cancelled streams to release their slots")
        _good(c)


async def _load(base: str, clients: int, seed: int, budget_s: float) -> list[int]:
    rng = random.Random(seed)
    statuses: list[int] = []
    deadline = time.monotonic() + budget_s

    async def one(c: httpx.AsyncClient, k: int) -> None:
        for j in range(rng.randint(2, 8)):
            if time.monotonic() > deadline:
                return
            q = [{"role": "user", "content": f"Say a word about the number {k * 10 + j}."}]
            if (k + j) % 3 == 0:
                async with c.stream("POST", CHAT, json={"model": MODEL, "messages": q, "max_tokens": 6,
                                                        "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass
            elif (k + j) % 3 == 1:
                r = await c.post(MSGS, json={"model": MODEL, "messages": q, "max_tokens": 6})
            else:
                r = await c.post(COMP, json={"model": MODEL, "prompt": q[0]["content"], "max_tokens": 6})
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert r.headers.get("retry-after")
                await asyncio.sleep(0.2)

    async with httpx.AsyncClient(base_url=base, timeout=60,
                                 limits=httpx.Limits(max_connections=clients + 4)) as c:
        await asyncio.wait_for(asyncio.gather(*(one(c, k) for k in range(clients))), budget_s + 30)
    return statuses


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_load_then_metrics(engine, app, base):
    """32 clients x 2-8 requests each, three rounds: every answer a 200 or a 429, none 5xx; memory flat across
    rounds; the scheduler idle after; /metrics parses and counts what happened."""
    from prometheus_client.parser import text_string_to_metric_families

    rss, t0 = [], time.monotonic()
    for rnd in range(3):
        statuses = asyncio.run(_load(base, 32, rnd, budget_s=20))
        assert statuses and set(statuses) <= {200, 429}, sorted(set(statuses))
        assert statuses.count(200) >= 8
        _wait(lambda: app.state.service.held == 0 and engine.scheduler.running == 0, what="an idle server")
        rss.append(_rss())
    assert time.monotonic() - t0 < 90
    assert rss[2] - rss[1] < 48 << 20, [r >> 20 for r in rss]  # MiB; the first round warms caches up
    text = httpx.get(base + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    req = {(s.labels.get("route"), s.labels.get("status")): s.value for s in fams["hybridinfer_requests"].samples
           if s.name == "hybridinfer_requests_total"}
    assert req.get((CHAT, "200"), 0) > 0 and req.get((MSGS, "200"), 0) > 0
    for name in ("hybridinfer_prompt_tokens", "hybridinfer_completion_tokens"):
        assert next(s.value for s in fams[name].samples if s.name.endswith("_total")) > 0
    ttft = fams["hybridinfer_time_to_first_token_seconds"]
    assert next(s.value for s in ttft.samples if s.name.endswith("_count")) > 0
    for name in ("hybridinfer_queue_depth", "hybridinfer_running_sequences", "hybridinfer_inter_token_latency_seconds",
                 "hybridinfer_prompt_tokens_reused"):
        assert name in fams

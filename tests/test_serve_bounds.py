"""Issue 29, item 2 on the server: every number and size is bounded where it enters, with a 400 (or 413) naming
it before anything is rendered, and the CPU work of a request (parsing, rendering, tokenizing) happens under the
queue's bound, a few threads at a time, count_tokens included. Live on 127.0.0.1 with SmolLM2."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_serve_api import MODEL, running  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.protocol.models import MAX_MESSAGES  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402

Q = [{"role": "user", "content": "What is 2+2?"}]
CHAT, MSGS, COMP, COUNT = "/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/messages/count_tokens"
BIG = 1 << 63  # one past int64's largest


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=1024, max_seqs=4)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base(engine):
    with running(create_app(engine, model_name=MODEL, max_body_bytes=1 << 20)) as url:
        yield url


@pytest.fixture
def client(base):
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c


@pytest.fixture
def renders(engine, monkeypatch):
    """Count the engine's chat renders (each one a request's prompt or its history)."""
    calls = []
    render = engine.chat_text

    def counted(*a, **kw):
        calls.append(1)
        return render(*a, **kw)

    monkeypatch.setattr(engine, "chat_text", counted)
    return calls


def _good(client) -> None:
    r = client.post(CHAT, json={"model": MODEL, "messages": Q, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def _post_raw(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"content-type": "application/json"})


OUT_OF_RANGE = [
    (CHAT, {"top_k": BIG}, "top_k"),
    (CHAT, {"seed": BIG}, "seed"),
    (CHAT, {"seed": -BIG - 1}, "seed"),
    (CHAT, {"max_tokens": BIG}, "max_tokens"),
    (CHAT, {"max_completion_tokens": 1 << 64}, "max_completion_tokens"),
    (CHAT, {"n": BIG}, "n"),
    (CHAT, {"logprobs": True, "top_logprobs": BIG}, "top_logprobs"),
    (CHAT, {"stop": ["x"] * 17}, "stop"),
    (COMP, {"logprobs": BIG}, "logprobs"),
    (COMP, {"best_of": BIG}, "best_of"),
    (COMP, {"prompt": [1, BIG]}, "prompt[1]"),
    (MSGS, {"top_k": BIG}, "top_k"),
    (MSGS, {"max_tokens": BIG}, "max_tokens"),
    (MSGS, {"thinking": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens"),
    (MSGS, {"stop_sequences": ["x"] * 17}, "stop_sequences"),
]


def test_out_of_range_numbers_are_400_naming_the_field(client, renders):
    for path, extra, name in OUT_OF_RANGE:
        body = {"model": MODEL, "max_tokens": 4, **({"prompt": "Hi"} if path == COMP else {"messages": Q}), **extra}
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, extra, r.text)
        err = r.json()["error"]
        assert name in err["message"], err
        if path != MSGS:
            assert err["param"] == name
    assert not renders  # refused before any rendering
    _good(client)


def test_non_finite_numbers_are_400(client, renders):
    for number in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        raw = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "temperature": %s}' % (
            MODEL.encode(), number)
        r = _post_raw(client, CHAT, raw)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "temperature" in msg or number.decode() in msg, msg
    assert not renders
    _good(client)


def test_oversize_body_is_413_at_once(client, renders):
    """Over max_body_bytes (1 MiB here): refused by its Content-Length before it is read, or as it arrives."""
    raw = b'{"model": "' + b"x" * (2 << 20) + b'"}'
    t0 = time.monotonic()
    r = _post_raw(client, CHAT, raw)
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["error"]["message"]
    r = client.post(CHAT, content=iter([raw[: 1 << 19]] * 4), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5 and not renders
    _good(client)


def test_too_many_messages_is_400_before_rendering(client, renders):
    many = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}] * (MAX_MESSAGES // 2 + 1)
    for path in (CHAT, MSGS, COUNT):
        t0 = time.monotonic()
        r = client.post(path, json={"model": MODEL, "messages": many, "max_tokens": 4})
        assert r.status_code == 400 and f"at most {MAX_MESSAGES} items" in r.text and "messages" in r.text
        assert time.monotonic() - t0 < 10
    assert not renders
    _good(client)


def test_text_that_cannot_fit_is_400_before_rendering(engine, client, renders):
    """No token holds more than the vocabulary's longest token's bytes: text past n_ctx times that is refused
    without rendering or tokenizing it."""
    cap = engine.n_ctx * engine.tokenizer.max_token_bytes
    long = "a" * (cap + 1)
    for path, body in [(CHAT, {"messages": [{"role": "user", "content": long}]}),
                       (COUNT, {"messages": [{"role": "user", "content": long}]}),
                       (COMP, {"prompt": long})]:
        r = client.post(path, json={"model": MODEL, "max_tokens": 4, **body})
        assert r.status_code == 400 and f"{cap + 1} characters cannot fit" in r.text, r.text
    assert not renders
    _good(client)


def test_renders_run_a_few_at_a_time_within_the_queue(engine, monkeypatch):
    """Rendering and tokenizing (chat and count_tokens alike) run in render_threads threads, never more at once,
    and each request holds its queue slot meanwhile: with every slot held by a render, count_tokens is a 429."""
    app = create_app(engine, model_name=MODEL, max_queue=2, render_threads=2)  # 4 running + 2 queued
    render, lock, state = engine.chat_text, threading.Lock(), {"now": 0, "peak": 0}
    gate = threading.Event()

    def slow(*a, **kw):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        gate.wait(20)
        try:
            return render(*a, **kw)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(engine, "chat_text", slow)

    async def load(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            chat = {"model": MODEL, "messages": Q, "max_tokens": 1}
            jobs = [asyncio.create_task(c.post(CHAT if k % 2 else COUNT, json=chat)) for k in range(6)]
            deadline = time.monotonic() + 20
            while app.state.service.held < 6:  # every slot taken, two renders waiting at the gate
                assert time.monotonic() < deadline, "the requests did not all arrive"
                await asyncio.sleep(0.02)
            full = await c.post(COUNT, json={"model": MODEL, "messages": Q})
            gate.set()
            return [full.status_code] + [(await j).status_code for j in jobs]

    with running(app) as url:
        statuses = asyncio.run(load(url))
        assert statuses[0] == 429 and statuses[1:] == [200] * 6, statuses
        assert state["peak"] == 2  # in parallel, but no more than render_threads
        assert app.state.service.held == 0
        monkeypatch.setattr(engine, "chat_text", render)
        with httpx.Client(base_url=url, timeout=60) as c:
            _good(c)


def test_the_issues_hostile_body_is_refused(engine):
    """The issue's body: 470k one-word messages in 15 MiB, under the default 16 MiB limit. Once 11.7 s of
    rendering and 585 MB; now a 400 naming the messages once parsed, to count_tokens as to chat."""
    raw = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}] * 470_000})
    with running(create_app(engine, model_name=MODEL)) as url, httpx.Client(base_url=url, timeout=60) as c:
        for path in (COUNT, CHAT):
            t0 = time.monotonic()
            r = _post_raw(c, path, raw.encode())
            assert r.status_code == 400 and f"at most {MAX_MESSAGES} items" in r.text, r.text
            assert time.monotonic() - t0 < 30
        _good(c)

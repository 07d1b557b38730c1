"""llama-server's utility routes (/tokenize, /detokenize, /apply-template, /props), `n` choices from one prefill,
usage in stream chunks only on request, and CORS, live on 127.0.0.1 with SmolLM2 through httpx and the official
openai client."""

from __future__ import annotations

import os
import re
import uuid

import numpy as np
import pytest

pytestmark = pytest.mark.isa

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve_api import MODEL, oa_client, running  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=1024, max_seqs=4, prefix_cache={"ram_bytes": 64 << 20},
                      isa=os.environ.get("HYBRIDINFER_ISA"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def url(engine):
    with running(create_app(engine, model_name=MODEL, report_cached_tokens=True)) as u:
        yield u


@pytest.fixture
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture
def oa(url):
    return oa_client(url, timeout=120)


def test_tokenize_detokenize_round_trip(http, engine):
    text = "Hello, wörld! 日本語 <|im_start|> 🦙"
    ids = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == engine.tokenize(text, add_bos=False) and ids
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == text
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert "".join(p["piece"] for p in pieces if isinstance(p["piece"], str)).startswith("Hello")
    # as text, the control token's characters are several tokens; parsed, one
    as_text = http.post("/tokenize", json={"content": "<|im_start|>", "parse_special": False}).json()["tokens"]
    parsed = http.post("/tokenize", json={"content": "<|im_start|>"}).json()["tokens"]
    assert len(parsed) == 1 and len(as_text) > 1
    r = http.post("/detokenize", json={"tokens": [1, 10 ** 9]})
    assert r.status_code == 400 and "tokens[1]" in r.json()["error"]["message"]
    r = http.post("/tokenize", json={"content": 5})
    assert r.status_code == 400 and "content" in r.json()["error"]["message"]


def test_apply_template_and_props(http, engine):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    prompt = http.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    assert prompt == engine.chat_prompt(msgs)
    assert prompt.endswith("<|im_start|>assistant\n") and "What is 2+2?" in prompt
    r = http.post("/apply-template", json={"messages": msgs, "model": "nope"})  # any name: the one model answers
    assert r.status_code == 200 and r.json()["prompt"] == prompt
    props = http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == engine.n_ctx == 1024
    assert props["total_slots"] == 4 and props["model_alias"] == MODEL
    assert props["default_generation_settings"]["params"]["temperature"] == engine.make_request("x").params.temperature
    assert "im_start" in props["chat_template"] and props["modalities"] == {"vision": False, "audio": False}


def _metric(http, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", http.get("/metrics").text, re.M)
    return float(m.group(1))


def test_n_choices_from_one_prefill(http, oa):
    """Three choices of one request: three answers, each a sequence of its own, and the prompt prefilled once
    (the two others restore it from the prefix cache)."""
    msgs = [{"role": "user", "content": f"Name a colour. ({uuid.uuid4().hex})"}]  # a prompt no one sent before
    p0, r0 = _metric(http, "hybridinfer_prompt_tokens_total"), _metric(http, "hybridinfer_prompt_tokens_reused_total")
    r = oa.chat.completions.create(model=MODEL, messages=msgs, n=3, max_tokens=8, temperature=0.8, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and c.message.content for c in r.choices)
    n_prompt = r.usage.prompt_tokens
    assert r.usage.completion_tokens <= 3 * 8 and r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    prompt = _metric(http, "hybridinfer_prompt_tokens_total") - p0
    reused = _metric(http, "hybridinfer_prompt_tokens_reused_total") - r0
    assert prompt == 3 * n_prompt
    assert prompt - reused <= n_prompt and reused >= 2 * n_prompt, (prompt, reused)  # one prefill
    # streamed: every choice's chunks, each choice ending once
    chunks = list(oa.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=4, temperature=0.8,
                                             stream=True))
    ends = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert ends == [0, 1]


def test_usage_in_stream_only_on_request(oa):
    msgs = [{"role": "user", "content": "Hi"}]
    plain = list(oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain) and all("usage" not in c.model_dump(exclude_unset=True) for c in plain)
    asked = list(oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in asked[:-1]) and asked[-1].choices == []
    assert asked[-1].usage.completion_tokens >= 1 and asked[-1].usage.prompt_tokens > 0


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,authorization"}


def test_cors_default_keyless_loopback(http):
    """A keyless loopback server lets loopback pages call it (a chat UI on another port) and no other page."""
    page = "http://localhost:5173"
    r = http.options("/v1/chat/completions", headers={"Origin": page, **PREFLIGHT})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "content-type" in r.headers["access-control-allow-headers"].lower()
    r = http.get("/v1/models", headers={"Origin": page})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    r = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_cors_origins_named(engine):
    with running(create_app(engine, model_name=MODEL, api_key="k", cors_origins=["https://ui.example"])) as u:
        with httpx.Client(base_url=u, timeout=60) as c:
            r = c.options("/v1/chat/completions", headers={"Origin": "https://ui.example", **PREFLIGHT})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
            r = c.options("/v1/chat/completions", headers={"Origin": "https://other.example", **PREFLIGHT})
            assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
            r = c.get("/v1/models", headers={"Origin": "https://ui.example", "Authorization": "Bearer k"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    with running(create_app(engine, model_name=MODEL, cors_origins=["https://ui.example"])) as u:
        with httpx.Client(base_url=u, timeout=60) as c:  # keyless on loopback: a page named is let past the guard
            r = c.options("/v1/models", headers={"Origin": "https://ui.example", **PREFLIGHT})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
            assert c.get("/v1/models", headers={"Origin": "https://ui.example"}).status_code == 200
            assert c.get("/v1/models", headers={"Origin": "https://evil.example"}).status_code == 403
    with running(create_app(engine, model_name=MODEL, api_key="k")) as u:  # with a key: any page, as llama-server
        with httpx.Client(base_url=u, timeout=60) as c:
            r = c.options("/v1/messages", headers={"Origin": "https://any.example", **PREFLIGHT})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_embeddings(oa, http, engine):
    texts = ["The cat sat on the mat.", "A dog slept on the rug."]
    r = oa.embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
    vecs = np.array([d.embedding for d in r.data])
    assert vecs.shape == (2, engine.args.n_embd)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    np.testing.assert_array_equal(vecs[0], engine.embed(texts[0]))  # mean-pooled by default
    again = oa.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    assert again.data[0].embedding == vecs[0].tolist()  # deterministic, and floats as base64 give the same
    assert r.usage.prompt_tokens == sum(len(engine.tokenize(t)) for t in texts)
    ids = engine.tokenize(texts[1])
    by_ids = http.post("/v1/embeddings", json={"model": MODEL, "input": ids}).json()
    assert by_ids["data"][0]["embedding"] == vecs[1].tolist()
    for body, where in (({"input": "x", "dimensions": 3}, "dimensions"), ({"input": [[1] * 2000]}, "input[0]"),
                        ({"input": []}, "input"), ({"input": [10 ** 9]}, "input[0]")):
        r = http.post("/v1/embeddings", json={"model": MODEL, **body})
        assert r.status_code == 400 and where in r.json()["error"]["message"], (body, r.text)

"""Issue 29, item 7: the prefix cache does not talk. With API keys each key is a tenant of its own in the cache (a
prompt restores only snapshots made under its key, and usage reports those); without keys every client shares
the cache, so cached_tokens (and the reuse metric) say 0 unless report_cached_tokens. Live with SmolLM2."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_serve_api import MODEL, running  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402
from hybridinfer.serving.serve.app import _tenant  # noqa: E402

CHAT, MSGS = "/v1/chat/completions", "/v1/messages"
SYSTEM = ("You are the assistant of a small bakery in Lyon. Answer questions about opening hours, bread, pastries "
          "and prices in one short sentence, politely, and never invent products the bakery does not sell.")


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=1024, max_seqs=2, prefix_cache={"ram_bytes": 64 << 20})
    yield eng
    eng.close()


def _msgs(system: str, q: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": q}]


def _cached(c, key: str | None, system: str, q: str) -> int:
    headers = {"Authorization": b"Bearer " + key.encode()} if key else {}  # UTF-8 bytes, as clients send it
    r = c.post(CHAT, headers=headers, json={"model": MODEL, "messages": _msgs(system, q), "max_tokens": 1,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_key_has_its_own_cache(engine):
    system = "Tenants. " + SYSTEM
    with running(create_app(engine, api_key=["key-one", "clé-deux"], model_name=MODEL)) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        assert _cached(c, "key-one", system, "When do you open?") == 0
        assert _cached(c, "key-one", system, "Do you sell baguettes?") > 0  # its own system prompt, restored
        # another key, the first key's very prompt: nothing of the first key's is restored, or reported
        assert _cached(c, "clé-deux", system, "When do you open?") == 0
        assert _cached(c, "clé-deux", system, "Do you sell baguettes?") > 0
        r = c.post(MSGS, headers={"x-api-key": "key-one"}, json={
            "model": MODEL, "system": system, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["cache_read_input_tokens"] > 0
    # the snapshots are separate: each key finds its own, a keyless lookup neither
    ids = engine.encode_prompt(_msgs(system, "When do you open?"))
    one = engine.prefix_cache.lookup(ids, salt=_tenant(b"key-one"))
    two = engine.prefix_cache.lookup(ids, salt=_tenant("clé-deux".encode()))
    assert one is not None and two is not None and one.key != two.key and one.pos == two.pos
    assert engine.prefix_cache.lookup(ids) is None
    assert engine.prefix_cache.lookup(ids, salt=_tenant(b"key-three")) is None


def test_keyless_server_reports_no_cached_tokens(engine):
    system = "Keyless. " + SYSTEM
    with running(create_app(engine, model_name=MODEL)) as url, httpx.Client(base_url=url, timeout=60) as c:
        hits = engine.prefix_cache.stats["hits"]
        assert _cached(c, None, system, "When do you open?") == 0
        assert _cached(c, None, system, "When do you open?") == 0  # restored, but not said
        assert engine.prefix_cache.stats["hits"] > hits  # the cache still works for everyone
        r = c.post(MSGS, json={"model": MODEL, "system": system, "max_tokens": 1,
                               "messages": [{"role": "user", "content": "When do you open?"}]})
        usage = r.json()["usage"]
        assert usage["cache_read_input_tokens"] == 0 and usage["input_tokens"] == len(
            engine.encode_prompt(_msgs(system, "When do you open?")))
        metrics = c.get("/metrics").text
        assert "hybridinfer_prompt_tokens_reused_total 0.0" in metrics
    with running(create_app(engine, model_name=MODEL, report_cached_tokens=True)) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        assert _cached(c, None, system, "When do you open?") > 0


def test_serve_flags_keys_and_cache_reporting(monkeypatch, capsys):
    import hybridinfer.serving.serve as serve_pkg
    from hybridinfer.cli import main

    seen = {}
    monkeypatch.setattr(serve_pkg, "create_app", lambda engine, **kw: seen.update(kw))
    monkeypatch.setattr(serve_pkg, "serve", lambda *a, **kw: None)
    monkeypatch.delenv("HYBRIDINFER_API_KEY", raising=False)
    args = ["serve", "--backend", "cpu", "--n-ctx", "64", "--prefix-cache-ram", "0"]
    assert main(args) == 0 and seen["api_key"] is None and seen["report_cached_tokens"] is False
    assert main(args + ["--api-key", "a,b", "--report-cached-tokens"]) == 0
    assert seen["api_key"] == ["a", "b"] and seen["report_cached_tokens"] is True

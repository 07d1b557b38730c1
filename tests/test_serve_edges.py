"""Issue 29, item 9 on the server: a lone surrogate and absurdly nested tool-call arguments are 400s (not 500s) and
the tool-call parser reads nesting without recursion; API keys are compared as UTF-8 bytes and blank ones refused
at start; a keyless loopback server checks Host and Origin (DNS rebinding). Live with SmolLM2."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_serve_api import MODEL, running  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.errors import ParameterError  # noqa: E402
from hybridinfer.serving.protocol.toolcalls import (  # noqa: E402
    MAX_JSON_DEPTH,
    OutputParser,
    ToolCall,
    json_depth,
    parse_tool_call,
)
from hybridinfer.serving.serve import create_app  # noqa: E402
from hybridinfer.serving.serve.app import check_api_keys  # noqa: E402

Q = [{"role": "user", "content": "What is 2+2?"}]
CHAT, MSGS, COMP, COUNT = "/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/messages/count_tokens"


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=512, max_seqs=2)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base(engine):
    with running(create_app(engine, model_name=MODEL)) as url:
        yield url


@pytest.fixture
def client(base):
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c


def _good(client, **kw) -> None:
    r = client.post(CHAT, json={"model": MODEL, "messages": Q, "max_tokens": 2, "temperature": 0}, **kw)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def _raw(client, path: str, text: str, **kw):
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"}, **kw)


def test_lone_surrogate_is_400_naming_the_field(client):
    bad = [
        (CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages[0].content"),
        (CHAT, '{"model": "%s", "messages": [{"role": "user", "content": "x"}], "stop": ["\\uDFFF"]}', "stop"),
        (COMP, '{"model": "%s", "prompt": "\\udc00"}', "prompt"),
        (MSGS, '{"model": "%s", "max_tokens": 4, "system": "a\\ud83d", "messages": [{"role": "user", '
               '"content": "x"}]}', "system"),
        (COUNT, '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         "messages[0].content[0].text"),
    ]
    for path, body, field in bad:
        r = _raw(client, path, body.replace("%s", MODEL))
        assert r.status_code == 400, (path, r.text)
        assert field in r.text and "surrogate" in r.text, r.text
    # a proper pair (an emoji) is text like any other
    r = _raw(client, CHAT, f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "user", "content": '
                           f'"\\ud83d\\ude00"}}]}}')
    assert r.status_code == 200
    _good(client)


def test_deep_tool_call_arguments_are_400(client):
    """Assistant tool calls in the history whose arguments nest past any template's reach: OpenAI's string form
    and Anthropic's input object, a 400 naming the field (once a RecursionError and a 500)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 1400}}
    msgs = [Q[0], {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "1",
                                                                             "tool_call_id": "c1"}]
    r = client.post(CHAT, json={"model": MODEL, "messages": msgs, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    assert f"deeper than {MAX_JSON_DEPTH}" in r.text
    deep = '{"a": ' * 900 + "1" + "}" * 900
    use = '{"type": "tool_use", "id": "t", "name": "f", "input": ' + deep + "}"
    body = ('{"model": "' + MODEL + '", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, '
            '{"role": "assistant", "content": [' + use + ']}, {"role": "user", "content": [{"type": "tool_result", '
            '"tool_use_id": "t", "content": "ok"}]}]}')
    for path in (MSGS, COUNT):
        r = _raw(client, path, body)
        assert r.status_code == 400 and f"deeper than {MAX_JSON_DEPTH}" in r.text, r.text
        assert "messages[1].content[0].input" in r.text
    r = _raw(client, CHAT, '{"model": "' + MODEL + '", "messages": ' + "[" * 5000 + "]" * 5000 + "}")
    assert r.status_code == 400
    _good(client)


def test_tool_call_parser_bounds_nesting():
    """Model output that nests without end is text, read in time proportional to its length, never a
    RecursionError."""
    assert json_depth('{"a": [1, {"b": "[[[["}]}') == 3 and json_depth("[" * 10**6) == MAX_JSON_DEPTH + 1
    deep = '{"name": "f", "arguments": ' + "[" * 200_000 + "]" * 200_000 + "}"
    t0 = time.monotonic()
    assert parse_tool_call(deep) is None
    assert parse_tool_call('{"name": "f", "arguments": "' + json.dumps("[" * 5000)[1:-1] + '"}') is None
    assert parse_tool_call("<function=f>\n<parameter=p>\n" + "[" * 5000 + "\n</parameter>\n</function>")[0] \
        .input() == {"p": "[" * 5000}
    assert ToolCall("f", "[" * 100_000).input() == {}
    p = OutputParser(tools=True)
    events = p.feed("<tool_call>\n" + deep + "\n</tool_call>") + p.finish()
    assert [k for k, _ in events] == ["text"] and events[0][1].startswith("<tool_call>")
    assert time.monotonic() - t0 < 10
    ok = parse_tool_call('{"name": "f", "arguments": ' + "[" * 40 + "]" * 40 + "}")
    assert ok is None  # arguments must be an object; nesting itself within the bound parses
    ok = parse_tool_call('{"name": "f", "arguments": {"a": ' + "[" * 40 + "]" * 40 + "}}")
    assert ok is not None and ok[0].input() == {"a": json.loads("[" * 40 + "]" * 40)}


def test_api_keys_are_utf8_bytes_and_blank_keys_are_refused(engine):
    with running(create_app(engine, api_key="clé-🔑", model_name=MODEL)) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        _good(c, headers={"Authorization": "Bearer clé-🔑".encode()})
        _good(c, headers={"x-api-key": "clé-🔑".encode()})
        for wrong in ("Bearer clé-🔑".encode("latin-1", "replace"), "Bearer clé-🔑".encode()[:-1], b"Bearer cl\xe9-"):
            r = c.post(CHAT, headers={"Authorization": wrong}, json={"model": MODEL, "messages": Q})
            assert r.status_code == 401
    for blank in ("", " ", "\t\n", ["ok", ""], ["ok", "  "]):
        with pytest.raises(ParameterError, match="non-blank"):
            check_api_keys(blank)
        with pytest.raises(ParameterError):
            create_app(engine, api_key=blank)
    for bad in (" padded", "padded ", "a\x00b"):
        with pytest.raises(ParameterError):
            check_api_keys(bad)
    assert check_api_keys(["a", "é"]) == ("a", "é") and check_api_keys(None) == ()


def test_serve_refuses_a_blank_key_at_start(monkeypatch, capsys):
    import hybridinfer.serving.serve as serve_pkg
    from hybridinfer.cli import main

    monkeypatch.setattr(serve_pkg, "serve", lambda *a, **kw: pytest.fail("a blank key must stop the start"))
    monkeypatch.delenv("HYBRIDINFER_API_KEY", raising=False)
    for args in (["--api-key", " "], ["--api-key", ""], ["--api-key", "good,"]):
        assert main(["serve", "--backend", "cpu", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridinfer: error: ") and "API key" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("HYBRIDINFER_API_KEY", "  ")
    assert main(["serve", "--backend", "cpu"]) == 2 and "API key" in capsys.readouterr().err


def test_host_and_origin_checked_for_a_keyless_loopback_server(engine, client, base):
    port = base.rsplit(":", 1)[1]
    body = {"model": MODEL, "messages": Q, "max_tokens": 1}
    for headers in ({"Host": "evil.example"}, {"Host": f"evil.example:{port}"}, {"Host": "127.0.0.1.nip.io"},
                    {"Origin": "http://evil.example"}, {"Origin": "null"},
                    {"Host": f"localhost:{port}", "Origin": f"http://evil.example:{port}"}):
        r = client.post(CHAT, json=body, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host", (headers, r.text)
        r = client.post(MSGS, content=json.dumps(body), headers={**headers, "content-type": "text/plain"})
        assert r.status_code == 403 and r.json()["type"] == "error"
    for headers in ({"Host": f"localhost:{port}"}, {"Host": "LOCALHOST"}, {"Host": f"[::1]:{port}"},
                    {"Origin": f"http://localhost:{port}"}, {"Origin": "http://127.0.0.1:3000"},
                    {"Origin": "http://[::1]"}):
        _good(client, headers=headers)
    # off when asked (a server on a public address), and for a server with keys (a page cannot know the key)
    with running(create_app(engine, model_name=MODEL, allowed_hosts=None)) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        _good(c, headers={"Host": "evil.example"})
    with running(create_app(engine, model_name=MODEL, api_key="k")) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        _good(c, headers={"Host": "my-server.lan", "Authorization": "Bearer k"})


def test_serve_host_check_flags(monkeypatch):
    import hybridinfer.serving.serve as serve_pkg
    from hybridinfer.cli import main

    seen = {}
    monkeypatch.setattr(serve_pkg, "create_app", lambda engine, **kw: seen.update(kw))
    monkeypatch.setattr(serve_pkg, "serve", lambda *a, **kw: None)
    monkeypatch.delenv("HYBRIDINFER_API_KEY", raising=False)
    args = ["serve", "--backend", "cpu", "--n-ctx", "64", "--prefix-cache-ram", "0"]
    assert main(args) == 0 and "127.0.0.1" in seen["allowed_hosts"]
    assert main(args + ["--no-host-check"]) == 0 and seen["allowed_hosts"] is None
    assert main(args + ["--host", "0.0.0.0"]) == 0 and seen["allowed_hosts"] is None

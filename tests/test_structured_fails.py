"""Structured output fails loudly (issue 29, item 8): a response_format schema that llguidance compiles but cannot
follow is refused when the request is made (a 400 naming response_format), and one that fails while the answer is
generated ends its sequence with an error (a stream's error event), never a 200 "stop" with no JSON or half of it.
Through the library (JsonConstraint, Engine.generate, the scheduler) and the server on 127.0.0.1 with SmolLM2."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_serve_api import MODEL, running  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.errors import ParameterError  # noqa: E402
from hybridinfer.serving.protocol.errors import ApiError  # noqa: E402
from hybridinfer.serving.protocol.grammar import JsonConstraint  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402

Q = [{"role": "user", "content": "Give me a person."}]


def _objects(n: int) -> dict:
    """An anyOf of n one-key objects: past 2,000 llguidance's parser gives up (its max_items_in_row limit)."""
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
                       "additionalProperties": False} for i in range(n)]}


SELF_REF = {"$ref": "#"}  # no finite JSON value: llguidance fails at its first token
# refused at the request: each fails at the first step or the one after
UNSATISFIABLE = [("self_ref", SELF_REF), ("anyOf_3000", _objects(3000))]
# the limit is reached only once the model has written `{"a":` (with whitespace of its choosing on the way): with
# llguidance's limit lowered to 40 items for the library's tests (a small grammar, quick to compile), and as it is
# (2,000) for the server's
LOW = {"max_items_in_row": 40}


def _fails_later(n: int) -> dict:
    return {"type": "object", "properties": {"a": _objects(n)}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=512, max_seqs=4)
    yield eng
    eng.close()


@pytest.mark.parametrize("name,schema", UNSATISFIABLE)
def test_an_unsatisfiable_schema_is_refused_at_the_request(engine, name, schema):
    with pytest.raises(ApiError) as e:
        JsonConstraint(engine, schema)
    assert e.value.status == 400 and e.value.param == "response_format"
    assert "cannot be satisfied" in e.value.message and "llguidance" in e.value.message


def test_a_grammar_in_its_error_state_fails_the_sequence(engine):
    """A matcher that has entered llguidance's error state (here: fed a token it refuses) makes mask() and accept()
    raise a ParameterError naming response_format, where mask() used to allow only the end of the sequence."""
    c = JsonConstraint(engine, {"type": "object"})
    assert c.allowed().sum() > 0
    bad = engine.tokenize("x", add_bos=False)[0]
    with pytest.raises(ParameterError, match="response_format"):
        c.accept(bad)
    with pytest.raises(ParameterError, match="response_format: the schema cannot be followed after 0 generated"):
        c.mask(np.zeros(engine.args.n_vocab, np.float32))


def test_a_schema_that_fails_while_generating_fails_its_sequence_alone(engine):
    """Greedy (any path the mask allows reaches the limit: its only complete values pass through the anyOf), through
    Engine.generate and through the scheduler beside a good request."""
    with pytest.raises(ApiError, match="cannot be satisfied"):  # the same limit at the first step: refused
        JsonConstraint(engine, _objects(50), limits=LOW)
    with pytest.raises(ParameterError, match="response_format: the schema cannot be followed after"):
        engine.generate(Q, max_tokens=64, temperature=0,
                        constraint=JsonConstraint(engine, _fails_later(50), limits=LOW))
    good_want = engine.generate(Q, max_tokens=8, temperature=0)
    bad = engine.submit(Q, max_tokens=64, temperature=0, constraint=JsonConstraint(engine, _fails_later(50),
                                                                                    limits=LOW))
    good = engine.submit(Q, max_tokens=8, temperature=0)
    with pytest.raises(ParameterError, match="response_format"):
        bad.result(timeout=120)
    assert good.result(timeout=120).tokens == good_want.tokens
    assert engine.scheduler._reserved == 0


def _rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.fixture(scope="module")
def base(engine):
    with running(create_app(engine, model_name=MODEL)) as url:
        yield url


def test_server_refuses_unsatisfiable_schemas_and_streams_the_late_failure(base):
    chat = "/v1/chat/completions"
    with httpx.Client(base_url=base, timeout=120) as c:
        for name, schema in UNSATISFIABLE:
            r = c.post(chat, json={"model": MODEL, "messages": Q, "max_tokens": 16, "response_format": _rf(schema)})
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert err["param"] == "response_format" and "cannot be satisfied" in err["message"], name
        # the late failure, streamed: the status (200) is out before it, so it comes as an error event; no "stop"
        body = {"model": MODEL, "messages": Q, "max_tokens": 64, "temperature": 0, "stream": True,
                "response_format": _rf(_fails_later(2050))}
        with c.stream("POST", chat, json=body) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert "response_format: the schema cannot be followed" in last["error"]["message"]
        finishes = [ch["finish_reason"] for e in events[:-2] for ch in json.loads(e).get("choices", [])]
        assert "stop" not in finishes
        # the server goes on serving
        r = c.post(chat, json={"model": MODEL, "messages": Q, "max_tokens": 16, "temperature": 0,
                               "response_format": {"type": "json_object"}})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")

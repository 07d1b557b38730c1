"""Forced tool choice through the official clients, live on 127.0.0.1 with SmolLM2 (a model that would rather
answer in prose): OpenAI's "required" and named function, Anthropic's "any" and "tool", streamed and not, sampled
with several seeds. Whatever the sample, the answer is one call to a declared tool (the named one when named)
whose arguments validate against its schema, with finish_reason "tool_calls" / stop_reason "tool_use"; a forced
name that no tool declares is a 400. Only structure is checked: which call comes depends on the ISA's rounding."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.isa

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

from test_chat_template import QWEN35_TEMPLATE  # noqa: E402
from test_serve_api import MODEL, an_client, oa_client, running  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402

# bounded values (enums, integers in a range): a sampled call always closes within max_tokens
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "loud": {"type": "boolean"}},
         "required": ["hour", "loud"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n.replace('_', ' ')}", "parameters": s}}
         for n, s in SCHEMAS.items()]
A_TOOLS = [{"name": n, "description": n.replace("_", " "), "input_schema": s} for n, s in SCHEMAS.items()]
PROSE = [{"role": "user", "content": "Write a short poem about the sea."}]
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def url(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=1024, max_seqs=4, isa=os.environ.get("HYBRIDINFER_ISA"))
    with running(create_app(eng, model_name=MODEL)) as u:
        yield u
    eng.close()


@pytest.fixture
def oa(url):
    return oa_client(url, timeout=120)


@pytest.fixture
def an(url):
    return an_client(url, timeout=120)


def _valid(name: str, args: dict) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("seed", SEEDS)
def test_openai_named_and_required(oa, seed):
    named = {"type": "function", "function": {"name": "set_alarm"}}
    for choice, want in ((named, "set_alarm"), ("required", None)):
        r = oa.chat.completions.create(model=MODEL, messages=PROSE, tools=TOOLS, tool_choice=choice,
                                       max_tokens=96, temperature=0.8, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (choice, c)
        (call,) = c.message.tool_calls
        assert want is None or call.function.name == want
        _valid(call.function.name, json.loads(call.function.arguments))
        assert not c.message.content, c.message.content  # the call is the whole answer


def test_openai_streamed(oa):
    chunks = list(oa.chat.completions.create(model=MODEL, messages=PROSE, tools=TOOLS, tool_choice="required",
                                             max_tokens=96, temperature=0.8, seed=5, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    _valid(calls[0].function.name, json.loads(calls[0].function.arguments))


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_anthropic_tool_and_any(an, seed):
    for choice, want in (({"type": "tool", "name": "get_weather"}, "get_weather"), ({"type": "any"}, None)):
        m = an.messages.create(model=MODEL, messages=PROSE, tools=A_TOOLS, tool_choice=choice, max_tokens=96,
                               extra_body={"temperature": 0.8, "seed": seed})
        assert m.stop_reason == "tool_use", m
        uses = [b for b in m.content if b.type == "tool_use"]
        assert len(uses) == 1 and (want is None or uses[0].name == want)
        _valid(uses[0].name, uses[0].input)


def test_forced_unknown_tool_is_400(oa, an):
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=PROSE, tools=TOOLS, max_tokens=8,
                                   tool_choice={"type": "function", "function": {"name": "launch_rocket"}})
    assert "launch_rocket" in str(e.value) and "tool_choice" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model=MODEL, messages=PROSE, tools=A_TOOLS, max_tokens=8,
                           tool_choice={"type": "tool", "name": "launch_rocket"})
    assert "launch_rocket" in str(e.value)
    # the server goes on serving
    r = oa.chat.completions.create(model=MODEL, messages=PROSE, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_anthropic_streamed(an):
    with an.messages.stream(model=MODEL, messages=PROSE, tools=A_TOOLS, tool_choice={"type": "any"}, max_tokens=96,
                            extra_body={"temperature": 0.8, "seed": 9}) as st:
        final = st.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(uses) == 1
    _valid(uses[0].name, uses[0].input)


def test_qwen35_xml_form(smollm_path):
    """SmolLM2 under Qwen3.5's template (ChatML too, with tools in its own words and the XML call form): a forced
    call comes in the XML form, its values typed by the schema (text, integers, booleans), through the thinking
    block the template opens (closed for a forced call)."""
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=2048, max_seqs=2, chat_template=QWEN35_TEMPLATE,
                      isa=os.environ.get("HYBRIDINFER_ISA"))
    try:
        with running(create_app(eng, model_name=MODEL)) as u:
            oa = oa_client(u, timeout=120)
            named = {"type": "function", "function": {"name": "set_alarm"}}
            prompt = httpx.post(u + "/apply-template", timeout=60, json={
                "messages": PROSE, "tools": TOOLS, "tool_choice": named}).json()["prompt"]
            assert prompt.endswith("</think>\n\n<tool_call>\n<function=set_alarm>\n"), prompt[-80:]  # the XML form
            for choice, want in (("required", None), ({"type": "function", "function": {"name": "set_alarm"}},
                                                      "set_alarm")):
                r = oa.chat.completions.create(model=MODEL, messages=PROSE, tools=TOOLS, tool_choice=choice,
                                               max_tokens=96, temperature=0.8, seed=11)
                c = r.choices[0]
                assert c.finish_reason == "tool_calls", c
                (call,) = c.message.tool_calls
                assert want is None or call.function.name == want
                _valid(call.function.name, json.loads(call.function.arguments))
    finally:
        eng.close()

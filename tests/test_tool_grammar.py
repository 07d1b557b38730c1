"""Forced tool calls' grammars (protocol.toolgrammar) on SmolLM2's vocabulary: what follows the forced prefix is
accepted token by token when it is a well-formed call of a declared tool whose arguments follow its schema, and
refused otherwise (an undeclared name, a missing required argument, a wrong type, a value outside an enum), in
both the JSON (Hermes) and the XML (Qwen3.5) forms; once the call is closed only an end-of-generation token may
come. And the output parser never passes on a call to an undeclared tool."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("llguidance")

from hybridinfer.format.gguf_model import GGUFModel  # noqa: E402
from hybridinfer.format.tokenizer import Tokenizer  # noqa: E402
from hybridinfer.serving.protocol.grammar import JsonConstraint  # noqa: E402
from hybridinfer.serving.protocol.prompt import TemplateInfo, forced_prefix  # noqa: E402
from hybridinfer.serving.protocol.toolcalls import OutputParser  # noqa: E402
from hybridinfer.serving.protocol.toolgrammar import call_grammar  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]},
                                         "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"],
        "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def engine(smollm_path):
    """What a constraint reads of an Engine: the tokenizer and the vocabulary's size (no backend needed)."""
    tok = Tokenizer.from_gguf(GGUFModel(smollm_path))
    return SimpleNamespace(tokenizer=tok, args=SimpleNamespace(n_vocab=len(tok)))


def _follows(engine, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text`'s tokens and is then complete (only an end token allowed)."""
    c = JsonConstraint(engine, param="tool_choice", lark=grammar)
    for t in engine.tokenizer.encode(text, add_bos=False, parse_special=False):
        if not c.allowed()[t]:
            return False
        c.accept(t)
    ok = c.allowed()
    return bool(ok[sorted(engine.tokenizer.stop_ids)].all()) and int(ok.sum()) == len(engine.tokenizer.stop_ids)


JSON_REQUIRED = [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', True),
    ('{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>', True),
    ('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F", "days": 3}}\n</tool_call>', True),
    ('{"name": "Paris", "arguments": {}}\n</tool_call>', False),  # no such tool
    ('{"name": "add", "arguments": {"a": 1}}\n</tool_call>', False),  # b is required
    ('{"name": "add", "arguments": {"a": "one", "b": 2}}\n</tool_call>', False),  # a is a number
    ('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}}\n</tool_call>', False),  # enum
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', False),  # the call is not closed
]


@pytest.mark.parametrize("text,ok", JSON_REQUIRED)
def test_json_required(engine, text, ok):
    assert _follows(engine, call_grammar(TOOLS, None, xml=False), text) is ok


def test_json_named(engine):
    info = TemplateInfo(native_tools=False, xml_calls=False)
    prefix = forced_prefix("add", TOOLS, info)
    assert prefix.endswith('"arguments": ')
    g = call_grammar(TOOLS, "add", xml=False)
    assert _follows(engine, g, '{"a": 2, "b": 3}}\n</tool_call>')
    assert not _follows(engine, g, '{"city": "Paris"}}\n</tool_call>')  # another tool's arguments
    assert not _follows(engine, g, '{"a": 2, "b": 3, "c": 4}}\n</tool_call>')  # additionalProperties: false
    assert not _follows(engine, g, '{\n\n"a": 2, "b": 3}}\n</tool_call>')  # no free whitespace to loop in


XML_REQUIRED = [
    ("<function=get_weather>\n<parameter=city>\nSan Francisco, <CA>\n</parameter>\n</function>\n</tool_call>", True),
    ("<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=unit>\nF\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", True),
    ("<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n-2.5\n</parameter>\n</function>\n</tool_call>",
     True),
    ("<function=Paris>\n</function>\n</tool_call>", False),
    ("<function=get_weather>\n</function>\n</tool_call>", False),  # city is required
    ("<function=add>\n<parameter=a>\nx\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
     False),
    ("<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=unit>\nK\n</parameter>\n"
     "</function>\n</tool_call>", False),
]


@pytest.mark.parametrize("text,ok", XML_REQUIRED)
def test_xml_required(engine, text, ok):
    assert _follows(engine, call_grammar(TOOLS, None, xml=True), text) is ok


def test_xml_named(engine):
    info = TemplateInfo(native_tools=True, xml_calls=True)
    assert forced_prefix("get_weather", TOOLS, info) == "<tool_call>\n<function=get_weather>\n"
    g = call_grammar(TOOLS, "get_weather", xml=True)
    assert _follows(engine, g, "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    assert not _follows(engine, g, "<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>")


def test_masks_only_allow_the_grammar(engine):
    """The first step of a named JSON call allows only what starts an object; after the call, only the end."""
    c = JsonConstraint(engine, param="tool_choice", lark=call_grammar(TOOLS, "add", xml=False))
    ok = c.allowed()
    tok = engine.tokenizer
    starts = {tok.token_bytes(int(i)).lstrip()[:1] for i in np.flatnonzero(ok)}
    assert starts <= {b"{", b""}, starts


def test_undeclared_tool_is_text_not_a_call():
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    p = OutputParser(False, True, schemas)
    ev = p.feed('<tool_call>\n{"name": "Paris", "arguments": {}}\n</tool_call> and '
                '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>') + p.finish()
    calls = [v for k, v in ev if k == "tool"]
    text = "".join(v for k, v in ev if k == "text")
    assert [c.name for c in calls] == ["add"] and '"name": "Paris"' in text

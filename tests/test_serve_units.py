"""The server's pure parts, without a server: the output parser (thinking, Qwen's two tool-call forms), prompt
building (tools through the template or written in Hermes form, forced tool calls), error shapes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from pydantic import ValidationError  # noqa: E402
from test_chat_template import QWEN35_TEMPLATE, TOOLS  # noqa: E402

from hybridinfer.format.chat_template import render_chat  # noqa: E402
from hybridinfer.format.chat_text import ChatText  # noqa: E402
from hybridinfer.serving.serve.errors import from_validation  # noqa: E402
from hybridinfer.serving.serve.models import ChatRequest  # noqa: E402
from hybridinfer.serving.serve.prompt import TemplateInfo, build_chat, normalize_tool_choice  # noqa: E402
from hybridinfer.serving.serve.toolcalls import OutputParser, parse_all, parse_tool_call  # noqa: E402

JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}


def _pieces(text: str, size: int):
    return [text[i : i + size] for i in range(0, len(text), size)]


def _streamed(text: str, size: int, **kw):
    p = OutputParser(**kw)
    ev = [e for piece in _pieces(text, size) for e in p.feed(piece)] + p.finish()
    return ("".join(v for k, v in ev if k == "reasoning"), "".join(v for k, v in ev if k == "text"),
            [(c.name, json.loads(c.arguments)) for k, c in ev if k == "tool"])


def _whole(text: str, **kw):
    r, t, calls = parse_all(text, **kw)
    return r, t, [(c.name, json.loads(c.arguments)) for c in calls]


CASES = [
    # (output, parser options, reasoning, text, calls)
    ("Hello there.\n", {}, "", "Hello there.\n", []),
    ("  <think>\nhmm\n</think>\n\nThe answer.", {}, "\nhmm\n", "The answer.", []),
    ("hmm, let me see\n</think>\n\nDone", {"in_reasoning": True}, "hmm, let me see\n", "Done", []),
    ("cut off while thinking", {"in_reasoning": True}, "cut off while thinking", "", []),
    ("I'll check.\n\n" + JSON_CALL, {"tools": True}, "", "I'll check.",
     [("get_weather", {"city": "Paris", "unit": "C"})]),
    (JSON_CALL + "\n" + JSON_CALL.replace("Paris", "Rome"), {"tools": True}, "", "",
     [("get_weather", {"city": "Paris", "unit": "C"}), ("get_weather", {"city": "Rome", "unit": "C"})]),
    ("plan\n</think>\n\n" + XML_CALL, {"tools": True, "in_reasoning": True, "schemas": SCHEMAS}, "plan\n", "",
     [("get_weather", {"city": "Paris", "days": 3})]),
    # arguments given as a JSON string; a call cut off before its closing tag is still a call
    ('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}', {"tools": True}, "", "", [("f", {"x": 1})]),
    # not a call: what the model wrote reaches the client
    ("<tool_call>\nnot json\n</tool_call> ok", {"tools": True}, "", "<tool_call>\nnot json\n</tool_call> ok", []),
    # without tools the tag is just text; a `<` that never becomes a tag comes out at the end
    (JSON_CALL, {}, "", JSON_CALL, []),
    ("a < b and 2 <", {"tools": True}, "", "a < b and 2 <", []),
    ("ends with a newline\n", {"tools": True}, "", "ends with a newline\n", []),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_output_parser(i):
    text, kw, reasoning, content, calls = CASES[i]
    assert _whole(text, **kw) == (reasoning, content, calls)
    for size in (1, 2, 3, 7):  # tags split across pieces anywhere
        assert _streamed(text, size, **kw) == (reasoning, content, calls), size


def test_parse_tool_call_forms():
    (c,) = parse_tool_call(XML_CALL[len("<tool_call>"): -len("</tool_call>")], SCHEMAS)
    assert c.name == "get_weather" and json.loads(c.arguments) == {"city": "Paris", "days": 3}
    assert c.id.startswith("call_") and c.input() == {"city": "Paris", "days": 3}
    # without a schema a value reads as JSON where it parses; a string type keeps digits as text
    (c,) = parse_tool_call("<function=g>\n<parameter=n>\n007\n</parameter>\n<parameter=o>\n{\"a\": [1]}\n"
                           "</parameter>\n</function>", {"g": {"properties": {"n": {"type": "string"}}}})
    assert json.loads(c.arguments) == {"n": "007", "o": {"a": [1]}}
    assert parse_tool_call('{"arguments": {}}') is None and parse_tool_call("[1, 2]") is None


class _TextEngine:
    """What build_chat needs of an Engine: a template and a tokenizer (here one id per character)."""

    def __init__(self, template: str):
        self.template, self.n_ctx = template, 1 << 20
        self.tokenizer = type("T", (), {"bos_id": None, "token_text": lambda self, i: "", "max_token_bytes": 1})()

    def chat_text(self, messages, add_generation_prompt=True, enable_thinking=None, tools=None):
        return ChatText(render_chat(self.template, messages, add_generation_prompt=add_generation_prompt,
                                    enable_thinking=enable_thinking, tools=tools))

    def chat_prompt(self, messages, add_generation_prompt=True, enable_thinking=None, tools=None):
        return self.chat_text(messages, add_generation_prompt, enable_thinking, tools).text

    def tokenize_chat(self, chat):
        return [ord(ch) for ch in chat.text]


def _text(prep) -> str:
    return "".join(chr(i) for i in prep.ids)


CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def test_build_chat_native_tools_and_thinking():
    eng = _TextEngine(QWEN35_TEMPLATE)
    info = TemplateInfo.probe(eng)
    assert info.native_tools and info.xml_calls
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    p = build_chat(eng, info, msgs, TOOLS, "auto", None)
    assert p.in_reasoning and p.tools and p.prefix == "" and '"name": "get_weather"' in _text(p)
    assert len(p.turn_boundary) == 1 and _text(p)[: p.turn_boundary[0]].endswith("<|im_end|>\n")
    # with a system message: also where it ends (with the tools, shared by every conversation that has them)
    sysmsgs = [{"role": "system", "content": "Be brief."}, *msgs]
    p = build_chat(eng, info, sysmsgs, TOOLS, "auto", None)
    end_sys, end_hist = p.turn_boundary
    assert _text(p)[:end_sys].endswith("<|im_end|>\n") and "Be brief." in _text(p)[:end_sys]
    assert '"name": "get_weather"' in _text(p)[:end_sys] and "Weather in Paris?" not in _text(p)[:end_sys]
    assert _text(p)[:end_hist].endswith("Weather in Paris?<|im_end|>\n")
    p = build_chat(eng, info, msgs, TOOLS, None, False)  # tool_choice none: no tools offered, thinking off
    assert not p.in_reasoning and not p.tools and "get_weather" not in _text(p)
    assert _text(p).endswith("<think>\n\n</think>\n\n")
    p = build_chat(eng, info, msgs, TOOLS, {"name": "get_weather"}, None)  # a named call skips the reasoning
    assert not p.in_reasoning and _text(p).endswith("</think>\n\n<tool_call>\n<function=get_weather>\n")
    # the forced start is parsed with the rest of the call
    parser = OutputParser(p.in_reasoning, p.tools, p.schemas)
    ev = parser.feed(p.prefix) + parser.feed("<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    assert [(k, v.name, v.input()) for k, v in ev + parser.finish()] == [("tool", "get_weather", {"city": "Rome"})]


def test_build_chat_hermes_fallback():
    """A template that ignores tools gets them, the calls and their results written into the messages."""
    eng = _TextEngine(CHATML)
    info = TemplateInfo.probe(eng)
    assert not info.native_tools
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12 C"}, {"role": "tool", "content": "rain"}]
    text = _text(build_chat(eng, info, msgs, TOOLS, "auto", None))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and "<tools>\n{\"type\": \"function\"" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' in text
    assert "<|im_start|>user\n<tool_response>\n12 C\n</tool_response>\n<tool_response>\nrain\n</tool_response>" in text
    p = build_chat(eng, info, msgs[:2], TOOLS, "required", None)
    assert _text(p).endswith("<|im_start|>assistant\n<tool_call>\n") and p.prefix == "<tool_call>\n"
    p = build_chat(eng, info, msgs[:2], TOOLS, {"name": "get_weather"}, None)
    assert p.prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    # without tools a plain chat renders exactly as the template alone renders it
    assert _text(build_chat(eng, info, msgs[:2], None, None, None)) == render_chat(CHATML, msgs[:2])


def test_tool_choice_checks():
    assert normalize_tool_choice(None, None) is None and normalize_tool_choice(None, TOOLS) == "auto"
    assert normalize_tool_choice("none", TOOLS) is None
    assert normalize_tool_choice({"type": "function", "function": {"name": "f"}}, TOOLS) == {"name": "f"}
    for bad, tools in [("always", TOOLS), ("required", None), ({"type": "x"}, TOOLS)]:
        with pytest.raises(Exception) as e:
            normalize_tool_choice(bad, tools)
        assert e.value.status == 400 and e.value.param == "tool_choice"
    with pytest.raises(Exception) as e:
        build_chat(_TextEngine(CHATML), TemplateInfo(False, False), [{"role": "user", "content": "x"}], TOOLS,
                   {"name": "nope"}, None)
    assert e.value.status == 400 and "nope" in e.value.message


@pytest.mark.parametrize("body,param", [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "0.5"}, "temperature"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ({"model": 3, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
])
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(ValidationError) as e:
        ChatRequest.model_validate(body)
    err = from_validation(e.value)
    assert err.status == 400 and err.param == param and err.message.startswith(param), err.message

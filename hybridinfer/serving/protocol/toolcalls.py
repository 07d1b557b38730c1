"""Split a model's output into reasoning, text and tool calls, incrementally (the same code streams and not).

Qwen's formats: reasoning in `<think>...</think>` (Qwen3.5's generation prompt opens the block itself, so its
output starts inside it); tool calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5 /
Qwen3, Hermes) or in Qwen3.5 / Qwen3-Coder's XML form `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n
</parameter>\\n</function>\\n</tool_call>`. Text that could still become a tag is held back until it cannot."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.S)


MAX_JSON_DEPTH = 64  # nesting of tool-call arguments: far past any real tool's, far below the interpreter's stack
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(text: str, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep the arrays and objects of JSON `text` nest, counted without recursion; counting stops past `limit`
    (so the cost of a hostile `[[[[...` is its length, not the parser's stack)."""
    depth = deepest = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif c in "]}":
            depth -= 1
    return deepest


def value_depth(value, limit: int = MAX_JSON_DEPTH) -> int:
    """json_depth of a decoded value (dicts and lists), walked without recursion; stops past `limit`."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            if d > deepest:
                deepest = d
                if deepest > limit:
                    break
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


class TooDeep(ValueError):
    pass


def loads_bounded(text: str, limit: int = MAX_JSON_DEPTH):
    """json.loads of `text`, refused (TooDeep, a ValueError) when it nests deeper than `limit`."""
    if json_depth(text, limit) > limit:
        raise TooDeep(f"nested deeper than {limit} levels")
    return json.loads(text)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def input(self) -> dict:
        """The arguments as a dict (Anthropic's `input`)."""
        try:
            v = loads_bounded(self.arguments)
        except ValueError:
            return {}
        return v if isinstance(v, dict) else {}


def _held(buf: str, tag: str) -> int:
    """Length of the longest end of `buf` that begins `tag` (it may yet become the tag)."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


def _xml_value(raw: str, schema: dict | None):
    """A `<parameter>` value: kept as text where the tool's schema says string, else read as JSON if it parses
    (numbers, booleans, objects), as Qwen3-Coder's own parser does."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return raw
    try:
        return loads_bounded(raw)
    except ValueError:
        return raw


def parse_tool_call(body: str, schemas: dict[str, dict] | None = None) -> list[ToolCall] | None:
    """The calls inside one `<tool_call>` block, or None when it is in neither format."""
    body = body.strip()
    if body.startswith("{"):
        try:
            obj = loads_bounded(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string already
            try:
                args = loads_bounded(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return [ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))]
    calls = []
    for name, inner in _FUNCTION.findall(body):
        name = name.strip()
        props = ((schemas or {}).get(name) or {}).get("properties") or {}
        args = {p.strip(): _xml_value(v, props.get(p.strip())) for p, v in _PARAMETER.findall(inner)}
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls or None


class OutputParser:
    """Feed text pieces; get events ("reasoning", str), ("text", str) and ("tool", ToolCall).

    in_reasoning: the prompt already opened a `<think>` block. tools: look for tool calls at all (off with no
    tools, so a model quoting the tag in prose is left alone). schemas: tool name -> JSON schema of its parameters
    (types of XML-form values); when given, they are the declared tools, and a block that calls any other name is
    no call: it is left as the text the model wrote (a client never receives a call to a tool it did not declare).
    Whitespace around tool calls and after `</think>` is dropped, as clients show it."""

    def __init__(self, in_reasoning: bool = False, tools: bool = False, schemas: dict[str, dict] | None = None):
        self.mode = "reasoning" if in_reasoning else "start"
        self.tools, self.schemas = tools, schemas or {}
        self.declared = set(schemas) if schemas else None
        self.buf, self.ws = "", ""  # ws: trailing whitespace held in text mode (it may precede a tool call)
        self.n_calls = 0
        self._strip = False  # drop leading whitespace of the next text (after </think> or </tool_call>)

    def feed(self, piece: str) -> list[tuple[str, object]]:
        self.buf += piece
        out: list[tuple[str, object]] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        buf, self.buf = self.buf, ""
        if self.mode == "reasoning":
            if buf:
                out.append(("reasoning", buf))
        elif self.mode == "tool":
            calls = self._parse(buf)
            if calls:  # a call cut off just before its closing tag (a stop string, EOS) is still a call
                self._calls(calls, out)
            else:
                self._text(CALL_OPEN + buf, out)
        else:
            self._text(buf, out)
        if self.ws and not self.n_calls:
            out.append(("text", self.ws))
        self.ws = ""
        return out

    # one transition or nothing; True when the buffer may hold more
    def _step(self, out) -> bool:
        if self.mode == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.buf = head[len(THINK_OPEN):]
                self.mode = "reasoning"
                return True
            if head == "" or THINK_OPEN.startswith(head):
                return False  # not yet known
            self.mode = "text"
            return True
        if self.mode == "reasoning":
            i = self.buf.find(THINK_CLOSE)
            if i >= 0:
                if i:
                    out.append(("reasoning", self.buf[:i]))
                self.buf, self.mode, self._strip = self.buf[i + len(THINK_CLOSE):], "text", True
                return True
            keep = _held(self.buf, THINK_CLOSE)
            if len(self.buf) > keep:
                out.append(("reasoning", self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        if self.mode == "tool":
            i = self.buf.find(CALL_CLOSE)
            if i < 0:
                return False
            body, self.buf = self.buf[:i], self.buf[i + len(CALL_CLOSE):]
            calls = self._parse(body)
            if calls:
                self._calls(calls, out)
            else:  # not a call after all: the client sees what the model wrote
                self._text(CALL_OPEN + body + CALL_CLOSE, out)
            self.mode = "text"
            return True
        # text
        if not self.tools:
            self._text(self.buf, out)
            self.buf = ""
            return False
        i = self.buf.find(CALL_OPEN)
        if i >= 0:
            self._text(self.buf[:i], out)
            self.ws = ""  # whitespace before a call is layout, not content
            self.buf, self.mode = self.buf[i + len(CALL_OPEN):], "tool"
            return True
        keep = _held(self.buf, CALL_OPEN)
        self._text(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _parse(self, body: str) -> list[ToolCall] | None:
        """The calls of one block, None when it is none or names a tool that was not declared."""
        calls = parse_tool_call(body, self.schemas)
        if calls and self.declared is not None and any(c.name not in self.declared for c in calls):
            return None
        return calls

    def _text(self, s: str, out) -> None:
        if self._strip:
            s = s.lstrip()
            if not s:
                return
            self._strip = False
        if not s:
            return
        if not self.tools:
            out.append(("text", s))
            return
        s = self.ws + s
        body = s.rstrip()
        self.ws = s[len(body):]
        if body:
            out.append(("text", body))

    def _calls(self, calls: list[ToolCall], out) -> None:
        for c in calls:
            out.append(("tool", c))
        self.n_calls += len(calls)
        self._strip, self.ws = True, ""


def parse_all(text: str, in_reasoning: bool = False, tools: bool = False, schemas=None):
    """(reasoning, text, tool calls) of a whole output."""
    p = OutputParser(in_reasoning, tools, schemas)
    events = p.feed(text) + p.finish()
    reasoning = "".join(v for k, v in events if k == "reasoning")
    content = "".join(v for k, v in events if k == "text")
    return reasoning, content, [v for k, v in events if k == "tool"]

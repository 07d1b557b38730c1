"""Anthropic /v1/messages without HTTP: a body checked, its Request built, the answer's body assembled (shared by
the server's route and the batch runner)."""

from __future__ import annotations

import uuid

from .context import Context, matched_stop, sampling_args, usage_counts
from .errors import bad_param
from .models import ACountTokens, AMessagesRequest
from .prompt import args_mapping, build_chat
from .toolcalls import OutputParser


def _text_blocks(blocks, where: str) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    out = []
    for j, b in enumerate(blocks):
        if b.type != "text":
            raise bad_param(f"{where}[{j}].type", f"blocks of type {b.type!r} are not supported here (text only)")
        out.append(b.text or "")
    return "\n".join(out)


def _image_source(src, where: str) -> str:
    """An image block's source as open_image takes it: base64 data as a data: URL, or its url."""
    if not isinstance(src, dict):
        raise bad_param(f"{where}.source", "an image block needs a source ({'type': 'base64', 'media_type': ..., "
                                           "'data': ...})")
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        return f"data:{src.get('media_type') or 'image/png'};base64,{src['data']}"
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return src["url"]
    raise bad_param(f"{where}.source.type", f"image sources of type {src.get('type')!r} are not supported (base64 "
                                            "or url)")


def messages_of(body: ACountTokens) -> list[dict]:
    """Anthropic's system + messages as the chat template's messages (tool results become tool messages, which
    answer the assistant turn before them)."""
    out = []
    if body.system:
        out.append({"role": "system", "content": _text_blocks(body.system, "system")})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results, thinking, parts = [], [], [], [], []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                texts.append(b.text or "")
                parts.append({"type": "text", "text": b.text or ""})
            elif b.type == "image" and m.role == "user":
                parts.append({"type": "image", "image": _image_source(getattr(b, "source", None), where)})
            elif b.type == "thinking" and m.role == "assistant":
                thinking.append(b.thinking or "")
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise bad_param(f"{where}.name", "a tool_use block needs the tool's name")
                calls.append({"id": b.id or f"toolu_{i}_{j}", "type": "function",
                              "function": {"name": b.name, "arguments": args_mapping(b.input or {}, f"{where}.input")}})
            elif b.type == "tool_result" and m.role == "user":
                content = _text_blocks(b.content, f"{where}.content")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": ("Error: " + content) if b.is_error else content})
            else:
                raise bad_param(f"{where}.type", f"blocks of type {b.type!r} are not supported in a {m.role} "
                                                 f"message")
        if m.role == "user":
            out.extend(results)
            if len(parts) > len(texts):  # images among the blocks: the parts in order (engine/images.py)
                out.append({"role": "user", "content": parts})
            elif texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
        else:
            d = {"role": "assistant", "content": "".join(texts)}
            if calls:
                d["tool_calls"] = calls
            if thinking:
                d["reasoning_content"] = "".join(thinking)
            out.append(d)
    return out


def tools_of(body: ACountTokens):
    """(OpenAI-style tool definitions, tool choice as build_chat takes it, one call only)."""
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools or []] or None
    tc = body.tool_choice
    one = bool(tc and tc.disable_parallel_tool_use)
    if not tools or (tc and tc.type == "none"):
        if tc and tc.type in ("any", "tool"):
            raise bad_param("tool_choice", f"is {tc.type!r} but no tools were given")
        return None, None, one
    if tc is None or tc.type == "auto":
        return tools, "auto", one
    if tc.type == "any":
        return tools, "required", one
    if not tc.name:
        raise bad_param("tool_choice.name", "tool_choice of type 'tool' needs the tool's name")
    return tools, {"name": tc.name}, one


def thinking_of(body: ACountTokens):
    t = body.thinking
    return None if t is None or t.type == "adaptive" else t.type == "enabled"


def output_format(body) -> dict | None:
    """Anthropic's structured output (`output_config.format`, or the older `output_format`) as OpenAI's
    response_format."""
    extra = body.model_extra or {}
    fmt = (extra.get("output_config") or {}).get("format") if isinstance(extra.get("output_config"), dict) else None
    fmt = fmt or extra.get("output_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_param("output_config.format", f"must be {{'type': 'json_schema', 'schema': {{...}}}}, got {fmt!r}")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def usage(request, generation) -> dict:
    p, c, reused = usage_counts(request, generation)
    return {"input_tokens": p - reused, "output_tokens": c, "cache_read_input_tokens": reused,
            "cache_creation_input_tokens": 0}


def stop_of(engine, request, generation, calls: int) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if generation.finish_reason == "length":
        return "max_tokens", None
    s = matched_stop(engine, request, generation)
    return ("stop_sequence", s) if s is not None else ("end_turn", None)


class MessagesCall:
    """One /v1/messages body: checked at construction, `build()` renders and tokenizes it, `answer()` makes the
    non-streamed response body (as openai.ChatCall)."""

    def __init__(self, ctx: Context, body: AMessagesRequest):
        ctx.check_model(body.model)
        self.messages, (tools, choice, self.one_call) = messages_of(body), tools_of(body)
        self.sampling, self.thinking = sampling_args(body, penalties=False), thinking_of(body)
        self.schema = ctx.check_schema(output_format(body))
        if self.schema is not None:  # the grammar holds the answer to JSON from its first token: no tool calls
            tools = choice = None
        self.tools, self.choice = tools, choice
        self.ctx, self.body, self.prepared = ctx, body, None

    def build(self):
        ctx = self.ctx
        p = self.prepared = build_chat(ctx.engine, ctx.info, self.messages, self.tools, self.choice, self.thinking,
                                       self.schema is not None)
        req = ctx.make_request(p.ids, self.body.max_tokens, self.sampling, self.body.stop_sequences, p.turn_boundary,
                               p.images)
        return ctx.constrain(req, self.schema, p)

    def parser(self) -> tuple[OutputParser, list]:
        p = self.prepared
        parser = OutputParser(p.in_reasoning, p.tools, p.schemas)
        return parser, (parser.feed(p.prefix) if p.prefix else [])

    def head(self) -> dict:
        return {"id": "msg_" + uuid.uuid4().hex[:24]}

    def answer(self, head: dict, events: list, request, generation) -> dict:
        content, n_calls = [], 0
        for kind, v in events:
            if kind == "tool":
                if self.one_call and n_calls:
                    continue
                n_calls += 1
                content.append({"type": "tool_use", "id": "toolu_" + v.id[5:], "name": v.name, "input": v.input()})
            elif content and content[-1]["type"] == ("text" if kind == "text" else "thinking"):
                content[-1]["text" if kind == "text" else "thinking"] += v
            elif kind == "text":
                content.append({"type": "text", "text": v})
            else:
                content.append({"type": "thinking", "thinking": v, "signature": ""})
        stop, seq = stop_of(self.ctx.engine, request, generation, n_calls)
        return {"id": head["id"], "type": "message", "role": "assistant", "model": self.ctx.model_name,
                "content": content, "stop_reason": stop, "stop_sequence": seq, "usage": usage(request, generation)}

"""Anthropic routes: /v1/messages (streamed and not) and /v1/messages/count_tokens."""

from __future__ import annotations

import uuid

import anyio
from fastapi import APIRouter, Request

from ..errors import HybridInferError
from .errors import ApiError, bad_param, from_engine
from .httpio import dumps, parse_body, sse
from .models import ACountTokens, AMessagesRequest
from .prompt import build_chat
from .service import Service, collect, sampling_args
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
        texts, calls, results, thinking = [], [], [], []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "thinking" and m.role == "assistant":
                thinking.append(b.thinking or "")
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise bad_param(f"{where}.name", "a tool_use block needs the tool's name")
                calls.append({"id": b.id or f"toolu_{i}_{j}", "type": "function",
                              "function": {"name": b.name, "arguments": b.input or {}}})
            elif b.type == "tool_result" and m.role == "user":
                content = _text_blocks(b.content, f"{where}.content")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": ("Error: " + content) if b.is_error else content})
            else:
                raise bad_param(f"{where}.type", f"blocks of type {b.type!r} are not supported in a {m.role} "
                                                 f"message")
        if m.role == "user":
            out.extend(results)
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
        else:
            d = {"role": "assistant", "content": "".join(texts)}
            if calls:
                d["tool_calls"] = calls
            if thinking:
                d["reasoning_content"] = "".join(thinking)
            out.append(d)
    return out


def _tools(body: ACountTokens):
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


def _thinking(body: ACountTokens):
    t = body.thinking
    return None if t is None or t.type == "adaptive" else t.type == "enabled"


def _output_format(body) -> dict | None:
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


def _usage(job) -> dict:
    p, c, reused = job.usage()
    return {"input_tokens": p - reused, "output_tokens": c, "cache_read_input_tokens": reused,
            "cache_creation_input_tokens": 0}


def _stop(job, calls: int) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if job.generation.finish_reason == "length":
        return "max_tokens", None
    s = job.matched_stop()
    return ("stop_sequence", s) if s is not None else ("end_turn", None)


def router(svc: Service, max_body: int) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await parse_body(request, ACountTokens, max_body)
        svc.check_model(body.model)
        msgs, (tools, choice, _) = messages_of(body), _tools(body)

        def count():
            try:
                return len(build_chat(svc.engine, svc.info, msgs, tools, choice, _thinking(body)).ids)
            except HybridInferError as e:
                raise from_engine(e) from None

        return {"input_tokens": await anyio.to_thread.run_sync(count)}

    @r.post("/v1/messages")
    async def messages(request: Request):
        body = await parse_body(request, AMessagesRequest, max_body)
        svc.check_model(body.model)
        msgs, (tools, choice, one) = messages_of(body), _tools(body)
        sampling, thinking, prep = sampling_args(body, penalties=False), _thinking(body), {}
        schema = svc.check_schema(_output_format(body))
        if schema is not None:  # the grammar holds the answer to JSON from its first token: no tool calls
            tools = choice = None

        def build():
            prep["p"] = p = build_chat(svc.engine, svc.info, msgs, tools, choice, thinking, schema is not None)
            req = svc.make_request(p.ids, body.max_tokens, sampling, body.stop_sequences, p.turn_boundary)
            return svc.constrain(req, schema)

        job = await svc.submit(build)
        p = prep["p"]
        parser = OutputParser(p.in_reasoning, p.tools, p.schemas)
        first = parser.feed(p.prefix) if p.prefix else []
        mid = "msg_" + uuid.uuid4().hex[:24]
        if body.stream:
            return sse(_stream(job, parser, first, mid, svc.model_name, one), job)
        events = await collect(request, job, parser, first)
        content, n_calls = [], 0
        for kind, v in events:
            if kind == "tool":
                if one and n_calls:
                    continue
                n_calls += 1
                content.append({"type": "tool_use", "id": "toolu_" + v.id[5:], "name": v.name, "input": v.input()})
            elif content and content[-1]["type"] == ("text" if kind == "text" else "thinking"):
                content[-1]["text" if kind == "text" else "thinking"] += v
            elif kind == "text":
                content.append({"type": "text", "text": v})
            else:
                content.append({"type": "thinking", "thinking": v, "signature": ""})
        stop, seq = _stop(job, n_calls)
        return {"id": mid, "type": "message", "role": "assistant", "model": svc.model_name, "content": content,
                "stop_reason": stop, "stop_sequence": seq, "usage": _usage(job)}

    return r


def _ev(kind: str, data: dict) -> dict:
    return {"event": kind, "data": dumps({"type": kind, **data})}


async def _stream(job, parser, first, mid: str, model: str, one_call: bool):
    """message_start, then per block content_block_start / _delta / _stop, message_delta, message_stop."""
    n_prompt = len(job.request.ids)
    yield _ev("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
    state = {"index": -1, "open": None, "calls": 0}

    def blocks(events):
        for kind, v in events:
            if kind == "tool":
                if one_call and state["calls"]:
                    continue
                yield from close()
                state["index"] += 1
                state["calls"] += 1
                i = state["index"]
                yield _ev("content_block_start", {"index": i, "content_block": {
                    "type": "tool_use", "id": "toolu_" + v.id[5:], "name": v.name, "input": {}}})
                yield _ev("content_block_delta", {"index": i, "delta": {"type": "input_json_delta",
                                                                        "partial_json": v.arguments}})
                yield _ev("content_block_stop", {"index": i})
                continue
            want = "text" if kind == "text" else "thinking"
            if state["open"] != want:
                yield from close()
                state["index"] += 1
                state["open"] = want
                block = {"type": "text", "text": ""} if want == "text" else {"type": "thinking", "thinking": "",
                                                                             "signature": ""}
                yield _ev("content_block_start", {"index": state["index"], "content_block": block})
            delta = {"type": "text_delta", "text": v} if want == "text" else {"type": "thinking_delta",
                                                                              "thinking": v}
            yield _ev("content_block_delta", {"index": state["index"], "delta": delta})

    def close():
        if state["open"] is not None:
            if state["open"] == "thinking":
                yield _ev("content_block_delta", {"index": state["index"], "delta": {"type": "signature_delta",
                                                                                    "signature": ""}})
            yield _ev("content_block_stop", {"index": state["index"]})
            state["open"] = None

    try:
        for e in blocks(first):
            yield e
        async for piece in job.pieces():
            for e in blocks(parser.feed(piece)):
                yield e
        for e in blocks(parser.finish()):
            yield e
        for e in close():
            yield e
    except Exception as e:  # noqa: BLE001 - the status is sent already: the error goes in the stream
        err = e if isinstance(e, ApiError) else ApiError(500, f"generation failed: {type(e).__name__}: {e}")
        yield {"event": "error", "data": dumps(err.anthropic_body())}
        return
    stop, seq = _stop(job, state["calls"])
    yield _ev("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": seq}, "usage": _usage(job)})
    yield _ev("message_stop", {})

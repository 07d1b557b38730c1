"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from .errors import ApiError, bad_param, unsupported
from .httpio import dumps, parse_body, sse
from .models import ChatRequest, CompletionRequest
from .prompt import args_mapping, build_chat, normalize_tool_choice
from .service import Service, collect, sampling_args
from .toolcalls import OutputParser

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def _content(c, where: str) -> str:
    if c is None or isinstance(c, str):
        return c or ""
    out = []
    for j, p in enumerate(c):
        if p.type != "text" or p.text is None:
            raise bad_param(f"{where}[{j}].type", f"content parts of type {p.type!r} are not supported (text only)")
        out.append(p.text)
    return "".join(out)


def chat_messages(body: ChatRequest) -> list[dict]:
    """OpenAI messages as the chat template takes them."""
    out = []
    for i, m in enumerate(body.messages):
        d = {"role": "system" if m.role == "developer" else m.role, "content": _content(m.content,
                                                                                        f"messages[{i}].content")}
        if m.role == "assistant":
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                                    "function": {"name": c.function.name,
                                                 "arguments": args_mapping(c.function.arguments)}}
                                   for j, c in enumerate(m.tool_calls)]
            if m.reasoning_content:
                d["reasoning_content"] = m.reasoning_content
        elif m.role == "tool":
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        out.append(d)
    return out


def _check_common(body) -> None:
    if body.n not in (None, 1):
        raise unsupported("n", body.n)
    if body.logprobs:
        raise unsupported("logprobs", body.logprobs)
    extra = body.model_extra or {}
    # fields that would change the answer if honoured: refused rather than silently ignored
    for name in ("logit_bias", "functions", "function_call", "audio", "prediction"):
        if extra.get(name):
            raise unsupported(name, extra[name])


def _usage(job) -> dict:
    p, c, reused = job.usage()
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": reused}}


def _tool_json(call, index: int | None = None) -> dict:
    d = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return d if index is None else {"index": index, **d}


def router(svc: Service, max_body: int) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model(svc)]}

    @r.get("/v1/models/{name:path}")
    async def model(name: str):
        svc.check_model(name)
        return _model(svc)

    @r.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse_body(request, ChatRequest, max_body)
        svc.check_model(body.model)
        _check_common(body)
        if body.top_logprobs:
            raise unsupported("top_logprobs", body.top_logprobs)
        kw = body.chat_template_kwargs or {}
        thinking = kw.get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise bad_param("chat_template_kwargs.enable_thinking", f"must be true or false, got {thinking!r}")
        schema = svc.check_schema(body.response_format)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = normalize_tool_choice(body.tool_choice, tools)
        if schema is not None:  # the grammar holds the answer to JSON from its first token: no tool calls
            tools = choice = None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sampling, msgs = sampling_args(body), chat_messages(body)
        prep = {}

        def build():
            prep["p"] = p = build_chat(svc.engine, svc.info, msgs, tools, choice, thinking, schema is not None)
            return svc.constrain(svc.make_request(p.ids, max_tokens, sampling, body.stop, p.turn_boundary), schema)

        job = await svc.submit(build)
        p = prep["p"]
        parser = OutputParser(p.in_reasoning, p.tools, p.schemas)
        first = parser.feed(p.prefix) if p.prefix else []
        one_call = body.parallel_tool_calls is False
        cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": cid, "created": created, "model": svc.model_name, "system_fingerprint": "hybridinfer"}
        if body.stream:
            usage_on = bool(body.stream_options and body.stream_options.include_usage)
            return sse(_chat_stream(job, parser, first, head, usage_on, one_call), job)
        events = await collect(request, job, parser, first)
        calls = [v for k, v in events if k == "tool"][: 1 if one_call else None]
        content = "".join(v for k, v in events if k == "text")
        reasoning = "".join(v for k, v in events if k == "reasoning")
        msg = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [_tool_json(c) for c in calls]
        finish = "tool_calls" if calls else _FINISH[job.generation.finish_reason]
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}],
                "usage": _usage(job)}

    @r.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest, max_body)
        svc.check_model(body.model)
        _check_common(body)
        if body.echo:
            raise unsupported("echo", body.echo)
        if body.suffix:
            raise unsupported("suffix", body.suffix)
        if body.best_of not in (None, 1):
            raise unsupported("best_of", body.best_of)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_param("prompt", f"holds {len(prompt)} prompts; this server takes one per request")
            prompt = prompt[0]
        if not prompt:
            raise bad_param("prompt", "is empty")
        sampling, schema = sampling_args(body), svc.check_schema(body.response_format)
        job = await svc.submit(lambda: svc.constrain(svc.make_request(prompt, body.max_tokens, sampling, body.stop),
                                                     schema))
        head = {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": svc.model_name,
                "object": "text_completion"}
        if body.stream:
            usage_on = bool(body.stream_options and body.stream_options.include_usage)
            return sse(_completion_stream(job, head, usage_on), job)
        text = "".join(v for _, v in await collect(request, job))
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": _FINISH[job.generation.finish_reason]}],
                "usage": _usage(job)}

    return r


def _model(svc: Service) -> dict:
    return {"id": svc.model_name, "object": "model", "created": 0, "owned_by": "hybridinfer",
            "max_model_len": svc.engine.n_ctx}


def _error_event(e: BaseException) -> dict:
    err = e if isinstance(e, ApiError) else ApiError(500, f"generation failed: {type(e).__name__}: {e}")
    return {"data": dumps(err.openai_body())}


async def _chat_stream(job, parser, first, head, usage_on: bool, one_call: bool):
    base = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if usage_on else {}
    n_calls = 0

    def chunk(delta: dict, finish=None) -> dict:
        return {"data": dumps({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                     "finish_reason": finish}], **extra})}

    def deltas(events):
        nonlocal n_calls
        for kind, v in events:
            if kind == "text":
                yield chunk({"content": v})
            elif kind == "reasoning":
                yield chunk({"reasoning_content": v})
            elif not (one_call and n_calls):
                yield chunk({"tool_calls": [_tool_json(v, n_calls)]})
                n_calls += 1

    yield chunk({"role": "assistant", "content": ""})
    try:
        for c in deltas(first):
            yield c
        async for piece in job.pieces():
            for c in deltas(parser.feed(piece)):
                yield c
        for c in deltas(parser.finish()):
            yield c
    except Exception as e:  # noqa: BLE001 - the status is sent already: the error goes in the stream
        yield _error_event(e)
        yield {"data": "[DONE]"}
        return
    yield chunk({}, "tool_calls" if n_calls else _FINISH[job.generation.finish_reason])
    if usage_on:
        yield {"data": dumps({**base, "choices": [], "usage": _usage(job)})}
    yield {"data": "[DONE]"}


async def _completion_stream(job, head, usage_on: bool):
    extra = {"usage": None} if usage_on else {}

    def chunk(text: str, finish=None) -> dict:
        return {"data": dumps({**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                     "finish_reason": finish}], **extra})}

    try:
        async for piece in job.pieces():
            yield chunk(piece)
    except Exception as e:  # noqa: BLE001 - the status is sent already: the error goes in the stream
        yield _error_event(e)
        yield {"data": "[DONE]"}
        return
    yield chunk("", _FINISH[job.generation.finish_reason])
    if usage_on:
        yield {"data": dumps({**head, "choices": [], "usage": _usage(job)})}
    yield {"data": "[DONE]"}


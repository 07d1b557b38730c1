"""Anthropic routes: /v1/messages (streamed and not) and /v1/messages/count_tokens (bodies checked and answers
assembled by hybridinfer.serving.protocol.anthropic; the stream is HTTP's own)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...errors import HybridInferError
from ..protocol.anthropic import MessagesCall, messages_of, stop_of, thinking_of, tools_of, usage
from ..protocol.errors import ApiError, from_engine
from ..protocol.models import ACountTokens, AMessagesRequest
from ..protocol.prompt import build_chat
from .httpio import dumps, sse
from .service import Service, collect


def _usage(job) -> dict:
    return usage(job.request, job.generation)


def _stop(job, calls: int) -> tuple[str, str | None]:
    return stop_of(job.service.engine, job.request, job.generation, calls)


def router(svc: Service) -> APIRouter:
    r = APIRouter()

    def count(body: ACountTokens) -> int:
        svc.check_model(body.model)
        msgs, (tools, choice, _) = messages_of(body), tools_of(body)
        try:
            p = build_chat(svc.engine, svc.info, msgs, tools, choice, thinking_of(body))
            return len(p.ids) + sum(e.n_tokens - 1 for e in svc._images(p.images))  # an image: its rows
        except HybridInferError as e:
            raise from_engine(e) from None

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return {"input_tokens": await svc.bounded(request, ACountTokens, count)}

    @r.post("/v1/messages")
    async def messages(request: Request):
        call, job = await svc.start(request, AMessagesRequest, MessagesCall)
        parser, first = call.parser()
        head = call.head()
        if call.body.stream:
            return sse(_stream(job, parser, first, head["id"], svc.model_name, call.one_call), job)
        return call.answer(head, await collect(request, job, parser, first), job.request, job.generation)

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

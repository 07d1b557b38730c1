"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models (bodies checked and answers assembled by
hybridinfer.serving.protocol.openai; the streams are HTTP's own)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol.errors import ApiError
from ..protocol.models import ChatRequest, CompletionRequest
from ..protocol.openai import FINISH, ChatCall, CompletionCall, chat_logprobs, completion_logprobs, tool_json
from ..protocol.openai import usage as _usage_of
from .httpio import dumps, sse
from .service import Service, collect


def _usage(job) -> dict:
    return _usage_of(job.request, job.generation)


def router(svc: Service) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model(svc, n) for n in svc.model_names]}

    @r.get("/v1/models/{name:path}")
    async def model(name: str):
        svc.check_model(name)
        return _model(svc, name if name in svc.model_names else svc.model_name)

    @r.post("/v1/chat/completions")
    async def chat(request: Request):
        call, job = await svc.start(request, ChatRequest, ChatCall)
        parser, first = call.parser()
        head, body = call.head(), call.body
        if body.stream:
            usage_on = bool(body.stream_options and body.stream_options.include_usage)
            lp = _Logprobs(svc.engine, job) if call.n_logprobs is not None else None
            return sse(_chat_stream(job, parser, first, head, usage_on, call.one_call, lp), job)
        return call.answer(head, await collect(request, job, parser, first), job.request, job.generation)

    @r.post("/v1/completions")
    async def completions(request: Request):
        call, job = await svc.start(request, CompletionRequest, CompletionCall)
        head = call.head()
        if call.body.stream:
            usage_on = bool(call.body.stream_options and call.body.stream_options.include_usage)
            lp = _Logprobs(svc.engine, job) if call.n_logprobs is not None else None
            return sse(_completion_stream(job, head, usage_on, lp), job)
        return call.answer(head, await collect(request, job), job.request, job.generation)

    return r


def _model(svc: Service, name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "hybridinfer",
            "max_model_len": svc.engine.n_ctx}


def _error_event(e: BaseException) -> dict:
    err = e if isinstance(e, ApiError) else ApiError(500, f"generation failed: {type(e).__name__}: {e}")
    return {"data": dumps(err.openai_body())}


class _Logprobs:
    """The log-probabilities of a streamed job's tokens not sent yet: each chunk carries those made since the last
    (text held back for stop strings makes chunks and tokens line up only on the whole)."""

    def __init__(self, engine, job):
        self.engine, self.job, self.sent, self.text = engine, job, 0, 0

    def new(self) -> list:
        entries = self.job.generation.logprobs or []
        out, self.sent = entries[self.sent :], len(entries)
        return out

    def chat(self):
        return chat_logprobs(self.engine, self.new())

    def completion(self, text: str):
        lp = completion_logprobs(self.engine, self.new(), self.text)
        self.text += len(text)
        return lp


async def _chat_stream(job, parser, first, head, usage_on: bool, one_call: bool, lp: _Logprobs | None = None):
    base = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if usage_on else {}
    n_calls = 0

    def chunk(delta: dict, finish=None) -> dict:
        logprobs = lp.chat() if lp is not None and (delta.get("content") or finish) else None
        return {"data": dumps({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                     "finish_reason": finish}], **extra})}

    def deltas(events):
        nonlocal n_calls
        for kind, v in events:
            if kind == "text":
                yield chunk({"content": v})
            elif kind == "reasoning":
                yield chunk({"reasoning_content": v})
            elif not (one_call and n_calls):
                yield chunk({"tool_calls": [tool_json(v, n_calls)]})
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
    yield chunk({}, "tool_calls" if n_calls else FINISH[job.generation.finish_reason])
    if usage_on:
        yield {"data": dumps({**base, "choices": [], "usage": _usage(job)})}
    yield {"data": "[DONE]"}


async def _completion_stream(job, head, usage_on: bool, lp: _Logprobs | None = None):
    extra = {"usage": None} if usage_on else {}

    def chunk(text: str, finish=None) -> dict:
        logprobs = lp.completion(text) if lp is not None else None
        return {"data": dumps({**head, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                                     "finish_reason": finish}], **extra})}

    try:
        async for piece in job.pieces():
            yield chunk(piece)
    except Exception as e:  # noqa: BLE001 - the status is sent already: the error goes in the stream
        yield _error_event(e)
        yield {"data": "[DONE]"}
        return
    yield chunk("", FINISH[job.generation.finish_reason])
    if usage_on:
        yield {"data": dumps({**head, "choices": [], "usage": _usage(job)})}
    yield {"data": "[DONE]"}


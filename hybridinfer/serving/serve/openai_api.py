"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models (bodies checked and answers assembled by
hybridinfer.serving.protocol.openai; the streams are HTTP's own)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from ..protocol.errors import ApiError
from ..protocol.models import ChatRequest, CompletionRequest
from ..protocol.openai import FINISH, ChatCall, CompletionCall, chat_logprobs, completion_logprobs, tool_json
from ..protocol.openai import usage as _usage_of
from .httpio import dumps, sse
from .service import Jobs, Service, collect


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
        call, jobs = await svc.start_many(request, ChatRequest, ChatCall)
        head, body = call.head(), call.body
        if body.stream:
            usage_on = bool(body.stream_options and body.stream_options.include_usage)
            group = Jobs(jobs)
            choices = [_chat_choice(j, *call.parser(), head, usage_on, call.one_call,
                                    _Logprobs(svc.engine, j) if call.n_logprobs is not None else None, i)
                       for i, j in enumerate(jobs)]
            return sse(_chat_stream(jobs, choices, head, usage_on), group)
        events = await asyncio.gather(*(collect(request, j, *call.parser()) for j in jobs))
        answers = [call.answer(head, ev, j.request, j.generation) for ev, j in zip(events, jobs, strict=True)]
        return _merged(answers)

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
    # llama-server's capabilities: "multimodal" where the model takes images (loaded with --mmproj)
    return {"id": name, "object": "model", "created": 0, "owned_by": "hybridinfer",
            "max_model_len": svc.engine.n_ctx,
            "capabilities": ["completion", "multimodal"] if svc.takes_images() else ["completion"]}


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


def _merged(answers: list[dict]) -> dict:
    """One response of several choices' answers: their choices indexed in order, the prompt counted once."""
    out = answers[0]
    if len(answers) > 1:
        out["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
        completion = sum(a["usage"]["completion_tokens"] for a in answers)
        out["usage"] = {**out["usage"], "completion_tokens": completion,
                        "total_tokens": out["usage"]["prompt_tokens"] + completion}
    return out


async def _merge(streams):
    """The items of several async iterators as they come (each iterator's own order kept)."""
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def drain(it):
        try:
            async for x in it:
                await q.put((x, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which ends the stream with it
            await q.put((None, e))
        await q.put((end, None))

    tasks = [asyncio.ensure_future(drain(it)) for it in streams]
    try:
        left = len(tasks)
        while left:
            x, err = await q.get()
            if err is not None:
                raise err
            if x is end:
                left -= 1
            else:
                yield x
    finally:
        for t in tasks:
            t.cancel()


async def _chat_stream(jobs, choices, head, usage_on: bool):
    """Every choice's chunks as they come, then the usage chunk (only when asked for) and [DONE]."""
    base = {**head, "object": "chat.completion.chunk"}
    try:
        async for c in (_merge(choices) if len(choices) > 1 else choices[0]):
            yield c
    except Exception as e:  # noqa: BLE001 - the status is sent already: the error goes in the stream
        yield _error_event(e)
        yield {"data": "[DONE]"}
        return
    if usage_on:
        usage = _merged([{"choices": [{}], "usage": _usage(j)} for j in jobs])["usage"]
        yield {"data": dumps({**base, "choices": [], "usage": usage})}
    yield {"data": "[DONE]"}


async def _chat_choice(job, parser, first, head, usage_on: bool, one_call: bool, lp: _Logprobs | None = None,
                       index: int = 0):
    """One choice's chunks, from its role to its finish_reason."""
    base = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if usage_on else {}
    n_calls = 0

    def chunk(delta: dict, finish=None) -> dict:
        logprobs = lp.chat() if lp is not None and (delta.get("content") or finish) else None
        return {"data": dumps({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
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
    for c in deltas(first):
        yield c
    async for piece in job.pieces():
        for c in deltas(parser.feed(piece)):
            yield c
    for c in deltas(parser.finish()):
        yield c
    yield chunk({}, "tool_calls" if n_calls else FINISH[job.generation.finish_reason])


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


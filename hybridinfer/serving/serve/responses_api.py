"""OpenAI's /v1/responses route (bodies turned into chats and answers into output items by
hybridinfer.serving.protocol.responses), streamed as the Responses API's typed events: response.created, then per
output item output_item.added, its deltas (output_text, reasoning_text, function_call_arguments) and their .done
events, output_item.done, and response.completed (or response.incomplete) with the whole response."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol.errors import ApiError
from ..protocol.models import ResponsesRequest
from ..protocol.responses import ResponsesCall, ResponseStore, call_item, message_item, reasoning_item
from .httpio import dumps, sse
from .service import Service, collect


def router(svc: Service, store: ResponseStore | None = None) -> APIRouter:
    r = APIRouter()
    store = store if store is not None else ResponseStore()

    @r.post("/v1/responses")
    async def responses(request: Request):
        tenant = getattr(request.state, "tenant", None)
        call, job = await svc.start(request, ResponsesRequest, lambda ctx, body: ResponsesCall(ctx, body, store,
                                                                                             tenant))
        parser, first = call.parser()
        if call.body.stream:
            return sse(_stream(call, job, parser, first), job)
        return call.answer(await collect(request, job, parser, first), job.request, job.generation)

    return r


class _Events:
    """The typed events of one streamed response, numbered, with the output items they open and close."""

    def __init__(self, call: ResponsesCall):
        self.call, self.seq, self.output = call, 0, []
        self.open: dict | None = None  # the reasoning or message item receiving deltas
        self.text = ""
        self.n_calls = 0

    def ev(self, kind: str, **data) -> dict:
        self.seq += 1
        return {"event": kind, "data": dumps({"type": kind, "sequence_number": self.seq - 1, **data})}

    def close(self):
        item = self.open
        if item is None:
            return
        self.open, i, text = None, len(self.output) - 1, self.text
        where = {"item_id": item["id"], "output_index": i, "content_index": 0}
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            yield self.ev("response.output_text.done", **where, text=text)
            yield self.ev("response.content_part.done", **where, part=part)
            done = message_item(text, item["id"])
        else:
            yield self.ev("response.reasoning_text.done", **where, text=text)
            done = reasoning_item(text, item["id"])
        self.output[i] = done
        yield self.ev("response.output_item.done", output_index=i, item=done)

    def delta(self, kind: str, v: str):
        want = "message" if kind == "text" else "reasoning"
        if self.open is None or self.open["type"] != want:
            yield from self.close()
            item = message_item("", status="in_progress") if want == "message" else {
                **reasoning_item(""), "content": []}
            self.open, self.text = item, ""
            self.output.append(item)
            i = len(self.output) - 1
            yield self.ev("response.output_item.added", output_index=i, item=item)
            if want == "message":
                yield self.ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []})
        self.text += v
        where = {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}
        name = "response.output_text.delta" if want == "message" else "response.reasoning_text.delta"
        yield self.ev(name, **where, delta=v)

    def tool(self, call):
        if self.call.chat.one_call and self.n_calls:
            return
        self.n_calls += 1
        yield from self.close()
        item = call_item(call)
        i = len(self.output)
        self.output.append(item)
        yield self.ev("response.output_item.added", output_index=i, item={**item, "arguments": "",
                                                                          "status": "in_progress"})
        yield self.ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                      delta=item["arguments"])
        yield self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                      name=item["name"], arguments=item["arguments"])
        yield self.ev("response.output_item.done", output_index=i, item=item)

    def feed(self, events):
        for kind, v in events:
            yield from (self.tool(v) if kind == "tool" else self.delta(kind, v))


async def _stream(call: ResponsesCall, job, parser, first):
    e = _Events(call)
    resp = call.skeleton("in_progress")
    yield e.ev("response.created", response=resp)
    yield e.ev("response.in_progress", response=resp)
    try:
        for x in e.feed(first):
            yield x
        async for piece in job.pieces():
            for x in e.feed(parser.feed(piece)):
                yield x
        for x in e.feed(parser.finish()):
            yield x
        if not e.output:  # an empty answer is still one (empty) message, as the non-streamed one
            for x in e.delta("text", ""):
                yield x
        for x in e.close():
            yield x
    except Exception as err:  # noqa: BLE001 - the status is sent already: the error goes in the stream
        err = err if isinstance(err, ApiError) else ApiError(500, f"generation failed: {type(err).__name__}: {err}")
        yield e.ev("error", code=err.code, message=err.message, param=err.param)
        return
    final = call.finish({**resp, "output": e.output}, job.request, job.generation)
    yield e.ev("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)

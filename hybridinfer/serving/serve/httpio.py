"""Reading request bodies (size-bounded, validated) and writing server-sent events."""

from __future__ import annotations

import json

from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from ..protocol.context import validate
from ..protocol.errors import ApiError


async def read_body(request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes: by its Content-Length before reading, and while reading
    (a chunked body or a wrong header)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise ApiError(400, f"Content-Length is not a number: {declared!r}") from None
        if n > limit:
            raise ApiError(413, f"the body of {n} bytes exceeds the limit of {limit} bytes",
                           code="request_too_large")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise ApiError(413, f"the body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request, model: type[BaseModel], limit: int):
    raw = await read_body(request, limit)
    if not raw.strip():
        raise ApiError(400, "the body is empty; a JSON object is expected", code="invalid_json")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    return validate(model, obj)


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(events, job) -> EventSourceResponse:
    """An SSE response of an async iterator of dicts ({"data": str, "event": str?}). Pings keep idle
    connections (a long prefill) open through proxies. However the response ends, the job is cancelled after it
    (a stream closed before its first event never reaches the generator's own clean-up)."""
    return EventSourceResponse(events, sep="\n", ping=15, background=BackgroundTask(job.cancel),
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

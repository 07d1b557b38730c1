"""Reading request bodies (size-bounded) and writing server-sent events."""

from __future__ import annotations

import json

from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from ..protocol.errors import ApiError

# after a shutdown signal a stream has this long to send its error event and end before it is cut (uvicorn waits
# serve()'s timeout_graceful_shutdown, 5 s, for every connection)
SHUTDOWN_GRACE_S = 2.0


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


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(events, job) -> EventSourceResponse:
    """An SSE response of an async iterator of dicts ({"data": str, "event": str?}). Pings keep idle
    connections (a long prefill) open through proxies. However the response ends, the job is cancelled after it
    (a stream closed before its first event never reaches the generator's own clean-up). When the server shuts
    down (SIGTERM), `job.shutdown` is set: the job's pieces end in an error the stream sends before it closes."""
    return EventSourceResponse(events, sep="\n", ping=15, background=BackgroundTask(job.cancel),
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                               shutdown_event=job.shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)

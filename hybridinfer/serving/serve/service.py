"""What both APIs share: requests made on the engine, the bounded queue, and a Handle read from the event loop.

Handlers never touch a backend: they make a `Request` (in a worker thread: templates and tokenizing take time),
submit it to the engine's scheduler, and read the Handle's pieces through a thread of its own that hands them to
the event loop. Leaving the stream early (a client gone) cancels the sequence, which frees its state at the
scheduler's next step."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import anyio

from ...errors import HybridInferError
from ..protocol.context import Context, matched_stop, parse_events, usage_counts
from ..protocol.errors import ApiError, from_engine
from .metrics import Metrics

_DONE = object()


class Service(Context):
    """The engine, its model name and template (protocol.Context), and the bound on requests held at once."""

    def __init__(self, engine, model_name: str, max_queue: int, metrics: Metrics):
        super().__init__(engine, model_name)
        self.metrics = metrics
        self.scheduler = engine.scheduler
        self.limit = engine.max_seqs + max_queue  # requests held at once: running plus queued
        self._held = 0
        self._lock = threading.Lock()
        metrics.bind(self)

    @property
    def held(self) -> int:
        return self._held

    async def submit(self, build) -> Job:
        """Run `build()` (-> Request) off the event loop, then queue it, or refuse with 429 past the bound."""
        req = await anyio.to_thread.run_sync(build)
        with self._lock:
            if self._held >= self.limit:
                self.metrics.rejected.inc()
                raise ApiError(429, f"the server is busy: {self._held} requests running or queued (limit "
                                    f"{self.limit}); retry shortly", code="queue_full", headers={"Retry-After": "1"})
            self._held += 1
        try:
            handle = self.scheduler.submit(req)
        except HybridInferError as e:
            self._release()
            raise from_engine(e) from None
        except BaseException:
            self._release()
            raise
        return Job(self, handle, req)

    def _release(self) -> None:
        with self._lock:
            self._held -= 1


class Job:
    """One submitted request, read from the event loop: `async for piece in job.pieces()`; then `generation`."""

    def __init__(self, service: Service, handle, req):
        self.service, self.handle, self.request = service, handle, req
        self.t0 = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        self._q: asyncio.Queue = asyncio.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=self._pump, name="hybridinfer-serve-pump", daemon=True).start()

    def _put(self, item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed (server shutting down): nobody reads
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)

    def _pump(self) -> None:
        try:
            for piece in self.handle:
                self._put(piece)
        except BaseException as e:  # noqa: BLE001 - the sequence's error goes to its client
            self._error = e
        finally:
            # the slot is held until the scheduler is done with the sequence, not until the client is
            self.service._release()
            self.service.metrics.finished(self)
            self._put(_DONE)

    async def pieces(self):
        m = self.service.metrics
        last = None
        try:
            while True:
                item = await self._q.get()
                if item is _DONE:
                    break
                now = time.perf_counter()
                if last is None:
                    m.ttft.observe(now - self.t0)
                else:
                    m.itl.observe(now - last)
                last = now
                yield item
        finally:
            if not self.handle.done():
                self.handle.cancel()
        if self._error is not None:
            if isinstance(self._error, HybridInferError):
                raise from_engine(self._error)
            raise self._error

    def cancel(self) -> None:
        if not self.handle.done():
            self.handle.cancel()

    @property
    def generation(self):
        return self.handle.generation

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, prompt tokens restored from the prefix cache)."""
        return usage_counts(self.request, self.handle.generation)

    def matched_stop(self) -> str | None:
        return matched_stop(self.service.engine, self.request, self.handle.generation)


async def watch_disconnect(request, job: Job, every_s: float = 0.25) -> None:
    """Cancel `job` when the client of a non-streaming request goes away (run as a task beside the reading)."""
    while not job.handle.done():
        if await request.is_disconnected():
            job.cancel()
            return
        await asyncio.sleep(every_s)


async def collect(request, job: Job, parser=None, first=()) -> list:
    """A non-streaming answer's events (the parser's, or ("text", piece) without one); the job is cancelled if
    the client goes away meanwhile."""
    pieces = []
    watcher = asyncio.create_task(watch_disconnect(request, job))
    try:
        async for piece in job.pieces():
            pieces.append(piece)
    finally:
        watcher.cancel()
    return parse_events(parser, first, pieces)

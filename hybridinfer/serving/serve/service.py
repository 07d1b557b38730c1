"""What both APIs share: requests made on the engine, the bounded queue, and a Handle read from the event loop.

A request's body is read (at most max_body bytes), then it takes a slot (a 429 when `limit` requests are held
already), so all the CPU work it costs is bounded by the queue: its body is parsed and checked, and its prompt
rendered and tokenized, in a pool of `render_threads` threads (a hostile body's work happens a few at a time,
never 40 at once on anyio's default pool); then it is submitted to the engine's scheduler, and a thread of its own
hands the Handle's pieces to the event loop. Leaving the stream early (a client gone) cancels the sequence, which
frees its state at the scheduler's next step; the slot is freed when the scheduler is done with it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import anyio

from ...errors import HybridInferError
from ..protocol.context import Context, matched_stop, parse_events, usage_counts, validate
from ..protocol.errors import ApiError, from_engine
from .httpio import read_body
from .metrics import Metrics

_DONE = object()
_SHUTDOWN = object()
# positions of every kept state's K/V written before the first request (Engine.warm_states): a 2,000-token shared
# system prompt's restore then writes warm pages
WARM_ROWS = 2048
DEFAULT_RENDER_THREADS = 2  # parsing, rendering and tokenizing are CPU-bound Python: more threads add only memory


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class Slot:
    """One of the `limit` requests a Service holds at once; released once, by whoever holds it last."""

    def __init__(self, service: Service):
        self.service, self.held = service, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.service._release()


class Service(Context):
    """The engine, its model name and template (protocol.Context), and the bound on requests held at once.
    report_cached: usage reports the prompt tokens restored from the prefix cache (off where clients share a cache
    and must not learn of each other's prompts)."""

    def __init__(self, engine, model_name, max_queue: int, metrics: Metrics, max_body: int,
                 render_threads: int = DEFAULT_RENDER_THREADS, report_cached: bool = True,
                 strict_model_name: bool = False):
        super().__init__(engine, model_name, strict_model_name)
        self.metrics, self.max_body, self.report_cached = metrics, max_body, report_cached
        self.scheduler = engine.scheduler
        engine.warm_states(min(engine.n_ctx, WARM_ROWS))
        self.limit = engine.max_seqs + max_queue  # requests held at once: running plus queued
        self.render_threads = render_threads
        self._held = 0
        self._lock = threading.Lock()
        self._limiter: anyio.CapacityLimiter | None = None  # made in the event loop, at first use
        metrics.bind(self)

    @property
    def held(self) -> int:
        return self._held

    def _busy(self) -> ApiError:
        self.metrics.rejected.inc()
        return ApiError(429, f"the server is busy: {self._held} requests running or queued (limit {self.limit}); "
                             f"retry shortly", code="queue_full", headers={"Retry-After": "1"})

    def reserve(self) -> Slot:
        """A slot for one request, or the 429 that says the server is full."""
        with self._lock:
            if self._held >= self.limit:
                raise self._busy()
            self._held += 1
        return Slot(self)

    def _release(self) -> None:
        with self._lock:
            self._held -= 1

    async def run(self, fn):
        """`fn()` in the bounded pool of render threads (off the event loop)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.render_threads)
        return await anyio.to_thread.run_sync(fn, limiter=self._limiter)

    async def _read(self, request) -> bytes:
        """The body's bytes (at most max_body). Read before a slot is taken (a client that sends its body slowly
        holds a connection, not a place in the queue), after a first look that the server is not full."""
        if self._held >= self.limit:
            raise self._busy()
        raw = await read_body(request, self.max_body)
        if not raw.strip():
            raise ApiError(400, "the body is empty; a JSON object is expected", code="invalid_json")
        return raw

    @staticmethod
    def _decode(raw: bytes, model):
        try:
            obj = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        return validate(model, obj, raw)

    async def start(self, request, model, make_call):
        """The body read, a slot taken, then in the render pool the body decoded as `model`, `make_call(self,
        body)` (its checks) and its Request built; then submitted: (call, Job). The slot goes with the Job, or back
        at once when anything fails."""
        call, jobs = await self.start_many(request, model, make_call)
        return call, jobs[0]

    async def start_many(self, request, model, make_call):
        """As start, for a call of `call.n` choices (one Request each: `call.fork(req, i)` makes the others, which
        the scheduler queues together, so with a prefix cache the prompt is prefilled once and the others restore
        it): (call, [Job]). Each job holds a slot of its own."""
        raw = await self._read(request)
        slots = [self.reserve()]
        try:
            tenant = getattr(request.state, "tenant", None)

            def build():
                call = make_call(self, self._decode(raw, model))
                reqs = [call.build()]
                reqs += [call.fork(reqs[0], i) for i in range(1, getattr(call, "n", 1))]
                for req in reqs:
                    if tenant is not None:
                        req.cache_salt = tenant  # prefix-cache snapshots of one API key are never another's
                return call, reqs

            call, reqs = await self.run(build)
            slots += [self.reserve() for _ in reqs[1:]]
            try:
                handles = self.scheduler.submit_many(reqs) if len(reqs) > 1 else [self.scheduler.submit(reqs[0])]
            except HybridInferError as e:
                raise from_engine(e) from None
            return call, [Job(self, h, r, s) for h, r, s in zip(handles, reqs, slots, strict=True)]
        except BaseException:
            for s in slots:
                s.release()
            raise

    async def bounded(self, request, model, work):
        """`work(body)` in the render pool under a slot of its own, for answers made without the scheduler
        (count_tokens): bounded like the requests that queue."""
        raw = await self._read(request)
        slot = self.reserve()
        try:
            return await self.run(lambda: work(self._decode(raw, model)))
        finally:
            slot.release()


class Jobs:
    """The jobs of one answer's choices, as the SSE response takes one job: cancelled together, shut down
    together."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self.shutdown = anyio.Event()
        for j in jobs:
            j.shutdown = self.shutdown

    def cancel(self) -> None:
        for j in self.jobs:
            j.cancel()


class Job:
    """One submitted request, read from the event loop: `async for piece in job.pieces()`; then `generation`."""

    def __init__(self, service: Service, handle, req, slot: Slot):
        self.service, self.handle, self.request, self.slot = service, handle, req, slot
        self.t0 = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        self._q: asyncio.Queue = asyncio.Queue()
        self._error: BaseException | None = None
        self.shutdown = anyio.Event()  # set by the SSE response when the server shuts down
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
            svc = self.service
            timings = self.handle.generation.timings
            if not svc.report_cached and timings:
                timings["reused_tokens"] = 0  # the usage and metrics say nothing of other clients' prompts
            # the slot is held until the scheduler is done with the sequence, not until the client is
            self.slot.release()
            svc.metrics.finished(self)
            self._put(_DONE)

    async def _relay_shutdown(self) -> None:
        await self.shutdown.wait()
        self._q.put_nowait(_SHUTDOWN)

    async def pieces(self):
        m = self.service.metrics
        last = None
        relay = asyncio.ensure_future(self._relay_shutdown())
        try:
            while True:
                item = await self._q.get()
                if item is _DONE:
                    break
                if item is _SHUTDOWN:
                    raise ApiError(503, "the server is shutting down: the answer ends here, unfinished",
                                   code="server_shutting_down")
                now = time.perf_counter()
                if last is None:
                    m.ttft.observe(now - self.t0)
                else:
                    m.itl.observe(now - last)
                last = now
                yield item
        finally:
            relay.cancel()
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

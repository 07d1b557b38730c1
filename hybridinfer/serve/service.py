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

from ..errors import HybridInferError
from .errors import ApiError, from_engine, unsupported
from .metrics import Metrics
from .prompt import TemplateInfo

_DONE = object()


class Service:
    def __init__(self, engine, model_name: str, max_queue: int, metrics: Metrics):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.info = TemplateInfo.probe(engine)
        self.scheduler = engine.scheduler
        self.limit = engine.max_seqs + max_queue  # requests held at once: running plus queued
        self._held = 0
        self._lock = threading.Lock()
        metrics.bind(self)

    @property
    def held(self) -> int:
        return self._held

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def make_request(self, prompt, max_tokens: int | None, sampling: dict, stop, turn_boundary=None):
        """A checked Request (prompt: text or token ids). max_tokens None: the rest of the context."""
        eng = self.engine
        try:
            if max_tokens is None:
                n = len(prompt) if isinstance(prompt, list) else len(eng.tokenize(prompt))
                if n >= eng.n_ctx:
                    raise ApiError(400, f"the prompt of {n} tokens does not fit the context of n_ctx={eng.n_ctx} "
                                        f"tokens", param="messages", code="context_length_exceeded")
                max_tokens = eng.n_ctx - n
            req = eng.make_request(prompt, max_tokens, stop=stop, **sampling)
        except HybridInferError as e:
            raise from_engine(e) from None
        if turn_boundary is not None:
            req.turn_boundary = turn_boundary
        return req

    def check_schema(self, response_format: dict | None) -> dict | None:
        """The JSON schema a request's output must follow, or None (a 400 for a schema it cannot compile)."""
        from .grammar import schema_of

        return schema_of(response_format)

    def constrain(self, req, schema: dict | None):
        """Attach the grammar of `schema` to `req` (the scheduler masks its logits each step)."""
        if schema is not None:
            from .grammar import JsonConstraint

            req.constraint = JsonConstraint(self.engine, schema)
        return req

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
        g = self.handle.generation
        return len(self.request.ids), len(g.tokens), int(g.timings.get("reused_tokens", 0))

    def matched_stop(self) -> str | None:
        """The stop string that ended the sequence, if one did (the Generation says "stop" for EOS as well)."""
        g, stops = self.handle.generation, self.request.stops
        if g.finish_reason != "stop" or not stops or self.service.engine.tokenizer is None:
            return None
        full = self.service.engine.detokenize(g.tokens)
        hits = [(full.find(s), s) for s in stops if s in full]
        return min(hits)[1] if hits else None


def sampling_args(body, *, penalties: bool = True) -> dict:
    """The engine's sampling keywords of a request body; what a body leaves out keeps the engine's default."""
    out = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        v = getattr(body, name, None)
        if v is not None:
            out[name] = v
    if penalties:
        if body.presence_penalty is not None:
            out["presence_penalty"] = body.presence_penalty
        if body.repeat_penalty is not None:
            out["repeat_penalty"] = body.repeat_penalty
        if body.frequency_penalty:  # the sampler has presence and repetition penalties, no per-count one
            raise unsupported("frequency_penalty", body.frequency_penalty)
    return out


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
    events = list(first)
    watcher = asyncio.create_task(watch_disconnect(request, job))
    try:
        async for piece in job.pieces():
            events += parser.feed(piece) if parser is not None else [("text", piece)]
    finally:
        watcher.cancel()
    return events + (parser.finish() if parser is not None else [])

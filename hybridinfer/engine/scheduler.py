"""Many sequences at once on one Engine: continuous batching.

One worker thread owns the compute. Callers `submit` requests from any thread and get a `Handle` that yields text
pieces as they are made, `cancel()`s, or waits for the `result()`. Each step the worker admits waiting requests
while `max_seqs` and the state budget allow (their prompts prefilled, restoring cached prefixes), samples one token
for every running sequence, and runs one decode step for all of them together (`Backend.decode_batch`: each weight
byte read once per step serves every sequence). A sequence's tokens do not depend on which others share its steps
(batch invariance), so a request gives the same answer here as through `Engine.generate`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import CapacityError, ParameterError
from .sampling import SamplingParams
from .textstream import Generation, TextStream, token_logprobs

_END = object()


MIN_SHARED_PREFIX = 16  # tokens: a shorter common prefix is not worth a snapshot of the whole state


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def shared_points(ids: list[int], others: list[list[int]], min_len: int = MIN_SHARED_PREFIX) -> set[int]:
    """Positions where `ids` parts ways with prompts queued after it (at least `min_len` tokens in): the prefill of
    `ids` snapshots there, so those prompts restore the shared prefix instead of processing it again."""
    return {p for p in (common_prefix(ids, o) for o in others) if p >= min_len}


def state_bytes(args, n_tokens: int) -> int:
    """Bytes of one sequence's state holding `n_tokens` tokens: its recurrent buffers (GDN conv and S) and its K/V
    rows (float32), the memory the state budget counts."""
    n = 0
    for kind in args.layer_types:
        if kind == "gdn":
            n += (args.ssm_conv_kernel - 1) * args.ssm_conv_channels + args.ssm_n_v_heads * args.ssm_d_k * args.ssm_d_v
        else:
            n += 2 * n_tokens * args.n_head_kv * args.head_dim
    return 4 * n


@dataclass
class Request:
    """A prompt made into token ids, with everything that decides its tokens."""

    ids: list[int]
    params: SamplingParams
    max_tokens: int
    stops: list[str]
    # chat prompts: where the history (before the generation prompt) and the leading system messages end, the
    # positions a next turn or another conversation shares (an int or a tuple of them)
    turn_boundary: int | tuple[int, ...] | None = None
    # structured output: mask(logits) sets the logits of tokens it forbids next to -inf in place, accept(token)
    # advances it by the sampled token (hybridinfer.serving.protocol.grammar.JsonConstraint)
    constraint: object | None = None
    logprobs: int | None = None  # also record each token's log-probability and this many alternatives
    # with a prefix cache: snapshots at the end of the prompt and of the reply (for a next turn); a batch job's
    # requests have no next turn, so it turns them off (the shared prefixes are still saved)
    keep_ends: bool = True


class TokenSampler:
    """One sequence's choice of each next token: the request's constraint, the numba sampler (its own rng and
    scratch), logprobs and text. Engine.stream and the scheduler both sample through it, so a request gives the same
    tokens through either."""

    def __init__(self, req: Request, tokenizer, generation: Generation, n_vocab: int):
        from .sampling import SampleScratch, rng_new

        self.req, self.gen = req, generation
        self.text = TextStream(tokenizer, req.stops, generation)
        self.scratch, self.rng = SampleScratch(n_vocab), rng_new(req.params.seed)

    def __call__(self, logits: np.ndarray, state) -> tuple[int, str, bool]:
        """(token, text safe to emit, ended) for the sequence in `state` with these next-token logits (a
        constraint masks them in place). ended: an end-of-generation token, a stop string or max_tokens."""
        from .sampling import sample

        req, p, g = self.req, self.req.params, self.gen
        raw = logits.copy() if req.logprobs is not None and req.constraint is not None else logits
        if req.constraint is not None:
            req.constraint.mask(logits)
        t = int(sample(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.presence_penalty,
                       p.frequency_penalty, state.tokens, state.pos, p.repeat_last_n, self.rng, self.scratch.xs,
                       self.scratch.idx))
        if req.logprobs is not None and t not in self.text.stop_ids:
            if g.logprobs is None:
                g.logprobs = []
            g.logprobs.append(token_logprobs(raw, t, req.logprobs))
        piece, ended = self.text.push(t)
        if req.constraint is not None and not ended:
            req.constraint.accept(t)
        return t, piece, ended or len(g.tokens) >= req.max_tokens


class Handle:
    """A submitted request: iterate it for its text pieces, `result()` for the whole Generation, `cancel()`."""

    def __init__(self, sched: Scheduler, req: Request):
        self._sched, self.request = sched, req
        self._pieces: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self.generation = Generation("", [], len(req.ids), "length")
        self.error: BaseException | None = None
        self.cancelled = False

    def __iter__(self):
        while True:
            p = self._pieces.get()
            if p is _END:
                break
            yield p
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Stop the sequence at the next step; its state is freed there and its result says "cancelled"."""
        self.cancelled = True
        self._sched._wake()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Generation:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.generation

    def _put(self, piece: str) -> None:
        if piece:
            self._pieces.put(piece)

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._pieces.put(_END)
        self._done.set()


@dataclass(eq=False)
class _Seq:
    handle: Handle
    state: object = None
    logits: np.ndarray | None = None
    sampler: TokenSampler | None = None
    reserved: int = 0
    next_tok: int = -1
    t0: float = 0.0
    t1: float = 0.0
    stats: dict = field(default_factory=dict)
    freed: bool = False  # its handle answered and its reservation returned


class Scheduler:
    """Continuous batching over one Engine. max_seqs (default 8): sequences decoded together at most.
    state_budget (default None: no limit): bytes of states (recurrent buffers and K/V rows up to prompt +
    max_tokens) held at once; a request that could never fit (alone over the budget) is refused at `submit` with a
    CapacityError, others wait. worker (default True): a worker thread runs the steps; False: no thread, the caller
    drives `step()` (tests, or a loop of its own)."""

    def __init__(self, engine, max_seqs: int = 8, state_budget: int | None = None, worker: bool = True):
        if type(max_seqs) is not int or max_seqs < 1:
            raise ParameterError(f"max_seqs must be a whole number >= 1, got {max_seqs!r}")
        if state_budget is not None and (type(state_budget) is not int or state_budget < 1):
            raise ParameterError(f"state_budget must be a whole number of bytes >= 1 or None, got {state_budget!r}")
        self.engine, self.max_seqs, self.state_budget = engine, max_seqs, state_budget
        self._cv = threading.Condition()
        self._waiting: deque[Handle] = deque()
        self._running: list[_Seq] = []
        self._admitted: list[_Seq] = []  # admitted by the step under way (not yet running)
        self._reserved = 0
        self._thread: threading.Thread | None = None
        self._worker = worker
        self._closed = False
        self.peak_reserved = 0  # the most state bytes held at once
        self.peak_running = 0
        self.steps = 0

    # submission -----------------------------------------------------------------------------------
    def submit(self, req: Request) -> Handle:
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list[Request]) -> list[Handle]:
        """Queue several requests at once: the worker sees them together, so prompts that share a prefix find
        each other at admission. Each is checked first; one that could never fit refuses them all."""
        for req in reqs:
            need = self.request_bytes(req)
            if self.state_budget is not None and need > self.state_budget:
                raise CapacityError(f"a request of {len(req.ids)} prompt tokens + max_tokens {req.max_tokens} needs "
                                    f"{need} bytes of state, more than the state budget of {self.state_budget} bytes")
        hs = [Handle(self, req) for req in reqs]
        with self._cv:
            if self._closed:
                raise CapacityError("the scheduler is closed")
            self._waiting.extend(hs)
            if self._thread is None and self._worker:
                self._thread = threading.Thread(target=self._loop, name="hybridinfer-scheduler", daemon=True)
                self._thread.start()
            self._cv.notify()
        return hs

    def request_bytes(self, req: Request) -> int:
        return state_bytes(self.engine.args, min(len(req.ids) + req.max_tokens, self.engine.n_ctx))

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        """Cancel everything and stop the worker."""
        with self._cv:
            self._closed = True
            for h in self._waiting:
                h.cancelled = True
            for s in self._running:
                s.handle.cancelled = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # the worker -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._running and not self._closed:
                    self._cv.wait()
                if self._closed and not self._waiting and not self._running:
                    return
            try:
                self.step()
            except BaseException:  # noqa: BLE001 - step() gave the error to every sequence it held
                pass

    def idle(self) -> bool:
        return not self._waiting and not self._running

    def step(self) -> None:
        """Admit what fits, then one token for every running sequence.

        A failure belongs to its sequence: an exception in one sequence's prefill, sampler, constraint, text or
        snapshot ends that sequence with the error (its handle raises it, its state and bytes are freed at once)
        and the others go on; a failed batched decode ends exactly the sequences in it. Anything else raised here
        (a bug of the step itself) is given to every sequence the step held, then re-raised: no admitted sequence
        is ever left unanswered or holding its reservation."""
        with self.engine._lock:
            try:
                self._drop_cancelled()
                self._step()
            except BaseException as e:
                self._fail_all(e)
                raise
            finally:
                self._admitted = []

    def _step(self) -> None:
        eng = self.engine
        self._admitted = new = self._admit()
        self.peak_running = max(self.peak_running, len(self._running) + len(new))
        with self._cv:
            queued = [h.request.ids for h in self._waiting]
        started = self._start(new, queued)  # each sampled once already, as soon as its own prefill ended
        self._running = self._decode([s for s in self._running if self._advance(s)] + started)
        self.steps += 1
        if eng.prefix_cache is not None:
            self._flush_cache()

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [h for h in self._waiting if h.cancelled]
            for h in gone:
                self._waiting.remove(h)
        for h in gone:
            h.generation.finish_reason = "cancelled"
            h._finish()
        keep = []
        for s in self._running:
            if s.handle.cancelled:
                s.handle.generation.finish_reason = "cancelled"
                self._end(s)
            else:
                keep.append(s)
        self._running = keep

    def _admit(self) -> list[_Seq]:
        out = []
        with self._cv:
            while self._waiting and len(self._running) + len(out) < self.max_seqs:
                h = self._waiting[0]
                need = self.request_bytes(h.request)
                if self.state_budget is not None and self._reserved + need > self.state_budget:
                    break  # first come, first served: it waits for memory rather than being overtaken
                self._waiting.popleft()
                self._reserved += need
                self.peak_reserved = max(self.peak_reserved, self._reserved)
                out.append(_Seq(h, reserved=need))
        return out

    def _start(self, new: list[_Seq], queued: list[list[int]]) -> list[_Seq]:
        """Prefill the newly admitted sequences and sample each one's first token; returns those that go on.
        A single-pass backend (the GPU) takes them in one pass; otherwise each is prefilled in turn and its first
        token goes out at once, so the time to first token of one admitted beside others is its own prefill and
        those before it, not all of theirs. One whose prefill fails gets its error, the others go on."""
        eng = self.engine
        items = []  # (sequence, _start's arguments after the state)
        for j, s in enumerate(new):
            req = s.handle.request
            later = [t.handle.request.ids for t in new[j + 1 :]] + queued
            s.t0 = time.perf_counter()
            try:
                s.state = eng.new_state()
            except Exception as e:  # noqa: BLE001 - e.g. no memory for it: this request's error
                self._fail(s, e)
                continue
            items.append((s, (req.turn_boundary, shared_points(req.ids, later) if eng.prefix_cache else (),
                              req.keep_ends)))
        if eng.backend.single_pass and len(items) > 1:
            got = self._prefill_together(items)
            if got is not None:
                return [s for (s, _), g in zip(items, got, strict=True) if self._first(s, g)]
        return [s for s, rest in items if self._first(s, self._prefill_alone(s, rest))]

    def _prefill_alone(self, s: _Seq, rest):
        """Engine._start of one sequence: (logits, stats), or the exception it raised."""
        try:
            return self.engine._start(s.handle.request.ids, s.state, *rest)
        except Exception as e:  # noqa: BLE001 - its own caller gets it
            return e

    def _prefill_together(self, items):
        """Engine._start_many of several sequences, or None when that pass failed: the pass is shared, so whose
        fault it was is unknown; each sequence then gets a fresh state to be prefilled alone (its own error, if
        it fails again, goes to its own caller)."""
        eng = self.engine
        try:
            return eng._start_many([(s.handle.request.ids, s.state, *rest) for s, rest in items])
        except Exception:  # noqa: BLE001
            for s, _ in items:
                eng.backend.release(s.state)
                s.state = eng.new_state()
            return None

    def _first(self, s: _Seq, got) -> bool:
        """A started sequence's first token: False when it has ended (a failed prefill included), True when it
        goes on to the decode step."""
        if isinstance(got, BaseException):
            self._fail(s, got)
            return False
        try:
            s.logits, s.stats = np.array(got[0], copy=True), got[1]
            s.t1 = time.perf_counter()
            s.sampler = TokenSampler(s.handle.request, self.engine.tokenizer, s.handle.generation,
                                     s.logits.shape[-1])
        except Exception as e:  # noqa: BLE001
            self._fail(s, e)
            return False
        return self._advance(s)

    def _advance(self, s: _Seq) -> bool:
        """Sample the next token of `s`: True when it goes on; else it has ended (finished, or failed with its
        error) and is released."""
        try:
            if self._sample(s):
                return True
        except Exception as e:  # noqa: BLE001 - the sampler, the constraint or the text of this sequence alone
            self._fail(s, e)
            return False
        self._end(s)
        return False

    def _sample(self, s: _Seq) -> bool:
        """Sample the next token of `s` from its logits; False when the sequence has ended. A token that goes on
        is kept for the decode step."""
        if len(s.handle.generation.tokens) >= s.handle.request.max_tokens:
            return False
        t, piece, ended = s.sampler(s.logits, s.state)
        s.handle._put(piece)
        if ended:
            return False
        s.next_tok = t
        return True

    def _decode(self, go: list[_Seq]) -> list[_Seq]:
        """One batched decode step for `go`; returns those still running: all of them, or none when the step
        failed (each then gets the error: it is theirs together)."""
        if not go:
            return go
        try:
            lg = self.engine.backend.decode_batch([s.next_tok for s in go], [s.state for s in go])
            for j, s in enumerate(go):
                s.logits = np.array(lg[j], copy=True)
        except Exception as e:  # noqa: BLE001
            for s in go:
                self._fail(s, e)
            return []
        return go

    def _flush_cache(self) -> None:
        """The prefix cache's deferred disk copies. They belong to no sequence (each answer is out already), so a
        failure here is a warning, not an error of any request."""
        try:
            self.engine.prefix_cache.flush()
        except Exception as e:  # noqa: BLE001
            import warnings

            from .prefix import SnapshotWarning

            warnings.warn(f"prefix cache: writing snapshots to disk failed: {e}", SnapshotWarning, stacklevel=2)

    # ending a sequence ----------------------------------------------------------------------------
    def _end(self, s: _Seq) -> None:
        """A sequence that ended normally (or was cancelled): its last text, its end-of-reply snapshot and its
        timings, then its release; an exception in any of them makes it fail with that error instead."""
        try:
            self._complete(s)
        except Exception as e:  # noqa: BLE001
            self._fail(s, e)
            return
        self._free(s)

    def _complete(self, s: _Seq) -> None:
        g = s.handle.generation
        if s.sampler is None:
            return
        s.handle._put(s.sampler.text.finish())
        eng = self.engine
        if (eng.prefix_cache is not None and s.state is not None and s.handle.request.keep_ends
                and s.state.pos > len(s.handle.request.ids)):
            eng.prefix_cache.save(s.state, s.logits, defer_disk=True)  # the next turn starts from the reply
        t2 = time.perf_counter()
        n = max(len(g.tokens), 1)
        g.timings = {**s.stats, "prefill_s": s.t1 - s.t0, "decode_s": t2 - s.t1,
                     "prompt_tok_per_s": len(s.handle.request.ids) / max(s.t1 - s.t0, 1e-9),
                     "decode_tok_per_s": n / (t2 - s.t1) if t2 > s.t1 else 0.0}

    def _fail(self, s: _Seq, error: BaseException) -> None:
        """End `s` with `error` (its handle raises it); its state and reserved bytes go now."""
        self._free(s, error)

    def _fail_all(self, error: BaseException) -> None:
        """Every sequence this scheduler holds (running, or admitted in the step that failed) ends with `error`."""
        held, self._running = self._running + self._admitted, []
        for s in held:
            self._free(s, error)

    def _free(self, s: _Seq, error: BaseException | None = None) -> None:
        """Release the sequence's state and reserved bytes and answer its handle, once: a sequence already freed is
        left as it is. A backend that fails to release the state makes that the sequence's error."""
        if s.freed:
            return
        s.freed = True
        try:
            if s.state is not None:
                self.engine.backend.release(s.state)
        except Exception as e:  # noqa: BLE001
            error = error or e
        s.state, s.logits, s.sampler = None, None, None  # the memory goes now, not when the handle does
        with self._cv:
            self._reserved -= s.reserved
            s.reserved = 0
        s.handle._finish(error)

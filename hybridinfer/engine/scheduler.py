"""Many sequences at once on one Engine: continuous batching with chunked prefill. The only path to compute.

One worker thread owns the compute. Callers `submit` requests from any thread (Engine.generate, stream, submit and
generate_batch all do) and get a `Handle` that yields text pieces as they are made, `cancel()`s, or waits for the
`result()`. Each step, under the engine's lock, the worker
1. admits waiting requests while `max_seqs` and the state budget allow, restoring each one's longest cached prefix
   (`Engine.restore`);
2. samples the next token of every running sequence;
3. spends what is left of `step_tokens` (the step's token budget, less one token per running sequence, and while
   any decode no more than STALL decode steps' time, each chunk priced by its place in its prompt: `compute.
   prompt_budget`, `chunk_cost.ChunkCost`) on chunks
   of the admitted prompts, oldest first, several prompts' chunks in one pass whose products they share
   (`Engine.prefill_steps`; a chunk ends at the next snapshot position). A prompt whose prefill ends samples its
   first token in the same step. A single-pass backend (the GPU) takes the admitted prompts in one streamed pass
   (`Engine.prefill_whole`): whole while nothing decodes, else as many tokens as the card computes in the time the
   pass's weight stream takes anyway (`compute.pass_tokens`), so running streams wait one pass at a time;
4. decodes one token of every running sequence together (`Engine.decode_step`: each weight byte read once per
   step serves every sequence).
So a long prompt holds running streams up by one step's budget at a time, never by its whole prefill. A sequence's
tokens and logits do not depend on which others share its steps nor on how its prompt was cut into chunks (batch
and chunk invariance on the CPU: docs/numerics.md), so a request gives the same answer whatever else runs.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import CapacityError, EngineClosed, ParameterError
from ..models.state_kinds import state_bytes
from .chunk_cost import ChunkCost, size_chunk
from .compute import DEFAULT_STEP_TOKENS, MIN_PROMPT_TOKENS, ema, pass_tokens, prompt_budget
from .prefix.index import MIN_SHARED_PREFIX, common_prefix, shared_points
from .request import Handle, Request, TokenSampler
from .worker import work

__all__ = ["DEFAULT_STEP_TOKENS", "Handle", "Request", "Scheduler", "TokenSampler", "state_bytes"]


@dataclass(eq=False)
class _Seq:
    handle: Handle
    state: object = None
    logits: np.ndarray | None = None
    work: object = None  # Engine.restore's PromptWork: what is left of its prompt to prefill
    sampler: TokenSampler | None = None
    reserved: int = 0
    next_tok: int = -1
    t0: float = 0.0
    t1: float = 0.0
    stats: dict = field(default_factory=dict)
    freed: bool = False  # its handle answered and its reservation returned
    restored: bool = False  # its state made and its cached prefix restored (Engine.restore)
    pending: int | None = None  # a token sampled at a rejected draft (spec.py): the next one fed, not sampled again
    spec: object = None  # its drafting (spec.SeqSpec)


class Scheduler:
    """Continuous batching over one Engine. max_seqs (default 8): sequences admitted at once at most (prefilling or
    decoding). state_budget (default None: no limit): bytes of states (recurrent buffers and K/V rows up to prompt +
    max_tokens) held at once; a request that could never fit (alone over the budget) is refused at `submit` with a
    CapacityError, others wait. worker (default True): a worker thread runs the steps; False: no thread, the caller
    drives `step()` (tests, or a loop of its own). step_tokens (default 256): the tokens one step computes, decode
    tokens first, then prompt chunks."""

    def __init__(self, engine, max_seqs: int = 8, state_budget: int | None = None, worker: bool = True,
                 step_tokens: int = DEFAULT_STEP_TOKENS):
        if type(max_seqs) is not int or max_seqs < 1:
            raise ParameterError(f"max_seqs must be a whole number >= 1, got {max_seqs!r}")
        if state_budget is not None and (type(state_budget) is not int or state_budget < 1):
            raise ParameterError(f"state_budget must be a whole number of bytes >= 1 or None, got {state_budget!r}")
        if type(step_tokens) is not int or step_tokens < 1:
            raise ParameterError(f"step_tokens must be a whole number >= 1, got {step_tokens!r}")
        self.engine, self.max_seqs, self.state_budget = engine, max_seqs, state_budget
        self.step_tokens = step_tokens
        # measured: a decode step's seconds, and what prompt chunks cost by their length and position (a step's
        # chunks are sized by them: prompt_budget, ChunkCost.tokens_within)
        self._decode_s: float | None = None
        self._restore_s: float | None = None  # a restore's seconds, lately
        self._save_s: float | None = None  # a snapshot's seconds at a chunk's end, lately
        self._cost = ChunkCost()
        self._cv = threading.Condition()
        self._waiting: deque[Handle] = deque()
        self._running: list[_Seq] = []  # decoding
        self._prefilling: list[_Seq] = []  # admitted, their prompts not yet all prefilled
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
                raise EngineClosed("the engine is closed (Engine.close was called): no request is taken")
            self._waiting.extend(hs)
            if self._thread is None and self._worker:
                self._thread = threading.Thread(target=work, args=(weakref.ref(self), self._cv),
                                                name="hybridinfer-scheduler", daemon=True)
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
        """Sequences admitted (prefilling their prompt or decoding)."""
        return len(self._running) + len(self._prefilling)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop the worker after its step under way; every request still queued or admitted ends with
        EngineClosed (its handle raises it), and later submits are refused with it."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)
        if thread is None or not thread.is_alive():
            self._shutdown()

    def _shutdown(self) -> None:
        with self.engine.lock:
            with self._cv:
                gone = list(self._waiting)
                self._waiting.clear()
            for h in gone:
                h._finish(EngineClosed("the engine was closed before this request was admitted"))
            held, self._running, self._prefilling = self._running + self._prefilling, [], []
            for s in held:
                self._free(s, EngineClosed("the engine was closed while this request ran"))

    # the worker -----------------------------------------------------------------------------------
    def _once(self) -> bool:
        """The worker's turn: a step, or once closed the answer to what is left (then False)."""
        with self._cv:
            closed = self._closed
        if closed:
            self._shutdown()
            return False
        try:
            self.step()
        except BaseException:  # noqa: BLE001 - step() gave the error to every sequence it held
            pass
        return True

    def idle(self) -> bool:
        return not self._waiting and not self._running and not self._prefilling

    def step(self) -> None:
        """Admit what fits, sample every running sequence's token, prefill prompt chunks with what is left of the
        step's budget, then one decode step for all running sequences.

        A failure belongs to its sequence: an exception in one sequence's restore, prefill, sampler, constraint,
        text or snapshot ends that sequence with the error (its handle raises it, its state and bytes are freed at
        once) and the others go on; a failed batched decode ends exactly the sequences in it. Anything else raised
        here (a bug of the step itself) is given to every sequence the scheduler holds, then re-raised: no admitted
        sequence is ever left unanswered or holding its reservation."""
        with self.engine.lock:
            try:
                self._drop_cancelled()
                self._step()
            except BaseException as e:
                self._fail_all(e)
                raise

    def _step(self) -> None:
        self._admit()
        self.peak_running = max(self.peak_running, self.running)
        with self._cv:
            queued = [(h.request.key_ids, h.request.cache_salt) for h in self._waiting]
        going = [s for s in self._running if self._advance(s)]
        budget = prompt_budget(self.step_tokens, len(going), self._decode_s)
        started = self._prefill(budget, queued, len(going))
        self._running = going + started  # held while they decode: anything raised there fails them (_fail_all)
        self._running = self._decode(self._running)
        self.steps += 1
        if self.engine.prefix_cache is not None:
            self._flush_cache()

    def _drop_cancelled(self) -> None:
        with self._cv:
            gone = [h for h in self._waiting if h.cancelled]
            for h in gone:
                self._waiting.remove(h)
        for h in gone:
            h.generation.finish_reason = "cancelled"
            h._finish()
        for s in self._running + self._prefilling:
            if s.handle.cancelled:
                s.handle.generation.finish_reason = "cancelled"
                self._end(s)
        self._running = [s for s in self._running if not s.freed]
        self._prefilling = [s for s in self._prefilling if not s.freed]

    def _admit(self) -> list[_Seq]:
        out = []
        with self._cv:
            while self._waiting and self.running + len(out) < self.max_seqs:
                h = self._waiting[0]
                need = self.request_bytes(h.request)
                if self.state_budget is not None and self._reserved + need > self.state_budget:
                    break  # first come, first served: it waits for memory rather than being overtaken
                self._waiting.popleft()
                self._reserved += need
                self.peak_reserved = max(self.peak_reserved, self._reserved)
                out.append(_Seq(h, reserved=need, t0=time.perf_counter()))
        self._prefilling += out
        self._fit_spares()
        return out

    def _fit_spares(self) -> None:
        """The released states' buffers the engine keeps (Engine.spares) count against the state budget: they
        hold at most what the admitted sequences leave of it."""
        if self.state_budget is not None:
            with self._cv:
                room = self.state_budget - self._reserved
            self.engine.trim_spares(room)

    def _restore(self, s: _Seq, later: list[list[int]]) -> None:
        """A fresh state for `s`, its cached prefix restored, snapshot positions on the way (where it parts from the
        prompts admitted or queued after it). A failure is its error."""
        eng, req = self.engine, s.handle.request
        s.restored = True
        try:
            s.state = eng.new_state()
            s.logits, s.stats, s.work = eng.restore(
                req.ids, s.state, req.turn_boundary, shared_points(req.key_ids, later) if eng.prefix_cache else (),
                req.keep_ends, req.cache_salt, req.images)
        except Exception as e:  # noqa: BLE001 - e.g. no memory for it: this request's error
            self._fail(s, e)

    def _waits(self, s: _Seq, earlier: list[_Seq]) -> bool:
        """With a prefix cache, a prompt that shares a prefix with one admitted before it waits until that one's
        prefill has passed (and snapshotted) the shared part, then restores it instead of computing it again."""
        if self.engine.prefix_cache is None:
            return False
        req = s.handle.request
        return any(not e.freed and e.work is not None and (not e.restored or e.state.pos < p)
                   for e in earlier if e.handle.request.cache_salt == req.cache_salt
                   for p in [common_prefix(req.key_ids, e.handle.request.key_ids)] if p >= MIN_SHARED_PREFIX)

    def _prefill(self, budget: tuple[int, float | None], queued: list[tuple[list[int], str | None]],
                 running: int = 0) -> list[_Seq]:
        """Prompt chunks for `budget` (tokens, seconds or None: prompt_budget), oldest admitted first, in one pass,
        each chunk's tokens within the seconds left as ChunkCost prices it there (the first at least
        MIN_PROMPT_TOKENS: prefill always advances); each prompt done
        samples its first token in this step, before the decode. A single-pass backend takes one streamed pass,
        bounded by pass_tokens while `running` sequences decode. Returns those that go on to the decode step."""
        seqs = self._prefilling
        def later(j: int) -> list[list[int]]:  # prompts after seqs[j] of the same tenant: it snapshots where they part
            salt = seqs[j].handle.request.cache_salt
            return [t.handle.request.key_ids for t in seqs[j + 1 :] if t.handle.request.cache_salt == salt] + [
                ids for ids, s in queued if s == salt]

        be = self.engine.backend
        if be.single_pass:  # the admitted prompts in one streamed pass: whole, or cut while others decode
            for j, s in enumerate(seqs):
                if not s.restored:
                    self._restore(s, later(j))
            pending = [s for s in seqs if s.work is not None and not s.freed]
            limit = pass_tokens(self.step_tokens, running, be.last_pass)
            for s, got in zip(pending, self._prefill_whole(pending, limit), strict=True):
                self._took(s, got)
        else:
            plan, left, secs = [], max(budget[0], 1), budget[1]
            for j, s in enumerate(seqs):
                # a restore (copying the cached prefix into the state's pages) is paid from the step's seconds too:
                # after a chunk, one starts only while what is left covers one as they have lately cost
                if (not s.restored and left > 0 and (secs is None or not plan or secs >= (self._restore_s or 0.0))
                        and not self._waits(s, seqs[:j])):
                    t0 = time.perf_counter()
                    self._restore(s, later(j))
                    took = time.perf_counter() - t0
                    self._restore_s = ema(self._restore_s, took)
                    if secs is not None:
                        secs -= took
                if s.restored and s.work is not None and not s.freed and left > 0:
                    want, took, secs = self._chunk(s, left, secs, not plan)
                    if want <= 0:
                        break
                    plan.append((s, want))
                    left -= took
            for (s, _), got in zip(plan, self._prefill_steps(plan), strict=True):
                self._took(s, got)
        started = [s for s in seqs if s.restored and s.work is None and not s.freed and self._first(s)]
        self._prefilling = [s for s in seqs if not s.freed and (s.work is not None or not s.restored)]
        return started

    def _chunk(self, s: _Seq, left: int, secs: float | None, first: bool) -> tuple[int, int, float | None]:
        """chunk_cost.size_chunk for s's next chunk: (budget, tokens it takes, seconds left after it)."""
        return size_chunk(self._cost, s.state.pos, left, secs, MIN_PROMPT_TOKENS if first else 0,
                          self._save_s or 0.0, lambda want: self.engine.chunk_len(s.work, want), s.work.at)

    def _prefill_steps(self, plan: list[tuple[_Seq, int]]) -> list:
        """Engine.prefill_steps: the planned chunks in one pass. When that pass fails, whose fault it was is unknown
        (and some states may have moved): each is restored on a fresh state and takes its chunk alone, its own
        error going to its own caller. Each one's logits, None or exception."""
        eng = self.engine
        if not plan:
            return []
        try:
            t0, starts, saved = time.perf_counter(), [s.state.pos for s, _ in plan], self._saving()
            got = eng.prefill_steps([(s.work, b) for s, b in plan])
            took = time.perf_counter() - t0
            chunks = [(p, s.state.pos - p) for p, (s, _) in zip(starts, plan, strict=True)]
            # the snapshots taken at chunk ends are priced apart (_chunk): ChunkCost sees the products alone
            saved = self._saving() - saved
            snaps = sum(1 for s, _ in plan if s.state.pos in s.work.at)
            if snaps:
                self._save_s = ema(self._save_s, saved / snaps)
            if sum(c for _, c in chunks) >= MIN_PROMPT_TOKENS:  # a few tokens' pass is mostly its fixed cost
                self._cost.observe(chunks, took - saved)
            return got
        except Exception as e:  # noqa: BLE001
            if len(plan) == 1:
                return [e]
        return [self._alone(s, lambda w, b=b: eng.prefill_step(w, b)) for s, b in plan]

    def _saving(self) -> float:
        """Seconds the prefix cache has spent taking snapshots, so far."""
        cache = self.engine.prefix_cache
        return cache.save_s if cache is not None else 0.0

    def _alone(self, s: _Seq, prefill) -> object:
        """After a shared pass failed: `s` restored on a fresh state and prefilled alone (`prefill(work)`); its
        logits, None (more to come) or its own exception."""
        eng, req = self.engine, s.handle.request
        try:
            eng.release(s.state)
            s.state = eng.new_state()
            lg, s.stats, s.work = eng.restore(req.ids, s.state, req.turn_boundary, (), req.keep_ends, req.cache_salt,
                                              req.images)
            return lg if s.work is None else prefill(s.work)
        except Exception as e:  # noqa: BLE001
            return e

    def _took(self, s: _Seq, got) -> None:
        """The result of a prefill call for `s`: its error, None (more to come), or its prompt's last logits."""
        if isinstance(got, BaseException):
            self._fail(s, got)
        elif got is not None:
            s.logits, s.work = got, None

    def _prefill_whole(self, seqs: list[_Seq], limit: int | None) -> list:
        """Engine.prefill_whole of several sequences in one pass; when that pass fails, whose fault it was is
        unknown, so each is restored on a fresh state and prefilled alone (its own error, if it fails again, goes
        to its own caller). Each one's logits or exception."""
        eng = self.engine
        if not seqs:
            return []
        try:
            return eng.prefill_whole([s.work for s in seqs], limit)
        except Exception as e:  # noqa: BLE001
            if len(seqs) == 1:
                return [e]
        return [self._alone(s, lambda w: eng.prefill_whole([w], limit)[0]) for s in seqs]

    def _first(self, s: _Seq) -> bool:
        """A sequence whose prompt is in: its sampler and first token. False when it has ended (or failed), True
        when it goes on to the decode step."""
        try:
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
        if s.pending is not None:
            s.next_tok, s.pending = s.pending, None
            return True
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
        spec, drafts = self.engine.spec, None
        if spec is not None:
            spec.start(self.engine.backend)
            drafts = spec.drafts(go)
        if drafts is not None and any(drafts):  # drafts to check: a verify step (its rows decode the others too)
            return spec.verify(self, go, drafts)
        try:
            t0 = time.perf_counter()
            lg = self.engine.decode_step([s.next_tok for s in go], [s.state for s in go])
            self._decode_s = ema(self._decode_s, time.perf_counter() - t0)
            if spec is not None:
                spec.timed(len(go), False)
        except Exception as e:  # noqa: BLE001
            for s in go:
                self._fail(s, e)
            return []
        for j, s in enumerate(go):
            s.logits = lg[j]  # a row of the step's own array: no copy
        return go

    def _flush_cache(self) -> None:
        """The prefix cache's deferred disk copies. They belong to no sequence (each answer is out already), so a
        failure here is a warning, not an error of any request."""
        try:
            self.engine.flush_snapshots()
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
            eng.snapshot(s.state, s.logits, s.handle.request.cache_salt)  # the next turn starts from the reply
        t2 = time.perf_counter()
        n = max(len(g.tokens), 1)
        g.timings = {**s.stats, "prefill_s": s.t1 - s.t0, "decode_s": t2 - s.t1,
                     "prompt_tok_per_s": len(s.handle.request.ids) / max(s.t1 - s.t0, 1e-9),
                     "decode_tok_per_s": n / (t2 - s.t1) if t2 > s.t1 else 0.0}
        if s.spec is not None:  # llama-server's names for them
            g.timings.update(draft_n=s.spec.drafted, draft_n_accepted=s.spec.accepted)

    def _fail(self, s: _Seq, error: BaseException) -> None:
        """End `s` with `error` (its handle raises it); its state and reserved bytes go now."""
        self._free(s, error)

    def _fail_all(self, error: BaseException) -> None:
        """Every sequence this scheduler holds (decoding or prefilling) ends with `error`."""
        held, self._running, self._prefilling = self._running + self._prefilling, [], []
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
                self.engine.release(s.state)
        except Exception as e:  # noqa: BLE001
            error = error or e
        s.state, s.logits, s.sampler, s.work = None, None, None, None  # the memory goes now, not with the handle
        with self._cv:
            self._reserved -= s.reserved
            s.reserved = 0
        self._fit_spares()
        s.handle._finish(error)

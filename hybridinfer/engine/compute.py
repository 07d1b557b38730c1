"""The Engine's compute interface, which the scheduler drives: restore a cached prefix, prefill a chunk (of one
prompt, or of several in one pass), decode a step, snapshot, release. Every call takes the engine's lock
(`Engine.lock`): backends share work buffers and are not thread-safe. The scheduler's worker holds the lock for a
whole step, so these calls nest inside it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import ContextLengthError, EngineClosed, ParameterError

# The step's token budget (2026-11-27, 2 cores of an AMD EPYC under a load of ~4.5, so absolute rates are low): one
# forward of N prompt tokens gave, for N = 16 / 64 / 128 / 256 / 512, SmolLM2-135M Q4_1 36 / 45 / 49 / 46 / 48 tok/s
# and a 6-layer qwen35moe synth (1024 wide, 128 experts) 73 / 133 / 102 / 88 / 92 tok/s: per-token cost is flat
# from 64-128 tokens up, while every prompt token in a step delays each running stream. 256 keeps prefill at its
# plateau, halves the worst delay of 512 (llama.cpp's n_ubatch), and ends chunks on the CPU snapshot stride.
DEFAULT_STEP_TOKENS = 256


# while sequences decode, a step's prompt work may take at most this many times a decode step's time. 2, not 3: a
# step's fixed costs (a restore, a snapshot) do not shrink with a faster decode step, and at 3 the agent workload's
# inter-token p99 came to 4.4x its p50 on the 16-core host (0.8B shape, 16 slots), while cached turns' time to
# first token had room to spare (754 ms against llama-server's 1,349)
STALL = 2.0
MIN_PROMPT_TOKENS = 16  # the fewest prompt tokens a step with prompts waiting takes: prefill always advances


def prompt_budget(step_tokens: int, running: int, decode_s: float | None, stall: float = STALL
                  ) -> tuple[int, float | None]:
    """What a chunking backend's step may give waiting prompts: (tokens, seconds). Tokens: what `step_tokens` leaves
    after the `running` sequences' decode tokens (at least 1). Seconds: while any decode, `stall` times a decode
    step (decode_s, measured), so a running stream's token gap stays within (1 + stall) times its usual one; None
    while nothing decodes or nothing was measured yet (no limit but the tokens). The scheduler sizes each prompt's
    chunk to the seconds by chunk_cost.ChunkCost, which prices a chunk by its position in its prompt."""
    left = max(1, step_tokens - running)
    if running <= 0 or not decode_s:
        return left, None
    return left, stall * decode_s


def ema(old: float | None, new: float, keep: float = 0.7) -> float:
    """A running estimate of a step's time (prompt_budget's inputs): the last measurements weigh most, as load and
    context lengths drift."""
    return new if old is None else keep * old + (1 - keep) * new


# a streamed pass's prompt tokens while others decode never grow past this many times the step budget
MAX_PASS_STEPS = 16


def pass_tokens(step_tokens: int, running: int, last: dict | None) -> int | None:
    """The prompt tokens one streamed prefill pass (single-pass backends: the GPU) may take in a step: None (every
    admitted prompt whole, one pass) while no sequence decodes, since nobody waits for it; else a bound, so that
    running streams wait for one pass at a time. Every pass streams the same weight bytes whatever its length, so
    the bound is the tokens the card computes in the time that stream takes (`last`: the previous pass's timing,
    GPUModel.last_timing: wall_s, copy_s, tokens): a pass that was transfer-bound doubles it, a compute-bound one
    scales it to copy_s. Never under `step_tokens` nor over MAX_PASS_STEPS times it."""
    if running <= 0:
        return None
    lo, hi = step_tokens, step_tokens * MAX_PASS_STEPS
    if not last or not last.get("tokens") or not last.get("wall_s"):
        return lo
    n, wall, copy = int(last["tokens"]), float(last["wall_s"]), float(last.get("copy_s") or 0.0)
    if wall <= 1.25 * copy:  # the stream set the pass's time: more tokens ride on it for free
        want = 2 * n
    else:
        want = int(n * copy / wall) if copy > 0 else n
    return max(lo, min(hi, want))


@dataclass(eq=False)
class PromptWork:
    """What is left of one prompt's prefill: the whole prompt `ids`, the `state` (at its position), the absolute
    positions where a snapshot is taken (`at`, ascending) and the callback that takes it (`save(state, logits)`)."""

    ids: list[int]
    state: object
    at: list[int] = field(default_factory=list)
    save: object = None

    @property
    def left(self) -> int:
        return len(self.ids) - self.state.pos

    def chunk_done(self, last: np.ndarray) -> np.ndarray | None:
        """After a chunk whose last token's logits are `last`: the snapshot, when the state's position is one of
        `at`; then those logits (a copy: a view of the backend's buffers would not outlive the lock) once the
        prompt is done, else None."""
        if self.save is not None and self.state.pos in self.at:
            self.save(self.state, last)
        return np.array(last, copy=True) if self.state.pos == len(self.ids) else None


def chunk_end(pos: int, end: int, at, budget: int, max_chunk: int) -> int:
    """Where the next prefill chunk from `pos` ends: at most `budget` and `max_chunk` tokens, never past the
    prompt's `end`, and cut at the first snapshot position after `pos` (a snapshot is the state at a chunk's end,
    so no second pass). At least one token."""
    b = min(end, pos + max(1, min(budget, max_chunk)))
    return min([p for p in at if pos < p < b] + [b])


class Compute:
    """The compute methods of Engine (a mixin: it uses backend, prefix_cache, lock, prefill_chunk and
    snapshot_stride of the Engine)."""

    def _open(self):
        if self.backend is None:
            raise EngineClosed("the engine is closed (Engine.close was called)")
        return self.backend

    def new_state(self):
        """A fresh state for one sequence, on the blocks of a released one where the engine kept some (release)."""
        with self.lock:
            st = self._open().new_state(self.n_ctx)
            self.spares.take(st)
            return st

    def restore(self, ids: list[int], state, turn_boundary=None, shared_at=(), keep_ends: bool = True,
                salt: str | None = None, images=()):
        """Restore the longest cached prefix of `ids` into the fresh `state` (with a prefix cache). Returns
        (logits, stats, work): the last-token logits when the whole prompt was cached (else None), the prompt's
        stats (prompt_tokens, reused_tokens, prefilled_tokens, restore_s), and a PromptWork of what is left to
        prefill (None when nothing is) with its snapshot positions: every snapshot_stride tokens, the turn
        boundaries, `shared_at` (where prompts queued beside it part ways), where it leaves a cached prompt and its
        end (keep_ends False: neither turn boundaries nor the end). salt: the tenant whose snapshots it may restore
        and makes (PrefixCache.lookup). images: the prompt's images (models/mrope.ImageSpan), which the state
        takes: their rows' embeddings and positions, and the keys of its snapshots."""
        from .prefix.index import with_images
        from .text import boundary_points

        with self.lock:
            self._open()
            t0 = time.perf_counter()
            stats = {"prompt_tokens": len(ids), "reused_tokens": 0, "restore_s": 0.0}
            state.check_room(len(ids))
            state.images = tuple(images)
            cache = self.prefix_cache
            if cache is None:
                stats["prefilled_tokens"] = len(ids)
                return None, stats, PromptWork(ids, state)
            kids = with_images(ids, state.images)  # the ids as the cache keys them
            hit = cache.lookup(kids, max_pos=len(ids), salt=salt)
            if hit is not None and hit.pos == len(ids) and not hit.has_logits:
                hit = cache.lookup(kids, max_pos=len(ids) - 1, salt=salt)
            lg = None
            if hit is not None:
                lg = cache.restore(hit, state, self.backend.copy_into)
                if state.images:  # the snapshot holds the images' key ids: the state its real tokens
                    state.tokens[: state.pos] = ids[: state.pos]
                stats["reused_tokens"] = hit.pos
                stats["restore_s"] = time.perf_counter() - t0
            n = len(ids)
            stats["prefilled_tokens"] = n - state.pos
            if state.pos >= n:
                return lg, stats, None
            stride = self.snapshot_stride
            at = set(range(stride, n, stride)) if stride else set()
            if turn_boundary is not None and keep_ends:
                at.update(p for p in boundary_points(turn_boundary) if state.pos < p < n)
            at.update(p for p in shared_at if state.pos < p < n)
            shared = cache.known_prefix(kids, salt)  # where this prompt leaves a cached one: the next may share it too
            if state.pos < shared < n:
                at.add(shared)
            if keep_ends:
                at.add(n)
            save = lambda st, last: cache.save(st, last if st.pos == n else None, True, salt,  # noqa: E731
                                               self.backend.copied)
            return None, stats, PromptWork(ids, state, sorted(p for p in at if p > state.pos), save)

    def prefill_step(self, work: PromptWork, budget: int) -> np.ndarray | None:
        """One chunk of `work` on a chunking backend (CPU, reference): at most `budget` and `prefill_chunk` tokens,
        cut at the next snapshot position (taken there). Returns the last token's logits (a copy) once the prompt
        is done, else None."""
        with self.lock:
            be, st = self._open(), work.state
            b = chunk_end(st.pos, len(work.ids), work.at, budget, self.prefill_chunk)
            lg = be.forward(work.ids[st.pos : b], st, all_logits=False)[-1]
            self._drafter_follows([st])
            return work.chunk_done(lg)

    def chunk_len(self, work: PromptWork, budget: int) -> int:
        """How many tokens prefill_steps takes from `work` under `budget` (chunk_end's rule)."""
        st = work.state
        return chunk_end(st.pos, len(work.ids), work.at, budget, self.prefill_chunk) - st.pos

    def prefill_steps(self, plan: list[tuple[PromptWork, int]]) -> list[np.ndarray | None]:
        """One chunk of each (work, budget) of `plan` in one pass on a chunking backend (Backend.forward_many: the
        prompts' rows share every product), each cut as prefill_step cuts it and snapshotted at its end when that
        is a snapshot position. For each: the last token's logits (a copy) once its prompt is done, else None."""
        with self.lock:
            be = self._open()
            if len(plan) == 1:
                return [self.prefill_step(*plan[0])]
            chunks = [(w.ids[w.state.pos : w.state.pos + self.chunk_len(w, b)], w.state) for w, b in plan]
            lgs = be.forward_many(chunks)
            self._drafter_follows([w.state for w, _ in plan])
            return [w.chunk_done(lg) for (w, _), lg in zip(plan, lgs, strict=True)]

    def _drafter_follows(self, states) -> None:
        """A drafter that keeps rows of its own per position (spec_mtp.MTPDrafter) writes those of a prompt chunk (or
        of a reply, before its snapshot)."""
        d = getattr(getattr(self, "spec", None), "drafter", None)
        if hasattr(d, "prefilled"):
            for st in states:
                d.prefilled(st)

    def prefill_whole(self, works: list[PromptWork], limit: int | None = None) -> list[np.ndarray | None]:
        """Every prompt of `works` to its end, or (limit) the oldest prompts' next `limit` tokens at most; each
        one's last-token logits (copies) once its prompt is done, else None. A single-pass backend (the GPU) takes
        them in one streamed pass (each layer's weights cross the bus once for all), each cut at a snapshot
        position inside the limit; a chunking backend runs prefill_step until each is done (no limit)."""
        with self.lock:
            be = self._open()
            if not be.single_pass:
                out = []
                for w in works:
                    lg = None
                    while lg is None:
                        lg = self.prefill_step(w, w.left)
                    out.append(lg)
                return out
            ends, left = [], limit
            for w in works:
                st = w.state
                if left is None:
                    ends.append(len(w.ids))
                elif left > 0:
                    b = min(len(w.ids), st.pos + left)
                    if b < len(w.ids):  # the card snapshots inside its pass; a cut ends at the last such position
                        b = max([p for p in w.at if st.pos < p <= b], default=b)
                    ends.append(b)
                    left -= b - st.pos
                else:
                    ends.append(st.pos)
            todo = [(w, b) for w, b in zip(works, ends, strict=True) if b > w.state.pos]
            items = [(w.ids[w.state.pos : b], w.state, [p for p in w.at if p <= b], w.save) for w, b in todo]
            if len(items) == 1:
                ids, st, at, cb = items[0]
                lgs = [be.forward(ids, st, all_logits=False, snapshot_at=at, on_snapshot=cb)[-1:]]
            else:
                lgs = be.prefill_many(items)
            self._drafter_follows([w.state for w, _ in todo])  # the MTP block's rows of the pass's prompt rows
            got = {id(w): w.chunk_done(lg[-1]) for (w, _), lg in zip(todo, lgs, strict=True)}
            return [got.get(id(w)) for w in works]

    def decode_step(self, tokens: list[int], states: list) -> np.ndarray:
        """One token for each sequence (Backend.decode_batch, each weight read once for all): logits (B, n_vocab),
        one array that is the caller's."""
        with self.lock:
            be = self._open()
            return be.copied([be.decode_batch(tokens, states)])[0]

    def verify_rows(self, chunks) -> tuple[list[np.ndarray], list]:
        """A speculative verify step: each (ids, state) of `chunks` (a sequence's next token and its drafts, or its
        token alone) in one pass of the decoding backend. Returns every row's logits, one (len(ids), n_vocab) array
        each (the caller's; row i as a one-token decode step at that position gives it), and one RowsUndo each:
        undo(m) leaves that state as after its first m rows alone (call it under the lock)."""
        with self.lock:
            return self._open().forward_rows(chunks, undo=True)

    def snapshot(self, state, logits, salt: str | None = None) -> None:
        """With a prefix cache: keep `state` (and its next-token logits) for a later prompt that starts with its
        tokens; the disk copy waits for flush_snapshots()."""
        with self.lock:
            if self.prefix_cache is not None:
                self._drafter_follows([state])  # the MTP block's rows up to the state's end, kept with it
                self.prefix_cache.save(state, logits, defer_disk=True, salt=salt, copied=self.backend.copied)

    def flush_snapshots(self) -> None:
        """Write the snapshots waiting for their disk copy (none without a disk store)."""
        with self.lock:
            if self.prefix_cache is not None:
                self.prefix_cache.flush()

    def release(self, state) -> None:
        """The backend forgets what it keeps for this sequence (recorded steps, bound calls), and the engine keeps
        the state's buffers for the next new_state (SpareBlocks: at most max_seqs sets, only when nothing else
        views them); the state is not usable after."""
        with self.lock:
            if self.spec is not None:
                self.spec.release(state)
            if self.backend is not None:
                self.backend.release(state)
                self.spares.give(state)

    def warm_states(self, rows: int) -> int:
        """Keep up to max_seqs states' buffers ready before any request (SpareBlocks.warm: their recurrent arrays and
        first `rows` positions written), as many as the state budget holds: a server's first max_seqs sequences then
        restore and decode into warm pages as later ones do. Returns the sets kept."""
        with self.lock:
            be = self._open()
            while len(self.spares) < self.spares.most:
                st = be.new_state(self.n_ctx)
                need = self.spares.touched(st, rows)
                if self.state_budget is not None and self.spares.kept_bytes + need > self.state_budget:
                    break
                if not self.spares.warm(st, rows):
                    break
            return len(self.spares)

    def trim_spares(self, room: int | None) -> None:
        """Let the kept buffers of released states go until they hold at most `room` bytes (None: all)."""
        with self.lock:
            self.spares.trim(room)

    def hidden_states(self, ids: list[int]) -> np.ndarray:
        """The final norm's output (what the head reads) of every token of `ids` from a fresh state, (len(ids),
        n_embd) float32, prefilled in prefill_chunk chunks through Backend.hidden (each row in its one-token float
        shape on the CPU, so the chunks change nothing); the state is let go after."""
        with self.lock:
            be = self._open()
            state = self.new_state()
            state.check_room(len(ids))
            step = self.prefill_chunk
            try:
                return np.concatenate([be.hidden(ids[a : a + step], state) for a in range(0, len(ids), step)])
            finally:
                be.release(state)

    def embed(self, prompt, pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        """The embedding of `prompt` (text, tokenized as `tokenize` does, or token ids): its tokens' final hidden
        states pooled, "mean" over every token or "last" (the last token's, which alone has read the whole
        prompt: what last-token embedding models such as Qwen3-Embedding are trained for), then scaled to unit
        length (normalize). (n_embd,) float32. Computed on the caller's thread under the engine's lock, between two
        scheduler steps, as `logits` is."""
        if pooling not in ("mean", "last"):
            raise ParameterError(f"pooling must be 'mean' or 'last', got {pooling!r}")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else self._check_ids([int(t) for t in prompt])
        if not ids:
            raise ParameterError("embed() needs at least one token, got none")
        if len(ids) > self.n_ctx:
            raise ContextLengthError(f"{len(ids)} tokens exceed the context size n_ctx={self.n_ctx}")
        h = self.hidden_states(ids).astype(np.float64)
        v = h.mean(axis=0) if pooling == "mean" else h[-1]
        if normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.astype(np.float32)

    def start(self, ids: list[int], state, turn_boundary=None, shared_at=()) -> tuple[np.ndarray, dict]:
        """restore, then prefill what is left: (last-token logits, stats) of `ids` in the fresh `state`."""
        with self.lock:
            lg, stats, work = self.restore(ids, state, turn_boundary, shared_at)
            if work is not None:
                lg = self.prefill_whole([work])[0]
            return lg, stats

    def prefill(self, ids: list[int], state, all_logits: bool = False, snapshot_at=(), on_snapshot=None):
        """Feed prompt tokens (teacher-forced, no sampling); logits of every token (all_logits) or of the last.

        snapshot_at: absolute positions (state.pos < p <= state.pos + len(ids)) where the state is handed to
        on_snapshot(state, last_logits) as prefill passes them: chunks end there, so no second pass."""
        with self.lock:
            be = self._open()
            state.check_room(len(ids))
            if be.single_pass:  # the GPU: one pass, chunking inside each layer
                lg = be.forward(ids, state, all_logits=all_logits, snapshot_at=snapshot_at, on_snapshot=on_snapshot)
                if on_snapshot is not None and state.pos in set(snapshot_at):
                    on_snapshot(state, lg[-1])
                return lg.copy()
            work, p0, outs = PromptWork(list(ids), state, sorted(snapshot_at), on_snapshot), state.pos, []
            work.ids = [0] * p0 + work.ids  # PromptWork counts from position 0
            bar = None
            if self.progress and len(ids) > self.prefill_chunk:
                from tqdm import tqdm

                bar = tqdm(total=len(ids), desc="prefill", unit="tok", leave=False)
            while work.left:
                a = state.pos
                b = chunk_end(a, len(work.ids), work.at, self.prefill_chunk, self.prefill_chunk)
                lg = be.forward(work.ids[a:b], state, all_logits=all_logits)
                outs.append(lg.copy())  # a backend may return a view of its buffers
                if on_snapshot is not None and state.pos in work.at:
                    on_snapshot(state, lg[-1])
                if bar is not None:
                    bar.update(b - a)
            if bar is not None:
                bar.close()
            return np.concatenate(outs, axis=0) if all_logits else outs[-1]

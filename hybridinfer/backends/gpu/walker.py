"""The one GPU walker: a streamed, layer-major pass over one prompt or several (GPUModel.forward, multi.forward_many).

Every token of the pass goes through layer L before layer L+1's weights are used, so each streamed weight crosses
the bus once per pass. The prompts' hidden rows lie one after another in the hidden buffer (each at its `off`) and
their cached rows one after another in the card's per-token state (each at its `base`). Within a layer each branch
runs over the rows in chunks of `chunk`: the mixer (models/state_kinds.py declares its state) per prompt, each
continuing its own state, in the pieces of the chunk that hold that prompt's rows; the FFN or MoE over all prompts'
rows together (short prompts would otherwise each make small GEMMs and read every selected expert again). Each
prompt's logits equal those of a pass of its own to the float rounding of the GEMM tiles.

What moves a prompt's state between the host and the card is the walker's one difference between one prompt and
several (`OneState`, `ManyStates`). Mid-prompt snapshots (the prefix cache's) are written by the kernels at requested
positions within the same pass, into MAX_SNAPS slots shared by the pass's prompts.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ...format.quant import dequantize_rows
from ...models import mrope
from ...models.state_kinds import ARRAYS, layer_arrays
from ..state import DecoderState, check_tokens
from . import k_elementwise as ke
from .handoff import kv_down, kv_up, zero_or_upload
from .work import Work

MAX_SNAPS = 16  # mid-prompt snapshots per pass (the card's snapshot slots)


@dataclass
class Item:
    """One prompt of a pass: its tokens, the state it continues (at any position), and where to snapshot."""

    ids: np.ndarray
    state: DecoderState
    snapshot_at: tuple = ()
    on_snapshot: object = None
    off: int = 0  # its first row in the hidden buffer
    base: int = 0  # its first row in the card's per-token state
    snaps: list = field(default_factory=list)  # its snapshot positions relative to its first token
    snap0: int = 0  # its first slot in the card's snapshot buffers


def item(m, ids, state: DecoderState, snapshot_at=(), on_snapshot=None) -> Item:
    """A prompt for GPUModel m, after checking its tokens and that it fits its state and the card's buffers."""
    ids = check_tokens(ids, m.args.n_vocab)
    state.check_room(len(ids))
    if state.n_ctx > m.n_ctx:
        raise ValueError(f"state n_ctx {state.n_ctx} exceeds the GPU backend's n_ctx {m.n_ctx}")
    return Item(ids, state, tuple(snapshot_at), on_snapshot)


class OneState:
    """One prompt: the card keeps its copy of the state between passes (uploaded only when the host's is another,
    GPUModel._holds), and each layer's state comes down through the StateHandoff while later layers run."""

    def __init__(self, m, it: Item):
        self.m, self.it, self.p0 = m, it, it.state.pos

    def up(self) -> None:
        if not self.m._holds(self.it.state):
            self.m.handoff.upload(self.it.state, self.m.stream)

    def begin(self) -> None:
        self.m.handoff.begin(self.it.state, self.p0, len(self.it.ids))

    def before(self, j: int, i: int):
        return None  # the card holds the prompt's state already

    def after(self, j: int, i: int):
        return None

    def layer_done(self, i: int) -> None:
        self.m.handoff.layer_done(i, self.m.stream)

    def drain(self, i: int) -> None:
        self.m.handoff.drain(wait_through=i - 2)

    def abort(self) -> None:
        pass  # its copies run on the caller's thread: none is left running

    def down(self) -> None:
        st = self.it.state
        st.tokens[self.p0 : self.p0 + len(self.it.ids)] = self.it.ids
        st.pos = self.p0 + len(self.it.ids)
        self.m.handoff.finish()
        self.m._owner = (weakref.ref(st), st.pos, tokens_hash(st))


class ManyStates:
    """Several prompts: each one's per-token rows go up to its own rows of the card's state before the pass (after a
    restore) and come down after it; the card's one copy of a layer's recurrent arrays is loaded with the prompt's
    before its first piece (zeroed at position 0, copied up after a restore) and queued down into page-locked
    mirrors after its last, without waiting for the card. As with one prompt, a layer's mirrors go on into the host
    states while the card works on later layers: between layers the host waits for the copies of the layer two
    back and hands them to copier threads (numpy's copies let go of the GIL), which write the prompts' states while
    the host queues the next layers. Copied at the end instead, 8 prompts' 63 MB each of the 35B-A3B's GDN state
    (into fresh pages) took 0.34 s after a 0.37 s pass."""

    COPIERS = 4  # threads writing mirrors into host states (a layer each at a time)

    def __init__(self, m, items: list[Item]):
        self.m, self.items, self.b = m, items, m.buf
        self.rows = [(name, i, card) for (name, i), card in self.b.state.items() if ARRAYS[name].per_token]
        self.pinned = pinned_states(m, len(items))
        self.recurrent = {i for (name, i) in self.b.state if not ARRAYS[name].per_token}
        self._pending: list[tuple[int, object]] = []  # (layer, event after its copies down were queued)
        self._pool, self._jobs = None, []

    def up(self) -> None:
        self.m._owner = None  # the card's state buffers end holding pieces of several sequences
        for it in self.items:
            st = it.state
            if st.pos:  # a restored prefix: its per-token rows up to this prompt's rows of the cache
                for name, i, card in self.rows:
                    card[it.base : it.base + st.pos].set(np.ascontiguousarray(st.arrays[name][i][: st.pos]))

    def begin(self) -> None:
        pass

    def before(self, j: int, i: int):
        st = self.items[j].state
        return lambda: load_recurrent(self.m.drv, self.b, i, st, self.m.stream)

    def after(self, j: int, i: int):
        return lambda: save_recurrent(self.m.drv, self.b, i, self.pinned[j], self.m.stream)

    def layer_done(self, i: int) -> None:
        if i in self.recurrent:  # every prompt's mirrors of layer i are queued by now (its pieces' `after`)
            ev = self.m.drv.Event()
            ev.record(self.m.stream)
            self._pending.append((i, ev))

    def drain(self, i: int) -> None:
        self._hand_on(wait_through=i - 2)

    def _hand_on(self, wait_through: int) -> None:
        """Layers whose mirrors have arrived (waiting for those up to `wait_through`) to the copier threads."""
        while self._pending:
            i, ev = self._pending[0]
            if i <= wait_through:
                ev.synchronize()
            elif not ev.query():
                return
            self._pending.pop(0)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.COPIERS, thread_name_prefix="hybridinfer-state-down")
            self._jobs.append(self._pool.submit(self._copy_layer, i))

    def _copy_layer(self, i: int) -> None:
        for j, it in enumerate(self.items):
            for (name, l), mirror in self.pinned[j].items():
                if l == i:
                    np.copyto(it.state.arrays[name][i], mirror)

    def abort(self) -> None:
        """A failed pass: the copier threads' writes are over before the states go back to the caller."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool, self._jobs, self._pending = None, [], []

    def down(self) -> None:
        try:
            self._hand_on(wait_through=1 << 30)
            for job in self._jobs:
                job.result()
        finally:
            self.abort()
        for it in self.items:
            st, p0, T = it.state, it.state.pos, len(it.ids)
            for name, i, card in self.rows:
                st.arrays[name][i][p0 : p0 + T] = card[it.base + p0 : it.base + p0 + T].get()
            st.tokens[p0 : p0 + T] = it.ids
            st.pos = p0 + T


def walk(m, items: list[Item], all_logits: bool = False, rows_in=None, rows_out=None) -> list[np.ndarray]:
    """One streamed pass of GPUModel m over `items` (their rows and cached rows must fit its buffers, as
    multi.plan_groups groups them): each prompt's logits, (T, n_vocab) with all_logits (one prompt), else its last
    token's (1, n_vocab). The states advance; snapshots go to each prompt's on_snapshot once the pass is done.

    Over m's layers [m.first, m.end) alone (one card of a multi-card prefill, multi_gpu.py): a range after the first
    starts from the hidden rows `rows_in` (host, the card before's) instead of the embedding, and a range without
    the head ends with the rows copied into `rows_out` (page-locked host memory), returned as [rows]."""
    if all_logits and len(items) > 1:
        raise ValueError("all_logits: a pass of one prompt")
    off = base = n_snap = 0
    for it in items:
        p0, T = it.state.pos, len(it.ids)
        it.off, it.base = off, base
        off, base = off + T, base + p0 + T
        it.snaps = sorted({int(p) - p0 for p in it.snapshot_at if p0 < int(p) < p0 + T})[: MAX_SNAPS - n_snap]
        it.snap0 = n_snap
        n_snap += len(it.snaps)
    m.use_layout(base > m.n_res)  # the K/V stay on the card where the pass's rows fit n_res, else they stream
    moves = OneState(m, items[0]) if len(items) == 1 else ManyStates(m, items)
    try:
        return _walk(m, items, all_logits, rows_in, rows_out, moves, off, n_snap)
    except BaseException:
        moves.abort()  # no copy of this pass goes on writing into the states once the caller has them back
        raise


def _walk(m, items: list[Item], all_logits: bool, rows_in, rows_out, moves, off: int, n_snap: int) -> list:
    """walk's pass, its items laid out (off: their rows, n_snap: their snapshots) and their state moves made."""
    a, b, s, C, st = m.args, m.buf, m.stream, m.chunk, m.streamer
    kv_layers = {i for i, arr in layer_arrays(a.layer_types) if arr.per_token} if b.kv_stream else set()
    prompts = [(it.state, it.base, len(it.ids)) for it in items]
    t0 = time.perf_counter()
    moves.up()
    t_up = time.perf_counter()
    st.reset_timing()
    m.work = Work()
    if rows_in is None:
        st.prefetch(m.first)  # the first layer's weights cross the bus while the host looks up the embeddings
        emb = np.empty((off, a.n_embd), np.float32)
        tok = m.tok_embd
        dequantize_rows(tok.raw(), tok.qtype, tok.ne[0], np.concatenate([it.ids for it in items]), emb)
        for it in items:  # an image's rows take its encoder rows
            for r0, r1, rows in mrope.image_rows(it.state.images, it.state.pos, len(it.ids)):
                emb[it.off + r0 : it.off + r1] = rows
        m.drv.memcpy_htod_async(b.h.gpudata, emb, s)
    else:  # a later card: the rows the card before it handed on (synchronous: that card may write them again)
        b.h[:off].set(rows_in[:off])
        st.prefetch(m.first)
    # everything the layers need from the host goes up now, on the pass's stream: a synchronous copy (legacy
    # default stream) would wait for the copy stream too and undo the overlap of uploads and compute
    rows_pos, pos4, sections = _positions(items, a)
    m.drv.memcpy_htod_async(b.pos.gpudata, np.ascontiguousarray(rows_pos, np.int32), s)
    if pos4 is not None:  # a pass with an image's rows: every row's four positions, on the card for the pass
        from pycuda import gpuarray

        pos4 = gpuarray.to_gpu_async(pos4, stream=s)
    if n_snap and b.snap:  # each snapshot's row within the piece of its prompt holding it (none: rows alone)
        rows = np.array([p - _piece_start(it, p, C) for it in items for p in it.snaps], np.int32)
        m.drv.memcpy_htod_async(b.snap_pos.gpudata, rows, s)
    snap_host = [it.state.sharing_rows(it.state.pos + p) for it in items for p in it.snaps]
    t_emb = time.perf_counter()
    ev0, ev1 = m._event(), m._event()
    ev0.record(s)
    moves.begin()
    n_chunks = m.counts_host.shape[1] if a.is_moe else 0
    used_chunks = 0
    ops = m.ops_type(m)
    for i in range(m.first, min(m.end, a.n_layer)):
        st.prefetch(i + 1)  # the next layer's upload overlaps this layer's compute
        L = m.block(i, st.weights(i, m.layer_names[i]))
        if i in kv_layers:
            kv_up(m.drv, b, i, prompts, s)
        k_chunk = 0
        for j, br in enumerate(m.blocks[i]):
            for r0 in range(0, off, C):
                r1 = min(off, r0 + C)
                h, x = b.h[r0:r1], b.x[: r1 - r0]
                if br.kind == "mixer":  # projections over all prompts' rows together, the rest per prompt
                    pieces = _pieces(items, r0, r1)
                    gdn_segs = [(q - r0, e - r0, q - it.off, [-1] * it.snap0 + it.snaps,
                                 moves.before(jj, i) if q == it.off else None,
                                 moves.after(jj, i) if e == it.off + len(it.ids) else None)
                                for jj, it, q, e in pieces]
                    attn_segs = [(q - r0, e - r0, it.state.pos + q - it.off, it.base) for _, it, q, e in pieces]
                    ops.at(L, b.pos[r0:r1] if pos4 is None else pos4[r0:r1], attn_segs, gdn_segs, snap_host,
                           sections)
                else:  # row by row: all prompts' rows together, in full chunks
                    m._chunk_no = min(k_chunk, n_chunks - 1) if n_chunks else 0  # expert counts: shared past the end
                    k_chunk += 1
                ops.settle(r0, r1)  # a deferred sum into these rows (an earlier branch's, or the layer before's)
                ke.rms_norm(h, L[br.norm], a.rms_eps, out=x, stream=s)
                m._mark(m._phase(i, br))
                ops.h, ops.rows = h, (r0, r1)
                y = br.fn(ops.branch(j), a, x)
                if y is not None:  # None: the ops add it themselves (expert_gpu's exchange), by a later settle()
                    ke.add(h, y, stream=s)
                m._mark(None)
        used_chunks = max(used_chunks, k_chunk)
        moves.layer_done(i)
        st.release(i)
        moves.drain(i)
        if i in kv_layers:
            kv_down(m.drv, b, i, prompts, s)
    ops.settle()
    finals = None
    if m.end > a.n_layer:
        finals = _final_rows(m, items) if m.hidden_to is not None else None  # before the heads: both use b.x
        logits = _heads(m, items, all_logits)
    else:  # the rows go on to the next card through page-locked host memory (no peer-to-peer link assumed)
        m.drv.memcpy_dtoh_async(rows_out[:off], b.h[:off].gpudata, s)
        logits = [rows_out[:off]]
    ev1.record(s)
    t_queued = time.perf_counter()
    s.synchronize()
    t_sync = time.perf_counter()
    moves.down()
    t_down = time.perf_counter()
    if a.is_moe:
        used = m.counts_host[:, : min(used_chunks, n_chunks)].sum(axis=1)  # (n_layer, E)
        for i, e in zip(*np.nonzero(used), strict=True):
            m.expert_counts[(int(i), int(e))] = m.expert_counts.get((int(i), int(e)), 0) + int(used[i, e])
        lo, hi = m.own or (0, a.n_expert)  # the routed products this card ran: its own experts' pairs
        for i in range(a.n_layer):
            m.work.add("moe", i, float(used[i, lo:hi].sum()) * m._exp_nk[i])
    m.last_timing = {"wall_s": time.perf_counter() - t0, "gpu_s": ev1.time_since(ev0) / 1e3,
                     "copy_s": st.copy_seconds(), "bytes_h2d": st.bytes_h2d, "tokens": off, "prompts": len(items),
                     "work": m.work.as_dict(), "phases": m._phase_seconds(),
                     # host: state upload, embedding lookup, launching (ends before the GPU does when the host keeps
                     # ahead), waiting for the card, state download (the rest of it)
                     "host_s": {"upload": t_up - t0, "embed": t_emb - t_up, "launch": t_queued - t_emb,
                                "wait": t_sync - t_queued, "download": t_down - t_sync}}
    for it in items:
        if it.on_snapshot is not None:
            for r in range(len(it.snaps)):
                it.on_snapshot(snap_host[it.snap0 + r], None)
    if finals is not None:
        for it, rows in zip(items, finals, strict=True):
            m.hidden_to(it.state, it.state.pos - len(it.ids), rows)
    return logits


def _final_rows(m, items: list[Item]) -> list[np.ndarray]:
    """Every prompt row's final-norm output (what the head reads), (T, n_embd) float32 on the host for each prompt,
    in chunks of rows through b.x: the MTP drafter's input, which the CPU runs the block over (n_embd floats a row
    cross the bus, against the block's weights and a K/V of its own on the card)."""
    a, b, s, C = m.args, m.buf, m.stream, m.chunk
    norm = m.vec[m.out_norm]
    out = []
    for it in items:
        T = len(it.ids)
        rows = np.empty((T, a.n_embd), np.float32)
        for r0 in range(0, T, C):
            r1 = min(T, r0 + C)
            x = b.x[: r1 - r0]
            ke.rms_norm(b.h[it.off + r0 : it.off + r1], norm, a.rms_eps, out=x, stream=s)
            rows[r0:r1] = x.get(stream=s)
        out.append(rows)
    return out


def _positions(items, a):
    """(rotary positions of the pass's rows, (rows, 4) multimodal positions or None, the sections for them): a row's
    position is its row unless an image comes before or holds it (models/mrope.py)."""
    shifted, multi, any_image = [], [], False
    for it in items:
        shift, p4 = mrope.positions(it.state.images, it.state.pos, len(it.ids))
        rows = np.arange(it.state.pos, it.state.pos + len(it.ids), dtype=np.int32) + np.int32(shift)
        shifted.append(rows)
        multi.append(np.repeat(rows[:, None], 4, axis=1) if p4 is None else p4)
        any_image |= p4 is not None
    rows_pos = np.concatenate(shifted)
    if not any_image:
        return rows_pos, None, None
    # no sections in the file: every pair takes the first stream, as imrope_streams says (one section of 1 does)
    sections = tuple(a.rope_sections) if sum(getattr(a, "rope_sections", ()) or ()) > 0 else (1, 0, 0, 0)
    return rows_pos, np.ascontiguousarray(np.concatenate(multi), dtype=np.int32), sections


def tokens_hash(st: DecoderState) -> int:
    return hash(st.tokens[: st.pos].tobytes())


def pinned_states(m, n: int) -> list[dict]:
    """Page-locked host mirrors of every recurrent array (GDN S and conv) for n prompts (kept on the model and grown
    as needed): a prompt's layer state goes down into them without waiting for the card, while it goes on."""
    b = m.buf
    have = getattr(m, "_multi_pinned", [])
    while len(have) < n:
        have.append({key: m.drv.pagelocked_empty(card.shape, np.float32) for key, card in b.state.items()
                     if not ARRAYS[key[0]].per_token})
    m._multi_pinned = have
    return have[:n]


def save_recurrent(drv, b, i: int, mirrors: dict, s) -> None:
    """Layer i's recurrent arrays queued down into the prompt's pinned mirrors."""
    for (name, j), mirror in mirrors.items():
        if j == i:
            drv.memcpy_dtoh_async(mirror, b.state[name, i].gpudata, s)


def load_recurrent(drv, b, i: int, st: DecoderState, s) -> None:
    """The card's recurrent arrays of layer i made the prompt's: zeros at position 0, else its state copied up (a
    synchronous copy: only after a restore)."""
    for (name, j), card in b.state.items():
        if j == i and not ARRAYS[name].per_token:
            zero_or_upload(drv, card, st.arrays[name][i], st.pos, s)


def _pieces(items: list[Item], r0: int, r1: int) -> list[tuple[int, Item, int, int]]:
    """(index, item, first row, end row) of each prompt with rows in [r0, r1) of the hidden buffer, in order."""
    out = []
    for j, it in enumerate(items):
        q, e = max(r0, it.off), min(r1, it.off + len(it.ids))
        if q < e:
            out.append((j, it, q, e))
    return out


def _piece_start(it: Item, p: int, C: int) -> int:
    """The offset in its prompt of the piece (the part of a chunk of C hidden rows) holding its position p."""
    r0 = (it.off + p - 1) // C * C
    return max(r0, it.off) - it.off


def _heads(m, items: list[Item], all_logits: bool) -> list[np.ndarray]:
    """Through the output norm and the LM head: with all_logits every row of the one prompt, in chunks of rows;
    else each prompt's last row, up to a chunk of prompts per product."""
    a, b, s, C = m.args, m.buf, m.stream, m.chunk
    W = m.streamer.weights(a.n_layer, [m.head])[m.head]
    norm = m.vec[m.out_norm]
    out = []
    if all_logits:
        T = len(items[0].ids)
        parts = []
        for r0 in range(0, T, C):
            r1 = min(T, r0 + C)
            x = b.x[: r1 - r0]
            ke.rms_norm(b.h[r0:r1], norm, a.rms_eps, out=x, stream=s)
            parts.append(m._gemm(a.n_layer, x, W, stream=s).get(stream=s))
        out.append(np.concatenate(parts, axis=0))
    else:
        for g0 in range(0, len(items), C):
            group = items[g0 : g0 + C]
            x = b.x[: len(group)]
            for r, it in enumerate(group):
                last = it.off + len(it.ids) - 1
                ke.rms_norm(b.h[last : last + 1], norm, a.rms_eps, out=x[r : r + 1], stream=s)
            lg = m._gemm(a.n_layer, x, W, stream=s).get(stream=s)
            out.extend(lg[r : r + 1].copy() for r in range(len(group)))
    m.streamer.release(a.n_layer)
    return out

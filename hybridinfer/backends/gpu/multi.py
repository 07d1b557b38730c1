"""Several prompts in one streamed GPU pass: each layer's weights cross the bus once for all of them.

The pass is layer-major as the one-prompt pass (GPUModel.forward) is. Within a layer the mixer (GDN or attention)
runs prompt after prompt, each in its own chunks, continuing its own state: its hidden rows sit at its own offset of
the hidden buffer, its K/V at its own rows of the cache (`base`), and the card's one copy of a GDN layer's conv and S
is loaded with the prompt's state before its chunks (zeroed at position 0, copied up after a restore) and queued down
into page-locked mirrors after them. The FFN or MoE works row by row, so it runs over all prompts' rows together in
full chunks (short prompts would otherwise each make small GEMMs and read every selected expert again). Each
prompt's logits equal those of a pass of its own to the float rounding of the GEMM tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...format.quant import dequantize_rows
from ...models.state_kinds import ARRAYS
from ..state import DecoderState, check_tokens
from . import k_elementwise as ke
from . import k_gemm as kgm
from . import loader
from .handoff import zero_or_upload


@dataclass
class Item:
    """One prompt of a pass: its tokens, the state it continues (at any position), and where to snapshot."""

    ids: np.ndarray
    state: DecoderState
    snapshot_at: tuple = ()
    on_snapshot: object = None
    off: int = 0  # its first row in the hidden buffer
    base: int = 0  # its first row in the K/V cache
    snaps: list = field(default_factory=list)  # its snapshot positions relative to its first token
    snap0: int = 0  # its first slot in the card's snapshot buffers


def plan_groups(lengths: list[tuple[int, int]], n_ctx: int) -> list[list[int]]:
    """Prompts (p0, T) in order, grouped into passes: in each, the new tokens fit the hidden buffer (n_ctx rows)
    and every prompt's whole K/V (p0 + T rows) fits the cache beside the others'."""
    groups: list[list[int]] = []
    rows = kv = 0
    for j, (p0, T) in enumerate(lengths):
        if groups and rows + T <= n_ctx and kv + p0 + T <= n_ctx:
            groups[-1].append(j)
            rows, kv = rows + T, kv + p0 + T
        else:
            groups.append([j])
            rows, kv = T, p0 + T
    return groups


def forward_many(m, prompts) -> list[np.ndarray]:
    """Prefill each (ids, state, snapshot_at, on_snapshot) of `prompts` on GPUModel m in as few passes as the buffers
    allow; returns each prompt's last-token logits (1, n_vocab). States advance as one-prompt passes advance them."""
    items = []
    for ids, st, at, cb in prompts:
        ids = check_tokens(ids, m.args.n_vocab)
        st.check_room(len(ids))
        if st.n_ctx > m.n_ctx:
            raise ValueError(f"state n_ctx {st.n_ctx} exceeds the GPU backend's n_ctx {m.n_ctx}")
        items.append(Item(ids, st, tuple(at), cb))
    out: list = [None] * len(items)
    with loader.on_this_thread():
        for group in plan_groups([(it.state.pos, len(it.ids)) for it in items], m.n_ctx):
            for j, lg in zip(group, _pass(m, [items[j] for j in group]), strict=True):
                out[j] = lg
    return out


def _pass(m, items: list[Item]) -> list[np.ndarray]:
    from .backend import MAX_SNAPS, _Names
    from .graph_ops import GPUOps

    a, b, s, C = m.args, m.buf, m.stream, m.chunk
    drv = m.drv
    off = base = n_snap = 0
    for it in items:
        it.off, it.base = off, base
        off, base = off + len(it.ids), base + it.state.pos + len(it.ids)
        p0, T = it.state.pos, len(it.ids)
        rel = sorted({int(p) - p0 for p in it.snapshot_at if p0 < int(p) < p0 + T})[: MAX_SNAPS - n_snap]
        it.snaps, it.snap0 = rel, n_snap
        n_snap += len(rel)
    m._owner = None  # the card's state buffers end holding pieces of several sequences
    emb = np.empty((off, a.n_embd), np.float32)
    tok = m.tok_embd
    dequantize_rows(tok.raw(), tok.qtype, tok.ne[0], np.concatenate([it.ids for it in items]), emb)
    b.h[:off].set(emb)
    b.pos[:off].set(np.concatenate([np.arange(it.state.pos, it.state.pos + len(it.ids), dtype=np.int32)
                                    for it in items]))
    if n_snap and b.snap:  # each snapshot's position within the piece of its prompt holding it
        sp = [p - _piece_start(it, p, C) for it in items for p in it.snaps]
        b.snap_pos[:n_snap].set(np.array(sp, np.int32))
    snap_host = [None] * n_snap
    rows = [(name, i, card) for (name, i), card in b.state.items() if ARRAYS[name].per_token]
    for it in items:
        st = it.state
        for r, p in enumerate(it.snaps):
            snap_host[it.snap0 + r] = st.sharing_rows(st.pos + p)
        if st.pos:  # a restored prefix: its per-token rows up to this prompt's rows of the cache
            for name, i, card in rows:
                card[it.base : it.base + st.pos].set(np.ascontiguousarray(st.arrays[name][i][: st.pos]))
    stream_w = m.streamer
    stream_w.reset_timing()
    stream_w.prefetch(0)
    n_chunks = m.counts_host.shape[1] if a.is_moe else 0
    used_chunks = 0
    pinned = _pinned_states(m, len(items))
    ops = GPUOps(m)
    for i in range(a.n_layer):
        stream_w.prefetch(i + 1)
        L = _Names(i, stream_w.weights(i, m.layer_names[i]), m.vec)
        k_chunk = 0
        for j, br in enumerate(m.blocks[i]):
            for r0 in range(0, off, C):
                r1 = min(off, r0 + C)
                h, x = b.h[r0:r1], b.x[: r1 - r0]
                if br.kind == "mixer":  # projections over all prompts' rows together, the rest per prompt
                    pieces = _pieces(items, r0, r1)
                    gdn_segs = [(q - r0, e - r0, q - it.off, [-1] * it.snap0 + it.snaps,
                                 (lambda st=it.state, i=i: _load_recurrent(drv, b, i, st, s)) if q == it.off else None,
                                 (lambda jj=jj, i=i: _save_recurrent(drv, b, i, pinned[jj], s))
                                 if e == it.off + len(it.ids) else None)
                                for jj, it, q, e in pieces]
                    attn_segs = [(q - r0, e - r0, it.state.pos + q - it.off, it.base) for _, it, q, e in pieces]
                    ops.at(L, b.pos[r0:r1], attn_segs, gdn_segs, snap_host)
                else:  # row by row: all prompts' rows together, in full chunks
                    m._chunk_no = min(k_chunk, n_chunks - 1) if n_chunks else 0  # expert counts: shared past the end
                    k_chunk += 1
                ke.rms_norm(h, L.v(br.norm), a.rms_eps, out=x, stream=s)
                ke.add(h, br.fn(ops.branch(j), a, x), stream=s)
        used_chunks = max(used_chunks, k_chunk)
        stream_w.release(i)
    logits = _heads(m, items)
    s.synchronize()
    m.last_timing = {"bytes_h2d": stream_w.bytes_h2d, "copy_s": stream_w.copy_seconds(), "tokens": off,
                     "prompts": len(items)}
    for j, it in enumerate(items):
        st, p0, T = it.state, it.state.pos, len(it.ids)
        for (name, i), mirror in pinned[j].items():
            np.copyto(st.arrays[name][i], mirror)
        for name, i, card in rows:
            st.arrays[name][i][p0 : p0 + T] = card[it.base + p0 : it.base + p0 + T].get()
        st.tokens[p0 : p0 + T] = it.ids
        st.pos = p0 + T
    if a.is_moe:
        used = m.counts_host[:, : min(used_chunks, n_chunks)].sum(axis=1)
        for i, e in zip(*np.nonzero(used), strict=True):
            m.expert_counts[(int(i), int(e))] = m.expert_counts.get((int(i), int(e)), 0) + int(used[i, e])
    for it in items:
        if it.on_snapshot is not None:
            for r in range(len(it.snaps)):
                it.on_snapshot(snap_host[it.snap0 + r], None)
    return logits


def _pinned_states(m, n: int) -> list[dict]:
    """Page-locked host mirrors of every recurrent array (GDN S and conv) for n prompts (kept on the model and grown
    as needed): a prompt's layer state goes down into them without waiting for the card, while it goes on."""
    b = m.buf
    have = getattr(m, "_multi_pinned", [])
    while len(have) < n:
        have.append({key: m.drv.pagelocked_empty(card.shape, np.float32) for key, card in b.state.items()
                     if not ARRAYS[key[0]].per_token})
    m._multi_pinned = have
    return have[:n]


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


def _save_recurrent(drv, b, i: int, mirrors: dict, s) -> None:
    """Layer i's recurrent arrays queued down into the prompt's pinned mirrors."""
    for (name, j), mirror in mirrors.items():
        if j == i:
            drv.memcpy_dtoh_async(mirror, b.state[name, i].gpudata, s)


def _load_recurrent(drv, b, i: int, st: DecoderState, s) -> None:
    """The card's recurrent arrays of layer i made the prompt's: zeros at position 0, else its state copied up (a
    synchronous copy: only after a restore)."""
    for (name, j), card in b.state.items():
        if j == i and not ARRAYS[name].per_token:
            zero_or_upload(drv, card, st.arrays[name][i], st.pos, s)


def _heads(m, items: list[Item]) -> list[np.ndarray]:
    """Each prompt's last row through the output norm and the LM head, in chunks of rows."""
    a, b, s = m.args, m.buf, m.stream
    W = m.streamer.weights(a.n_layer, [m.head])[m.head]
    out = []
    for g0 in range(0, len(items), m.chunk):
        group = items[g0 : g0 + m.chunk]
        x = b.x[: len(group)]
        for r, it in enumerate(group):
            last = it.off + len(it.ids) - 1
            ke.rms_norm(b.h[last : last + 1], m.vec[m.out_norm], a.rms_eps, out=x[r : r + 1], stream=s)
        lg = kgm.gemm(x, W, stream=s).get(stream=s)
        out.extend(lg[r : r + 1].copy() for r in range(len(group)))
    m.streamer.release(a.n_layer)
    return out

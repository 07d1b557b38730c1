"""The MTP block on the CPU (models/graph.MTP): the description walked over a prompt workspace (unbound native calls),
each row in its one-token float shape as every product here is (SHAPE), so a row's logits do not depend on how many
rows share the call. Drafting runs it one row at a time."""

from __future__ import annotations

import numpy as np

from ...errors import MTPUnavailableError
from ...format.quant import dequantize_rows
from ...models import graph
from ..state import DecoderState, check_tokens, keep_rows
from .graph_ops import CPUOps, Segments


def _block(model):
    if model.mtp_block is None:
        raise MTPUnavailableError(f"{model.gm.path!r} has no multi-token-prediction block")
    return model.mtp_block


def _head(model, blk):
    """The MTP head's norm vector and matrix: the main head's where the block has none of its own (found once)."""
    c = model.__dict__.setdefault("_mtp_head", {})
    if not c:
        out_norm, out = graph.head(model.args)
        c["norm"] = model.out_norm if blk.norm == out_norm else np.ascontiguousarray(
            model.gm.dequant(blk.norm), dtype=np.float32)
        from .backend import _mat

        c["out"] = model.out if blk.out == out else _mat(model.gm, blk.out)
    return c["norm"], c["out"]


def new_mtp_state(model, n_ctx: int) -> DecoderState:
    _block(model)
    return DecoderState.new(graph.mtp_state_args(model.args), n_ctx)


def _block_input(model, h, tokens, state: DecoderState):
    """(ids, workspace, the block's input rows eh_proj([enorm(embedding), hnorm(h)])) for T rows of `state`."""
    blk, a, simd = _block(model), model.args, model.simd
    ids = check_tokens(tokens, a.n_vocab)
    T, D = len(ids), a.n_embd
    state.check_room(T)
    h = np.ascontiguousarray(np.asarray(h, np.float32).reshape(T, D))
    L = model.mtp_layer
    ws = model.workspace(max(T, 2), state.n_ctx)  # a prompt workspace: its calls are not bound
    e, cat, res = ws.mix[:T], np.empty((T, 2 * D), np.float32), ws.h[:T]
    t = model.tok_embd
    dequantize_rows(t.raw(), t.qtype, t.ne[0], ids, e)
    simd.rms_norm(e, None, L[blk.enorm], a.rms_eps, cat[:, :D])  # concat order: [enorm(e), hnorm(h)]
    simd.rms_norm(h, None, L[blk.hnorm], a.rms_eps, cat[:, D:])
    model.mm(L[blk.eh_proj], cat, res, ws)
    return ids, ws, res


def mtp_forward(model, h, tokens, state: DecoderState, head: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
    """(logits (T, n_vocab) or None without `head`, hidden output (T, n_embd)), the caller's arrays; advances
    `state` by T."""
    blk, a, simd = _block(model), model.args, model.simd
    ids, ws, res = _block_input(model, h, tokens, state)
    T, L, x = len(ids), model.mtp_layer, ws.x[: len(ids)]
    ops = CPUOps(model, ws, state)
    for j, br in enumerate(blk.branches):
        simd.rms_norm(res, None, L[br.norm], a.rms_eps, x)
        out, spare = (ws.mix, ws.ffn) if j % 2 == 0 else (ws.ffn, ws.mix)
        y = br.fn(ops.at(0, j, out, spare, layer=L), a, x)
        simd.rms_norm(res, y, None, a.rms_eps, None)  # res += y
    norm, out = _head(model, blk)
    simd.rms_norm(res, None, norm, a.rms_eps, x)
    logits = np.array(model.mm(out, x, ws.logits, ws), copy=True) if head else None
    state.tokens[state.pos : state.pos + T] = ids
    state.pos += T
    return logits, np.array(x, copy=True)


class _Written(Exception):
    """The K/V rows are in the cache: the rest of the block is not needed (mtp_write)."""


class _KVRows(CPUOps):
    """The block's description walked for its cache rows alone: of the attention's products only the K and V ones
    (each row in its one-token float shape whatever else shares the call: the same bits as the whole pass), the
    K heads normed, then the rows roped and written; the query, the attention, its output and the FFN are never
    computed (a branch's walk stops at the write)."""

    def linears(self, x: np.ndarray, *names: str) -> list:
        got = iter(super().linears(x, *[n for n in names if n in KV_PRODUCTS]))
        return [next(got) if n in KV_PRODUCTS else None for n in names]

    def split_gate(self, qg):
        return None, None

    def head_norm(self, x, name: str):
        return None if x is None else super().head_norm(x, name)

    def attention(self, q, k, v):
        a, st, i = self.a, self.st, self.i
        T, hd = k.shape[0], a.head_dim
        shift, table = self._rope_at(st, T)
        self.m.simd.attn_store(k.reshape(T, -1, hd), v.reshape(T, -1, hd), st.k[i], st.v[i], st.pos, a.n_rot,
                               a.rope_theta, a.rope_neox, self.m.freq_factors, *self.m.kv_types, *self.m.kv_rot,
                               shift, table)
        raise _Written


# the products whose rows the attention writes into its cache (GGUF short names, as models/llama.attention reads)
KV_PRODUCTS = ("attn_k", "attn_v")


def mtp_write(model, h, tokens, state: DecoderState) -> None:
    """The block's K/V rows of T positions, as mtp_forward writes them, and nothing else; advances `state` by T."""
    blk, a = _block(model), model.args
    ids, ws, res = _block_input(model, h, tokens, state)
    T, L = len(ids), model.mtp_layer
    ops = _KVRows(model, ws, state)
    br = blk.branches[0]
    x = ws.x[:T]
    model.simd.rms_norm(res, None, L[br.norm], a.rms_eps, x)
    try:
        br.fn(ops.at(0, 0, ws.mix, ws.ffn, layer=L), a, x)
    except _Written:
        pass
    else:
        raise AssertionError("the MTP block's first branch wrote no K/V rows")
    state.tokens[state.pos : state.pos + T] = ids
    state.pos += T


class MTPParts:
    """CPUModel's MTP methods (Backend.new_mtp_state, mtp, hidden_rows) and the keeping of its final-norm rows."""

    keep_hidden: bool
    hidden_kept: dict

    def new_mtp_state(self, n_ctx: int) -> DecoderState:
        return new_mtp_state(self, n_ctx)

    def mtp(self, h, tokens, state: DecoderState, head: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        return mtp_forward(self, h, tokens, state, head)

    def mtp_write(self, h, tokens, state: DecoderState) -> None:
        mtp_write(self, h, tokens, state)

    def keep_rows(self, state, first: int, rows: np.ndarray) -> None:
        keep_rows(self.hidden_kept, state, first, rows)

    def hidden_rows(self, state):
        return self.hidden_kept.get(id(state))

    def prompt_rows(self, ws, h: np.ndarray, state, head: bool):
        """The end of a prompt pass that ran every row through the last layer (keep_hidden): the final norm of all
        rows, kept for each sequence, then the head over each chunk's last row (the same bits as the trimmed pass:
        every row is in its one-token float shape)."""
        T = h.shape[0]
        x = ws.x[:T]
        self.simd.rms_norm(h, None, self.out_norm, self.args.rms_eps, x)
        segs = list(state) if isinstance(state, Segments) else [(state, 0, T)]
        for st, r0, r1 in segs:
            self.keep_rows(st, st.pos, x[r0:r1])
        ends = [b - 1 for _, _, b in segs]
        x[: len(ends)] = x[ends]
        xs = x[: len(ends)]
        return self.mm(self.out, xs, ws.logits, ws) if head else xs

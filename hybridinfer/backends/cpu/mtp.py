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


def mtp_forward(model, h, tokens, state: DecoderState, head: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
    """(logits (T, n_vocab) or None without `head`, hidden output (T, n_embd)), the caller's arrays; advances
    `state` by T."""
    blk, a, simd = _block(model), model.args, model.simd
    ids = check_tokens(tokens, a.n_vocab)
    T, D = len(ids), a.n_embd
    state.check_room(T)
    h = np.ascontiguousarray(np.asarray(h, np.float32).reshape(T, D))
    L = model.mtp_layer
    ws = model.workspace(max(T, 2), state.n_ctx)  # a prompt workspace: its calls are not bound
    e, cat, res, x = ws.mix[:T], np.empty((T, 2 * D), np.float32), ws.h[:T], ws.x[:T]
    t = model.tok_embd
    dequantize_rows(t.raw(), t.qtype, t.ne[0], ids, e)
    simd.rms_norm(e, None, L[blk.enorm], a.rms_eps, cat[:, :D])  # concat order: [enorm(e), hnorm(h)]
    simd.rms_norm(h, None, L[blk.hnorm], a.rms_eps, cat[:, D:])
    model.mm(L[blk.eh_proj], cat, res, ws)
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


class MTPParts:
    """CPUModel's MTP methods (Backend.new_mtp_state, mtp, hidden_rows) and the keeping of its final-norm rows."""

    keep_hidden: bool
    hidden_kept: dict

    def new_mtp_state(self, n_ctx: int) -> DecoderState:
        return new_mtp_state(self, n_ctx)

    def mtp(self, h, tokens, state: DecoderState, head: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        return mtp_forward(self, h, tokens, state, head)

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

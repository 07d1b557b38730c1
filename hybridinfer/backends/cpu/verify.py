"""Speculative verify rows on the CPU (CPUModel.forward_rows): a few tokens of each of several sequences in one pass,
every row's logits kept, and the means to put each state back to after any of its rows (backends/state.RowsUndo)."""

from __future__ import annotations

from functools import partial

import numpy as np

from ...models.state_kinds import layers_keeping
from ..state import DecoderState, RowsUndo, check_tokens
from .graph_ops import Segments
from .replay import RowsReplay, Steps
from .simd_gdn import gdn_scratch_size


def forward_rows(model, chunks, undo: bool = False):
    """Each (ids, state) of `chunks` in one pass as forward_many runs prompt chunks (products over all rows, attention
    and GDN per sequence), every row's logits kept: one (len(ids), n_vocab) array per chunk, the caller's. Every row
    is in its one-token float shape (SHAPE), so row i is bit-identical to a decode step at that position. The pass is
    recorded and replayed as a decode step is (one sequence: DecodeReplay; several: RowsReplay, per split of rows).
    undo: also one RowsUndo per chunk, which the caller runs before the next verify pass. The GDN layers read their
    state and write the state after the rows out of place (model.verify_out), and each GDN call's inputs are kept:
    keeping every row copies the new state in; going back runs the GDN layers alone over the rows kept, on the state
    the pass left as it was (the same bits as the pass computed there), no product again and no copy of the state.
    Without undo the new state is copied in at once."""
    if len({id(st) for _, st in chunks}) != len(chunks):
        raise ValueError("forward_rows takes one chunk per distinct state")
    if len(chunks) == 1 and len(chunks[0][0]) > 1:
        return _one(model, *chunks[0], undo)
    parts, segs = Segments.of(chunks, model.args.n_vocab, "forward_rows")
    states = [st for st, _, _ in segs]
    model.verify_passes += 1
    undos = [_undo(model, st, b - a, j) for j, (st, a, b) in enumerate(segs)]
    # a workspace of exactly these rows, split so, whose calls are bound: the step is recorded the first time these
    # sequences verify together with this split and replayed after (RowsReplay), each attention at its own position
    ws = model.workspace(0, max(st.n_ctx for st in states), split=tuple(len(ids) for ids in parts))
    ws.tok[:] = np.concatenate(parts)
    rp = ws.replays.get(RowsReplay.key(states))
    out = rp.run() if rp is not None and rp.valid_for(states) else model.recorded(ws, segs, RowsReplay)
    for j, (ids, (st, a, b)) in enumerate(zip(parts, segs, strict=True)):
        if model.keep_hidden:
            model.keep_rows(st, st.pos, ws.x[a:b])
        st.tokens[st.pos : st.pos + len(ids)] = ids
        st.pos += len(ids)
        _kept(undos[j], ws, st, j)
    got = model.copied([out[a:b] for _, a, b in segs])
    if undo:
        return got, undos
    for u, (_, a, b) in zip(undos, segs, strict=True):
        u(b - a)
    return got


def _one(model, ids, st: DecoderState, undo: bool):
    """One sequence's verify rows: a pass over a workspace of exactly that many rows whose calls are bound, recorded
    at the first such step of this state and replayed after (as a decode step is: DecodeReplay), so a verify step
    costs its native calls and not the Python walk of the model. The GDN layers' inputs are copied as steps of the
    recording (CPUOps._keep_inputs) for the rollback."""
    ids = check_tokens(ids, model.args.n_vocab)
    T = len(ids)
    st.check_room(T)
    ws = model.workspace(T, st.n_ctx, verify=True)
    ws.tok[:] = ids
    model.verify_passes += 1
    u = _undo(model, st, T, 0)
    out = model.replayed(ws, st)
    if model.keep_hidden:
        model.keep_rows(st, st.pos, ws.x[:T])
    st.tokens[st.pos : st.pos + T] = ids
    st.pos += T
    got = model.copied([out[:T]])
    _kept(u, ws, st, None)
    if not undo:
        u(T)
        return got
    return got, [u]


def _undo(model, st: DecoderState, n: int, j: int) -> RowsUndo:
    """The rollback of n rows of st, sequence j of the pass (its GDN states' new values go to model.verify_out's
    buffers of j; any other recurrent array is copied over the pool into the buffers kept for st), made before the
    pass. One of the 9B's 48 MiB copies over the pool took ~1.3 ms of a 37 ms decode step on the 16-core host:
    a rolled-back step made two of them before the GDN state was written out of place."""
    now = model.verify_passes
    pending = [pair for i in layers_keeping(st.layer_types, "ssm")
               for pair in zip((st.conv[i], st.ssm[i]), model.verify_out(j, i, st.conv[i], st.ssm[i]), strict=True)]
    return RowsUndo(st, n, partial(_gdn_again, model, st), _buffers(model, st, {id(a) for a, _ in pending}),
                    model.simd.copy_many, pending, lambda: model.verify_passes == now)


def _kept(u: RowsUndo, ws, st: DecoderState, j: int | None) -> None:
    """The GDN calls' arguments of sequence j (None: the one sequence) from the copies the pass made as recorded
    steps (CPUOps._keep_inputs): its rollback runs them again over the rows it keeps."""
    for key, (bufs, rest) in ws.gdn_keep.items():
        i = key if j is None else key[1]
        if j is None or key[0] == j:
            w, tail = rest[:4], rest[4:]
            u.kept[i] = (*bufs, *w, st.conv[i], st.ssm[i], *tail)


def _buffers(model, st: DecoderState, skip: set[int]) -> list[np.ndarray]:
    """The copies of a state's recurrent arrays a verify pass makes (all but `skip`'s, by id), kept for its next one
    (CPUModel.release drops them): fresh pages would cost ten times the copy."""
    got = model.undo_buffers.get(id(st))
    if got is None:
        got = model.undo_buffers[id(st)] = [np.empty_like(a) for _, _, a in st.held(per_token=False)
                                            if id(a) not in skip]
    return got


def _gdn_again(model, st: DecoderState, kept: dict, n: int) -> None:
    """The GDN calls kept by a verify pass, run again over their first n rows on the restored arrays: bound once per
    state, pass and row count (model.again_steps, dropped at the state's release) and run as one native call, not a
    return to Python per layer (per layer and sequence after a verify step of several)."""
    mine = model.again_steps.setdefault(id(st), {})
    # the copies' and the state's own arrays (args[9]: S) by identity: the bound calls keep them alive, so a key
    # found holds these very arrays, even for a state whose id was another's before
    key = (tuple((id(args[0]), id(args[9])) for args in kept.values()), n)
    steps = mine.get(key)
    if steps is None:
        a = model.args
        y = np.empty((n, a.ssm_n_v_heads * a.ssm_d_v), np.float32)
        scratch = np.zeros(gdn_scratch_size(a.ssm_conv_channels, a.ssm_n_v_heads, a.ssm_d_v, min(n, 16)), np.float32)
        calls = [model.simd.bind("gdn_layer", *(x[:n] for x in args[:4]), *args[4:], y, scratch)
                 for args in kept.values()]
        steps = mine[key] = Steps(model.simd, calls)
    steps.run(0)

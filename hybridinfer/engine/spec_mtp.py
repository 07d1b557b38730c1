"""The `mtp` drafter: Qwen3.5/3.6's multi-token-prediction block (models/graph.MTP, Backend.mtp) drafts a sequence's
next tokens, as llama.cpp's draft-mtp does for qwen35 / qwen35moe (one block, run again for each further draft).

Row j of the block's own K/V (its DecoderState, one attention layer) is its pass over (h_j, token j+1), h_j the
trunk's final-norm output at position j (Backend.hidden_rows: what the backend's last calls over the sequence
computed). Every decode step of a sequence that drafts (`observe`; one that does not, every LAG steps) writes the
rows of the positions the trunk has accepted since the last, from the trunk's own rows, after dropping the rows its
drafts wrote (a per-token array: going back is setting its position), so the block's K/V holds accepted positions
only. The last of those rows gives the first draft; each further draft runs the block on the previous draft and the
block's own hidden output. The prompt's positions are written after each prompt chunk (`prefilled`: the CPU backend
then runs every row of the chunk to the final norm; a GPU pass keeps none, so the rows start where the kept ones
do).

The rows are part of the sequence's state (state_kinds.MTP_ROWS, held where the drafter is on: Backend.mtp_rows):
the block's K/V are views of the state's rows (block row j is state row j + 1, so a state at position p holds the
rows < p that are complete), and before each snapshot (`prefilled` again) the state notes h_{p-1} and how many rows
start at position 0. A restored state goes on from them: its rows and the next row's h come back with the prefix,
and it drafts as the sequence that never stopped.

Drafts change no output (engine/spec.py verifies them); they only decide how many tokens a step yields."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from ..models.state_kinds import MTP_ROWS

# positions a sequence not drafting may leave unwritten before observe catches up (below KEEP_ROWS)
LAG = 8
# the block rows' note in a sequence's state: h_{p-1} and the count of the rows that start at position 1
_NOTE = next(a.name for a in MTP_ROWS.arrays if not a.per_token)


@dataclass
class _Seq:
    ms: object  # the block's DecoderState (its K/V views of the sequence's own rows, where the state holds them)
    layer: int | None = None  # the sequence state's layer of the block's rows (state_kinds.MTP_ROWS), or None
    base: int = -1  # the trunk position of its row 0 (-1: none yet)
    true: int = 0  # its rows written from the trunk's rows (the rest: drafts')
    last: tuple | None = None  # (h, next token) of the row at the sequence's last position, for this step
    seed: tuple | None = None  # (position, h) of a restored state: the trunk's row its restore does not compute


class MTPDrafter:
    name = "mtp"

    def __init__(self, backend):
        self.be = backend
        backend.keep_hidden = True
        backend.mtp_rows = True  # each sequence's state holds the block's rows: snapshots keep them
        self.seqs: dict[int, _Seq] = {}

    def _seq(self, st) -> _Seq:
        m = self.seqs.get(id(st))
        if m is None:
            layer = next((i for i, a in enumerate(st.arrays[_NOTE]) if a is not None), None)
            m = self.seqs[id(st)] = _Seq(None, layer)
            n = 0 if layer is None else int(st.arrays[_NOTE][layer][-1])
            if 0 < n < st.pos:  # restored with the block's rows of positions 1..n and h_n: go on from there
                m.base, m.true, m.seed = 0, n, (n, np.array(st.arrays[_NOTE][layer][:-1], copy=True))
            m.ms = self._block_state(st, m, max(m.base, 0))
            weakref.finalize(st, self.seqs.pop, id(st), None)
        return m

    def _block_state(self, st, m: _Seq, base: int):
        """The block's own DecoderState for rows from trunk position `base`: where the sequence's state holds the
        block's rows, its K/V are views of them (block row i is the state's row base + 1 + i), else its own."""
        if m.layer is None:  # rows of its own, indexed from base whatever base is
            return m.ms if m.ms is not None else self.be.new_mtp_state(st.n_ctx)
        ms = self.be.new_mtp_state(max(st.n_ctx - 1 - base, 1))
        mine = [(s.name, i) for s, i, _ in ms.held(per_token=True)]
        rows = [a for _, i, a in st.held(per_token=True) if i == m.layer]
        for (name, i), a in zip(mine, rows, strict=True):
            ms.arrays[name][i] = a[base + 1 : base + 1 + ms.n_ctx]
        return ms

    def release(self, st) -> None:
        """st's sequence has ended: its block state and kept rows go (they view st's buffers)."""
        self.seqs.pop(id(st), None)

    def observe(self, s, drafting: bool = True) -> None:
        """Before sequence s's step (its state at position P, its next token chosen): the block's rows up to
        position P-1 from the trunk's rows; the last one gives the first draft (propose_seq). A step where s drafts
        nothing (drafting False) leaves them until LAG positions wait (each in its one-token shape, so the same
        bits however many a call writes; the trunk keeps KEEP_ROWS of its rows, more than LAG): at a batch where
        drafts do not pay, the block runs once every LAG steps of a sequence instead of at every step."""
        m = self._seq(s.state)
        if not drafting and m.base >= 0 and s.state.pos - m.base - m.true < LAG:
            m.last = None  # stale until the next catch-up: propose_seq drafts nothing meanwhile
            return
        m.last = self._catch_up(m, s.state, s.state.pos - 1, int(s.next_tok))

    def prefilled(self, st) -> None:
        """After a prompt chunk of `st` (the CPU keeps all its rows for this drafter), and before a snapshot of it:
        the block's rows of the positions whose next token the state holds, and the state's note of them (what a
        snapshot keeps, and a restore goes on from)."""
        m = self._seq(st)
        if m.base < 0 or m.base + m.true < st.pos - 1:
            self._catch_up(m, st, st.pos - 2, None)
        if m.layer is None:
            return
        got = self._rows(m, st)
        h = st.arrays[_NOTE][m.layer]
        q = st.pos - 1
        if m.base == 0 and m.true >= q > 0 and got is not None and got[0] <= q < got[0] + len(got[1]):
            h[:-1], h[-1] = got[1][q - got[0]], q
        else:
            h[-1] = 0  # the rows do not start at position 0 (a GPU pass, rows missing): a restore starts them again

    def _rows(self, m: _Seq, st):
        """The trunk's kept final-norm rows of st (Backend.hidden_rows), after a restored state's row before them."""
        got = self.be.hidden_rows(st)
        if m.seed is None:
            return got
        p, h = m.seed
        if m.true > p:  # its row is written
            m.seed = None
            return got
        if got is None:
            return p, h[None]
        return (p, np.concatenate([h[None], got[1]])) if got[0] == p + 1 else got

    def _catch_up(self, m: _Seq, st, q: int, nxt: int | None):
        """The block's rows of positions up to q from the trunk's kept rows, after dropping the drafts' rows (no
        head: most steps draw no draft); (h_q, the token after q) of the last, or None when the rows are not kept."""
        got = self._rows(m, st)
        if q < 0 or got is None or not got[0] <= q < got[0] + len(got[1]):
            return None
        f, rows = got
        if m.base < 0 or not f <= m.base + m.true <= q + 1:  # nothing yet, positions missing, or a state gone
            m.base, m.true = f, 0  # back (reset): start the rows at the first kept one
            m.ms, m.seed = self._block_state(st, m, f), None
        start = m.base + m.true
        toks = [int(t) for t in st.tokens[start + 1 : min(q + 2, st.pos)]]  # the tokens after start .. q
        if nxt is not None and len(toks) == q - start:
            toks.append(nxt)
        if start > q or len(toks) != q + 1 - start:
            return None
        m.ms.pos = m.true
        self.be.mtp_write(rows[start - f : q - f + 1], toks, m.ms)  # its K/V rows: no output is read
        m.true = m.ms.pos
        return rows[q - f], toks[-1]

    def propose_seq(self, s, k: int) -> list[int]:
        m = self.seqs.get(id(s.state))
        if m is None or m.last is None or k <= 0:
            return []
        m.ms.pos = m.true - 1  # the last row again, with its head this time (the same bits in its K/V row)
        lg, y = self.be.mtp(m.last[0][None], [m.last[1]], m.ms)
        y = y[0]
        out = [int(np.argmax(lg[0]))]
        while len(out) < k:
            lg2, y2 = self.be.mtp(y[None], [out[-1]], m.ms)
            y = y2[0]
            out.append(int(np.argmax(lg2[0])))
        return out

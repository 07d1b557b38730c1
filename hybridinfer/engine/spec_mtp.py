"""The `mtp` drafter: Qwen3.5/3.6's multi-token-prediction block (models/graph.MTP, Backend.mtp) drafts a sequence's
next tokens, as llama.cpp's draft-mtp does for qwen35 / qwen35moe (one block, run again for each further draft).

Row j of the block's own K/V (its DecoderState, one attention layer) is its pass over (h_j, token j+1), h_j the
trunk's final-norm output at position j (Backend.hidden_rows: what the backend's last calls over the sequence
computed). Every decode step of a sequence (`observe`) writes the rows of the positions the trunk has accepted since
the last step, from the trunk's own rows, after dropping the rows its drafts wrote (a per-token array: going back is
setting its position), so the block's K/V holds accepted positions only. The last of those rows gives the first
draft; each further draft runs the block on the previous draft and the block's own hidden output. The prompt's
positions are written after each prompt chunk (`prefilled`: the CPU backend then runs every row of the chunk to
the final norm; a GPU pass or a restored prefix keeps none, so the rows start where the kept ones do).

Drafts change no output (engine/spec.py verifies them); they only decide how many tokens a step yields."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np


@dataclass
class _Seq:
    ms: object  # the block's DecoderState
    base: int = -1  # the trunk position of its row 0 (-1: none yet)
    true: int = 0  # its rows written from the trunk's rows (the rest: drafts')
    last: tuple | None = None  # (h, next token) of the row at the sequence's last position, for this step


class MTPDrafter:
    name = "mtp"

    def __init__(self, backend):
        self.be = backend
        backend.keep_hidden = True
        self.seqs: dict[int, _Seq] = {}

    def _seq(self, st) -> _Seq:
        m = self.seqs.get(id(st))
        if m is None:
            m = self.seqs[id(st)] = _Seq(self.be.new_mtp_state(st.n_ctx))
            weakref.finalize(st, self.seqs.pop, id(st), None)
        return m

    def observe(self, s) -> None:
        """Before sequence s's step (its state at position P, its next token chosen): the block's rows up to
        position P-1 from the trunk's rows; the last one gives the first draft (propose_seq)."""
        m = self._seq(s.state)
        m.last = self._catch_up(m, s.state, s.state.pos - 1, int(s.next_tok))

    def prefilled(self, st) -> None:
        """After a prompt chunk of `st` (the CPU keeps all its rows for this drafter): the block's rows of the
        positions whose next token the state holds."""
        self._catch_up(self._seq(st), st, st.pos - 2, None)

    def _catch_up(self, m: _Seq, st, q: int, nxt: int | None):
        """The block's rows of positions up to q from the trunk's kept rows, after dropping the drafts' rows (no
        head: most steps draw no draft); (h_q, the token after q) of the last, or None when the rows are not kept."""
        got = self.be.hidden_rows(st)
        if q < 0 or got is None or not got[0] <= q < got[0] + len(got[1]):
            return None
        f, rows = got
        if m.base < 0 or not f <= m.base + m.true <= q + 1:  # nothing yet, positions missing, or a state gone
            m.base, m.true = f, 0  # back (reset): start the rows at the first kept one
        start = m.base + m.true
        toks = [int(t) for t in st.tokens[start + 1 : min(q + 2, st.pos)]]  # the tokens after start .. q
        if nxt is not None and len(toks) == q - start:
            toks.append(nxt)
        if start > q or len(toks) != q + 1 - start:
            return None
        m.ms.pos = m.true
        self.be.mtp(rows[start - f : q - f + 1], toks, m.ms, head=False)
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

"""The decoder state between the host `DecoderState` and the card's copy (Buffers.state), for the GPU backend.

What moves is what the mixer kinds declare (models/state_kinds.py). Up: a state at position 0 has no history, so
the card's recurrent arrays (GDN conv and S) are zeroed in place (no copy); a state further on (a prefix-cache
restore, or CPU decode since the last prefill) is copied up, recurrent arrays whole and per-token arrays (K/V) up to
its position. Down: each layer's final recurrent arrays and its new per-token rows are queued for copy into pinned
host memory as soon as the layer's last chunk is queued, and copied on into the host state between later layers
once they have arrived, so both copies overlap the card's work. Per-token rows beyond one chunk (a long prompt's
K/V) come down between later layers too, straight into the host state on a stream of their own (after the pass,
a 4,096-token prompt's 168 MB of the 35B-A3B's K/V took ~50 ms on the host after the card was through).
"""

from __future__ import annotations

import numpy as np

from ...models.state_kinds import ARRAYS
from ..state import DecoderState


def zero_or_upload(drv, card, host: np.ndarray, pos: int, stream) -> None:
    """A recurrent array on the card made the host's: zeros at position 0 (in place, on `stream`), else a copy up
    (synchronous: the null stream waits for the pass's stream)."""
    if pos == 0:
        drv.memset_d32_async(card.gpudata, 0, card.size, stream)
    else:
        card.set(np.ascontiguousarray(host))


class StateHandoff:
    """Pinned host mirrors of one sequence's recurrent arrays (whole) and `chunk` rows of its per-token arrays,
    for every layer: one page-locked allocation, made once."""

    def __init__(self, buf, chunk: int):
        import pycuda.driver as drv

        self.drv, self.buf, self.chunk = drv, buf, chunk
        parts = [(key, a[:chunk] if ARRAYS[key[0]].per_token else a) for key, a in buf.state.items()]
        offs, total = [], 0
        for _, a in parts:  # each mirror at a multiple of 64 bytes, in its array's dtype (K/V: their cache types)
            offs.append(total)
            total += -(-a.nbytes // 64) * 64
        self.pinned = drv.pagelocked_empty(max(total, 1), np.uint8)
        self.host: dict[tuple[str, int], np.ndarray] = {}
        for (key, a), off in zip(parts, offs, strict=True):
            self.host[key] = self.pinned[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
        self.nbytes = self.pinned.nbytes
        self.layers: dict[int, list] = {}  # layer -> (array spec, card array, host mirror) of each array it keeps
        for (name, i), a in buf.state.items():
            self.layers.setdefault(i, []).append((ARRAYS[name], a, self.host[name, i]))
        self._st, self._p0, self._T, self._kv_rows = None, 0, 0, 0  # the pass in progress
        # long per-token runs: not the legacy stream, which would wait for every layer queued after theirs
        self.down = drv.Stream(flags=1)  # CU_STREAM_NON_BLOCKING
        self._pending: list[tuple[int, object]] = []  # (layer, event after its copies)
        self._late: list = []  # (host rows, card rows) copied after the pass

    def upload(self, st: DecoderState, stream) -> None:
        """Make the card's copy equal `st` (zeroing recurrent arrays in place at position 0)."""
        p = st.pos
        for (name, i), card in self.buf.state.items():
            host = st.arrays[name][i]
            if not ARRAYS[name].per_token:
                zero_or_upload(self.drv, card, host, p, stream)
            elif p:
                card[:p].set(np.ascontiguousarray(host[:p]))

    def begin(self, st: DecoderState, p0: int, T: int) -> None:
        """A pass of T tokens from position p0 into `st` starts."""
        self._st, self._p0, self._T = st, p0, T
        self._kv_rows = T if T <= self.chunk else 0
        self._pending, self._late = [], []

    def layer_done(self, i: int, stream) -> None:
        """Queue layer i's final state for the host (call after its last chunk is queued on `stream`)."""
        d, p0, n = self.drv, self._p0, self._kv_rows
        queued = False
        for s, card, host in self.layers.get(i, ()):
            if not s.per_token:
                d.memcpy_dtoh_async(host, card.gpudata, stream)
            elif n:
                d.memcpy_dtoh_async(host[:n], card[p0 : p0 + n].gpudata, stream)
            # else: a long run, copied straight from the card once the layer is through (drain)
            queued = True
        if not queued:
            return
        ev = d.Event()
        ev.record(stream)
        self._pending.append((i, ev))

    def drain(self, wait_through: int | None = None) -> None:
        """Copy the layers whose state has arrived into the host state, in order, waiting for those up to layer
        `wait_through` (all: a large number). Called between layers with wait_through a layer or two back, the
        host keeps only that far ahead of the card, and its copies overlap the card's work on later layers
        (the pinned copies wait until the card is there, so without waiting most were left for the end)."""
        while self._pending:
            i, ev = self._pending[0]
            if wait_through is not None and i <= wait_through:
                ev.synchronize()
            elif not ev.query():
                return
            self._pending.pop(0)
            st, p0, n = self._st, self._p0, self._kv_rows
            for s, card, host in self.layers.get(i, ()):
                if not s.per_token:
                    np.copyto(st.arrays[s.name][i], host)
                elif n:
                    st.arrays[s.name][i][p0 : p0 + n] = host[:n]
                else:  # the layer is through: its rows straight from the card (pageable: returns when copied)
                    rows, src = st.arrays[s.name][i][p0 : p0 + self._T], card[p0 : p0 + self._T]
                    if rows.dtype == src.dtype and rows.shape == src.shape and rows.flags.c_contiguous:
                        self.drv.memcpy_dtoh_async(rows, src.gpudata, self.down)
                    else:  # cast on the way: after the pass (a get() now would wait for the layers queued)
                        self._late.append((rows, src))

    def finish(self) -> None:
        """After the pass: the rest of the queued copies."""
        self.drain(wait_through=1 << 30)
        self.down.synchronize()
        for rows, src in self._late:
            rows[...] = src.get()
        self._st, self._late = None, []


def kv_up(drv, buf, i: int, prompts, stream) -> None:
    """Before layer i in a pass that streams K/V (Buffers kv_stream): each prompt's cached rows of the layer (rows
    [0, pos) of its host state) up into the card's slot at its base. prompts: (state, base, T) of each prompt."""
    for name, slot in buf.slot.items():
        for st, base, _ in prompts:
            if st.pos:
                drv.memcpy_htod_async(slot[base : base + st.pos].gpudata,
                                      np.ascontiguousarray(st.arrays[name][i][: st.pos]), stream)


def kv_down(drv, buf, i: int, prompts, stream) -> None:
    """After layer i's last chunk is queued: the pass's new rows of the layer (rows [pos, pos + T) of each prompt)
    down from the slot into the host states before a later layer takes the slot. The host state is not page-locked,
    so the copy waits for the card: a long prompt's layer takes far longer than that wait."""
    for name, slot in buf.slot.items():
        for st, base, T in prompts:
            p = st.pos
            drv.memcpy_dtoh_async(st.arrays[name][i][p : p + T], slot[base + p : base + p + T].gpudata, stream)

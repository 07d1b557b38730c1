"""The decoder state between the host `DecoderState` and the card's copy (Buffers), for the GPU backend.

Up: a state at position 0 has no history, so the card's conv and S are zeroed in place (no copy); a state
further on (a prefix-cache restore, or CPU decode since the last prefill) is copied up.
Down: each layer's final conv and S (GDN) or its new K/V rows (attention) are queued for copy into pinned
host memory as soon as the layer's last chunk is queued, and copied on into the host state between later
layers once they have arrived, so both copies overlap the card's work. K/V rows beyond one chunk come down
synchronously after the pass.
"""

from __future__ import annotations

import numpy as np

from ..state import DecoderState


class StateHandoff:
    """Pinned host mirrors of one sequence's conv and S (every GDN layer) and `chunk` K/V rows (every
    attention layer): one page-locked allocation, made once."""

    def __init__(self, buf, chunk: int):
        import pycuda.driver as drv

        self.drv, self.buf, self.chunk = drv, buf, chunk
        parts = [(("S", i), a) for i, a in getattr(buf, "S", {}).items()]
        parts += [(("conv", i), a) for i, a in getattr(buf, "conv", {}).items()]
        parts += [((kind, i), a[:chunk]) for kind, d in (("k", buf.kc), ("v", buf.vc)) for i, a in d.items()]
        total = sum(a.size for _, a in parts)
        self.pinned = drv.pagelocked_empty(max(total, 1), np.float32)  # float32 [total]
        self.host: dict[tuple[str, int], np.ndarray] = {}
        off = 0
        for key, a in parts:
            self.host[key] = self.pinned[off : off + a.size].reshape(a.shape)
            off += a.size
        self.nbytes = self.pinned.nbytes
        self._st, self._p0, self._T, self._kv_rows = None, 0, 0, 0  # the pass in progress
        self._pending: list[tuple[int, str, object]] = []  # (layer, kind, event after its copies)

    def upload(self, st: DecoderState, stream) -> None:
        """Make the card's copy equal `st` (zeroing in place at position 0)."""
        b, p = self.buf, st.pos
        for i in getattr(b, "S", {}):
            if p == 0:
                self.drv.memset_d32_async(b.S[i].gpudata, 0, b.S[i].size, stream)
                self.drv.memset_d32_async(b.conv[i].gpudata, 0, b.conv[i].size, stream)
            else:
                b.S[i].set(st.ssm[i])
                b.conv[i].set(st.conv[i])
        if p:
            for i in b.kc:
                b.kc[i][:p].set(np.ascontiguousarray(st.k[i][:p]))
                b.vc[i][:p].set(np.ascontiguousarray(st.v[i][:p]))

    def begin(self, st: DecoderState, p0: int, T: int) -> None:
        """A pass of T tokens from position p0 into `st` starts."""
        self._st, self._p0, self._T = st, p0, T
        self._kv_rows = T if T <= self.chunk else 0
        self._pending: list[tuple[int, str, object]] = []

    def layer_done(self, i: int, kind: str, stream) -> None:
        """Queue layer i's final state for the host (call after its last chunk is queued on `stream`)."""
        b, d, p0 = self.buf, self.drv, self._p0
        if kind == "gdn":
            d.memcpy_dtoh_async(self.host[("S", i)], b.S[i].gpudata, stream)
            d.memcpy_dtoh_async(self.host[("conv", i)], b.conv[i].gpudata, stream)
        elif self._kv_rows:
            n = self._kv_rows
            d.memcpy_dtoh_async(self.host[("k", i)][:n], b.kc[i][p0 : p0 + n].gpudata, stream)
            d.memcpy_dtoh_async(self.host[("v", i)][:n], b.vc[i][p0 : p0 + n].gpudata, stream)
        else:
            return
        ev = d.Event()
        ev.record(stream)
        self._pending.append((i, kind, ev))

    def drain(self, wait_through: int | None = None) -> None:
        """Copy the layers whose state has arrived into the host state, in order, waiting for those up to layer
        `wait_through` (all: a large number). Called between layers with wait_through a layer or two back, the
        host keeps only that far ahead of the card, and its copies overlap the card's work on later layers
        (the pinned copies wait until the card is there, so without waiting most were left for the end)."""
        while self._pending:
            i, kind, ev = self._pending[0]
            if wait_through is not None and i <= wait_through:
                ev.synchronize()
            elif not ev.query():
                return
            self._pending.pop(0)
            st = self._st
            if kind == "gdn":
                np.copyto(st.ssm[i], self.host[("S", i)])
                np.copyto(st.conv[i], self.host[("conv", i)])
            else:
                p0, n = self._p0, self._kv_rows
                st.k[i][p0 : p0 + n] = self.host[("k", i)][:n]
                st.v[i][p0 : p0 + n] = self.host[("v", i)][:n]

    def finish(self) -> None:
        """After the pass: the rest of the queued copies; K/V runs longer than a chunk straight from the card."""
        self.drain(wait_through=1 << 30)
        if not self._kv_rows:
            st, p0, p1, b = self._st, self._p0, self._p0 + self._T, self.buf
            for i in b.kc:
                st.k[i][p0:p1] = b.kc[i][p0:p1].get()
                st.v[i][p0:p1] = b.vc[i][p0:p1].get()
        self._st = None

"""GPU prefill under a RAM budget: a streamed layer's routed experts that the card does not pin are read from the GGUF
into one of two page-locked staging buffers, then uploaded from there (Streamer.prefetch, the usual H2D path and its
Pacer), instead of from a page-locked copy of the whole tensor kept for the model's life.

In a GGUF one expert of a stacked `ffn_*_exps` tensor is one contiguous byte range, so a layer's cold experts are the
runs of experts between the card's pinned ones (`runs`): each run is one H2D copy, as for a host copy, and is read in
pieces of at most PIECE bytes (several readers at once; O_DIRECT's per-thread buffers stay small). A prompt pass routes
to nearly every expert, and the upload precedes the router, so every cold expert of the layer is read on each pass.

Order (DiskStager; layers in the order a pass runs them, k-th disk-read layer in buffer k % 2):
  prefetch(L):  take(L)      wait for L's reads (issued one layer earlier; the first layer of a pass: now)
                queue L's H2D copies from its buffer, record `end`; uploaded(L, end)
                start(next)  the next disk-read layer's reads into the other buffer, once that buffer's last upload is
                             done (end.synchronize()): they run while the card computes the layers before it
The reads go through backends/expert_io.py's ExpertReader (the CPU's expert store's reader): a truncated, rewritten or
moved file, a failed read or one not done within the timeout is an ExpertReadError, and every later read refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...errors import ExpertReadError
from ..ram_split import GpuHost

PIECE = 4 << 20  # the largest single read


def pinned_runs(slot_of) -> list[tuple[int, int, int]]:
    """(first expert, its index in the packed pinned copy, count) of each maximal run of pinned experts whose ids and
    packed indices both follow on (slot_of: expert -> packed index): one on-card copy a run."""
    out: list[list[int]] = []
    for e in sorted(slot_of):
        k = slot_of[e]
        if out and out[-1][0] + out[-1][2] == e and out[-1][1] + out[-1][2] == k:
            out[-1][2] += 1
        else:
            out.append([e, k, 1])
    return [tuple(r) for r in out]


def runs(n: int, pinned) -> list[tuple[int, int]]:
    """The maximal runs [e, e2) of 0..n-1 not in `pinned` (n 0: one tensor that is not stacked, one run)."""
    n = max(1, int(n))
    out, e = [], 0
    while e < n:
        if e in pinned:
            e += 1
            continue
        e2 = e
        while e2 < n and e2 not in pinned:
            e2 += 1
        out.append((e, e2))
        e = e2
    return out


@dataclass(frozen=True)
class LayerStage:
    """One layer's cold experts in a staging buffer: `copies` per tensor (offset in the tensor, offset in the buffer,
    bytes) in the buffer's order, one per run of experts; `reads` (offset in the buffer, offset in the file, bytes),
    the same bytes cut into pieces of at most PIECE."""

    layer: int
    nbytes: int
    copies: Mapping[str, tuple[tuple[int, int, int], ...]]
    reads: tuple[tuple[int, int, int], ...]


def stage_layer(layer: int, tensors, piece: int = PIECE) -> LayerStage:
    """tensors: (name, file offset, bytes of one expert, n_expert, experts pinned on the card) of a layer's expert
    tensors that stream, in the order the Streamer lays them out."""
    copies, reads, pos = {}, [], 0
    piece = max(1, int(piece))
    for name, offset, slab, n_expert, pinned in tensors:
        copies[name] = cs = run_copies(slab, n_expert, pinned, pos)
        for t, h, n in cs:
            reads += [(h + r, offset + t + r, min(piece, n - r)) for r in range(0, n, piece)]
            pos = h + n
    return LayerStage(layer, pos, copies, tuple(reads))


def run_copies(slab: int, n_expert: int, pinned, pos: int = 0) -> tuple[tuple[int, int, int], ...]:
    """(offset in the tensor, offset in a buffer, bytes) of each run of a tensor's experts not in `pinned`, laid back
    to back in the buffer from `pos` (a tensor that is not stacked: one run, the whole of it): how a LayerStage and
    the Streamer's page-locked copies hold the bytes that go up."""
    out = []
    for e, e2 in runs(n_expert, pinned):
        out.append((e * slab, pos, (e2 - e) * slab))
        pos += (e2 - e) * slab
    return tuple(out)


def file_offsets(gm, infos) -> dict[str, int]:
    """Where each of `infos`' tensors starts in the file: a card's share of an expert split (WeightInfo.first_expert)
    starts at its first expert, so its expert e is the file's first_expert + e."""
    return {n: int(gm.tensor(n).offset) + w.first_expert * w.slab for n, w in infos.items()}


def stage_plan(placement, infos, offsets: Mapping[str, int], layers=None, piece: int = PIECE) -> dict[int, LayerStage]:
    """The LayerStage of every streamed layer with routed experts (of `layers`, default all) the card does not hold
    whole. offsets: each tensor's byte offset in the file (file_offsets)."""
    out = {}
    for layer, names in sorted(placement.streamed.items()):
        if layers is not None and layer not in layers:
            continue
        ts = [(n, int(offsets[n]), infos[n].slab, infos[n].n_expert, placement.pinned_experts.get(n, set()))
              for n in names if infos[n].n_expert and n not in placement.resident]
        if ts:
            out[layer] = stage_layer(layer, ts, piece)
    return out


@dataclass(frozen=True)
class DiskSource:
    """How GPUModel reads the routed experts it does not keep under a RAM budget: an ExpertReader's options (the CPU
    backend's of the same names: expert_setup.ExpertOptions)."""

    path: str
    io: str = "pread"
    readers: int = 8
    timeout: float = 30.0
    drop_cache: bool = False

    def reader(self):
        from ..expert_io import ExpertReader

        return ExpertReader(self.path, self.io, self.readers, self.timeout, self.drop_cache, PIECE)


def host_need(placement, infos, plan: Mapping[int, LayerStage], bounce: int = 0) -> GpuHost:
    """The GpuHost of a Streamer of `placement` reading `plan`'s layers from the file: its page-locked copies of the
    other streamed tensors, each planned layer's staged bytes, the readers' buffers."""
    staged = {n for st in plan.values() for n in st.copies}
    dense = sum(infos[n].nbytes - len(placement.pinned_experts.get(n, ())) * infos[n].slab  # its streamed experts
                for names in placement.streamed.values() for n in names
                if n not in placement.resident and n not in staged)
    return GpuHost(dense, {i: st.nbytes for i, st in plan.items()}, bounce if plan else 0)


class DiskStager:
    """Two page-locked buffers (drv.pagelocked_empty) of the largest LayerStage, filled by `reader` (an ExpertReader
    of the model file) a layer ahead of the uploads (the order in the module's docstring)."""

    def __init__(self, drv, reader, plan: Mapping[int, LayerStage]):
        self.reader, self.plan = reader, dict(plan)
        self.order = sorted(self.plan)
        size = max((s.nbytes for s in self.plan.values()), default=0)
        self.bufs = [drv.pagelocked_empty(max(size, 1), np.uint8) for _ in range(2)]
        self.nbytes = 2 * max(size, 1)
        self.holds: list = [None, None]  # per buffer: (layer, futures of its reads) or None
        self.done: list = [None, None]  # per buffer: the event after the last upload that reads it
        self.turn = 0  # the buffer the next start() fills
        self.broken: Exception | None = None
        self.log: list[tuple[int, int]] = []  # (layer, buffer) of each start(), in order

    def __contains__(self, layer: int) -> bool:
        return layer in self.plan

    def next_after(self, layer: int) -> int | None:
        return next((j for j in self.order if j > layer), None)

    def _check(self) -> None:
        if self.broken is not None:
            raise ExpertReadError(f"{self.reader.path!r}: expert reads stopped after an earlier failure: "
                                  f"{self.broken}")

    def _wait(self, futs, where: str) -> None:
        try:
            self.reader.wait(futs, where)
        except Exception as e:
            self.broken = e
            raise

    def start(self, layer: int) -> None:
        """Issue `layer`'s reads into the buffer whose turn it is, after what that buffer held was uploaded."""
        self._check()
        if any(h is not None and h[0] == layer for h in self.holds):
            return
        b, st = self.turn, self.plan[layer]
        self.turn ^= 1
        held, self.holds[b] = self.holds[b], None
        if held is not None:  # a read-ahead no pass took: done before the buffer is written again
            self._wait(held[1], f"the experts of layer {held[0]}")
        if self.done[b] is not None:
            self.done[b].synchronize()  # the card has copied what the buffer held
            self.done[b] = None
        try:
            self.reader.check(f"the experts of layer {layer}")
        except ExpertReadError as e:
            self.broken = e
            raise
        buf = self.bufs[b]
        futs = [self.reader.submit(buf[h : h + n], f) for h, f, n in st.reads]
        self.holds[b] = (layer, futs)
        self.log.append((layer, b))

    def take(self, layer: int) -> tuple[int, np.ndarray]:
        """(buffer index, its bytes) holding `layer`'s cold experts once read (reading them now if not issued)."""
        b = next((i for i, h in enumerate(self.holds) if h is not None and h[0] == layer), None)
        if b is None:
            self.start(layer)
            b = self.turn ^ 1
        self._check()
        self._wait(self.holds[b][1], f"the experts of layer {layer}")
        self.holds[b] = None
        return b, self.bufs[b][: self.plan[layer].nbytes]

    def uploaded(self, b: int, event) -> None:
        """The copies out of buffer b were queued; `event` follows them on the copy stream."""
        self.done[b] = event

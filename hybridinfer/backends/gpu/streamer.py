"""Weights on the card under a Placement: resident tensors uploaded once; streamed layers pass through two
staging buffers on the card, filled from pinned host copies on their own copy stream while the previous
layer computes (double buffering). Pinned experts of a streamed expert tensor are copied card-to-card into
their slot, so kernels always see whole [E, N, K] tensors.

Order of events for layer L in slot s = L % 2:
  copy stream:    wait free[s]  -> D2D (pinned experts) + H2D (streamed bytes) -> record ready[L]
  compute stream: wait ready[L] -> the layer's kernels -> record free[s]

With `bus_bw` (bytes/s) the H2D copies are paced to that rate (k_pace.Pacer: an old card's bus on a fast one).
Under a RAM budget (`disk`) the routed experts of the layers a disk_stage.LayerStage names have no host copy: each
upload takes them from a staging buffer the file was read into a layer ahead (disk_stage.py).
"""

from __future__ import annotations

import numpy as np

from .disk_stage import DiskStager, pinned_runs, run_copies, runs
from .k_gemm import DeviceWeight
from .placement import STAGE_ALIGN as ALIGN
from .placement import Placement, WeightInfo


def _shape(t, info: WeightInfo | None = None) -> tuple:
    """numpy order: (E, N, K) or (N, K) or (K,); with `info`, E its experts (a card's share of an expert split)"""
    shp = tuple(int(x) for x in reversed(t.ne))
    return (info.n_expert, *shp[1:]) if info is not None and info.n_expert else shp


def file_bytes(gm, info: WeightInfo) -> np.ndarray:
    """The file's bytes of `info`: the whole tensor, or its experts [first_expert, first_expert + n_expert)."""
    raw = np.asarray(gm.tensor(info.name).raw()).view(np.uint8).reshape(-1)
    return raw[info.first_expert * info.slab : info.first_expert * info.slab + info.nbytes] if info.n_expert else raw


def _parts(buf: np.ndarray, copies) -> list[np.ndarray]:
    """The views of `buf` that `copies` ((offset in the tensor, offset in buf, bytes) a run) lay out."""
    return [buf[h : h + k] for _, h, k in copies]


def _fill(buf: np.ndarray, raw: np.ndarray, copies) -> list[np.ndarray]:
    """buf's runs of `copies` filled from the tensor's bytes `raw`; their views (_parts)."""
    for t, h, k in copies:
        buf[h : h + k] = raw[t : t + k]
    return _parts(buf, copies)


class Streamer:
    def __init__(self, gm, placement: Placement, infos: dict[str, WeightInfo], compute_stream, progress=None,
                 bus_bw: float | None = None, disk=None):
        """disk: None, or (an ExpertReader of the model file, disk_stage.stage_plan's LayerStages): those layers' cold
        experts are read from the file on every pass instead of kept in page-locked host copies."""
        import pycuda.driver as drv
        from pycuda import gpuarray

        from .k_pace import Pacer

        self.pacer = Pacer(bus_bw) if bus_bw is not None else None
        self.drv, self.gm, self.p, self.infos = drv, gm, placement, infos
        self.compute = compute_stream
        self.copy = drv.Stream()
        self.resident: dict[str, DeviceWeight] = {}
        self.pinned: dict[str, tuple] = {}  # expert tensor -> (DeviceWeight of its pinned slabs, {e: slot})
        self.host: dict[str, np.ndarray] = {}  # streamed tensor -> pinned host copy (uint8)
        self.host_parts: dict[str, list] = {}  # streamed tensor -> its copy's views, one a run of experts uploaded
        self.device_bytes = 0
        for name in sorted(placement.resident):
            t, info = gm.tensor(name), infos[name]
            self.resident[name] = DeviceWeight.upload(file_bytes(gm, info), t.qtype, _shape(t, info))
            self.device_bytes += info.nbytes
            if progress is not None:
                progress(info.nbytes)
        for name, es in placement.pinned_experts.items():
            t = gm.tensor(name)
            order = sorted(es)
            slab = infos[name].slab
            raw = file_bytes(gm, infos[name])
            packed = np.concatenate([raw[e * slab : (e + 1) * slab] for e in order])
            shp = _shape(t, infos[name])
            self.pinned[name] = (DeviceWeight(t.qtype, (len(order),) + shp[1:], gpuarray.to_gpu(packed)),
                                 {e: i for i, e in enumerate(order)})
            self.device_bytes += packed.nbytes
            if progress is not None:
                progress(packed.nbytes)
        # per streamed layer: slot layout (offsets of its tensors) and pinned host copies
        self.layout: dict[int, list[tuple[str, int]]] = {}
        self.disk = DiskStager(drv, disk[0], disk[1]) if disk is not None and disk[1] else None
        self.kept: dict[int, tuple] = {}  # layer -> (LayerStage, page-locked copy of its cold experts): keep()
        slot_bytes = 0
        for layer, names in placement.streamed.items():
            off, lay = 0, []
            from_disk = self.disk.plan[layer].copies if self.disk is not None and layer in self.disk else {}
            for n in names:
                if n in placement.resident:
                    continue
                lay.append((n, off))
                off += (infos[n].nbytes + ALIGN - 1) // ALIGN * ALIGN
                if n in from_disk:
                    continue
                self._host_copy(n)
                if progress is not None:
                    progress(infos[n].nbytes)
            self.layout[layer] = lay
            slot_bytes = max(slot_bytes, off)
        self.slots = [gpuarray.empty(max(slot_bytes, 1), np.uint8) for _ in range(2)]
        self._views: dict[tuple, dict[str, DeviceWeight]] = {}  # weights() results by (layer, names)
        self.device_bytes += 2 * max(slot_bytes, 1) if slot_bytes else 0
        self.free = [drv.Event(), drv.Event()]
        for e in self.free:
            e.record(self.compute)
        self.ready: dict[int, object] = {}
        self.timing: list[tuple[int, object, object]] = []  # (layer, start, end) events of copies
        self.bytes_h2d = 0

    def _host_copy(self, name: str) -> None:
        """The page-locked copy of a streamed tensor: its runs of experts not pinned on the card, back to back
        (disk_stage.run_copies: the whole tensor where none is pinned), the uploads' sources (host_parts)."""
        info = self.infos[name]
        cs = run_copies(info.slab, info.n_expert, self.pinned.get(name, (None, {}))[1])
        h = self.drv.pagelocked_empty(max(1, sum(k for _, _, k in cs)), np.uint8)
        self.host[name], self.host_parts[name] = h, _fill(h, file_bytes(self.gm, info), cs)

    def keep(self, layers) -> None:
        """Page-locked copies of `layers`' cold experts, laid out as their staging (disk_stage.LayerStage) and
        filled from the file's mapping once, instead of reads on every pass (a RAM split's held layers); the staging
        buffers shrink to the layers still read, and go when none is."""
        plan = self.disk.plan if self.disk is not None else {}
        keep = [i for i in layers if i in plan]
        if not keep:
            return
        reader, self.disk = self.disk.reader, None  # the staging buffers go before the copies are made
        for i in keep:
            buf = self.drv.pagelocked_empty(max(plan[i].nbytes, 1), np.uint8)
            for n, cs in plan[i].copies.items():
                _fill(buf, file_bytes(self.gm, self.infos[n]), cs)  # an expert split's card: its own experts' bytes
            self.kept[i] = (plan[i], buf)
        rest = {i: st for i, st in plan.items() if i not in keep}
        self.disk = DiskStager(self.drv, reader, rest) if rest else None

    @property
    def host_bytes(self) -> int:
        """page-locked host bytes of the weights: the copies and the staging buffers"""
        return (sum(h.nbytes for h in self.host.values()) + sum(b.nbytes for _, b in self.kept.values())
                + (self.disk.nbytes if self.disk is not None else 0))

    def is_streamed(self, layer: int) -> bool:
        return bool(self.layout.get(layer))

    def prefetch(self, layer: int) -> None:
        """Queue the upload of `layer`'s streamed tensors into its slot (no-op for resident layers)."""
        if not self.is_streamed(layer) or layer in self.ready:
            return
        drv, s = self.drv, layer % 2
        self.copy.wait_for_event(self.free[s])
        start, end = drv.Event(), drv.Event()
        start.record(self.copy)
        base = int(self.slots[s].gpudata)
        h2d, d2d = [], []  # (device address, host bytes); (device address, device address, bytes)
        staged, b, st = {}, None, None
        if layer in self.kept:
            st, buf = self.kept[layer]
        elif self.disk is not None and layer in self.disk:
            b, buf = self._disk(self.disk.take, layer)
            st = self.disk.plan[layer]
        if st is not None:
            staged = {n: _parts(buf, cs) for n, cs in st.copies.items()}
        for name, off in self.layout[layer]:
            info = self.infos[name]
            dw, slot_of = self.pinned.get(name, (None, {}))
            slab = info.slab
            for e, k, n in pinned_runs(slot_of):  # runs of pinned experts packed in order: one copy each
                d2d.append((base + off + e * slab, int(dw.data.gpudata) + k * slab, n * slab))
            parts = staged[name] if name in staged else self.host_parts[name]
            for (e, _), src in zip(runs(info.n_expert, slot_of), parts, strict=True):  # a run of experts a copy
                h2d.append((base + off + e * slab, src))
        for dst, src, n in d2d:
            drv.memcpy_dtod_async(dst, src, n, self.copy)
        if self.pacer is not None:
            self.bytes_h2d += self.pacer.upload(h2d, self.copy)
        else:
            for dst, host in h2d:
                drv.memcpy_htod_async(dst, host, self.copy)
                self.bytes_h2d += host.nbytes
        end.record(self.copy)
        self.ready[layer] = end
        self.timing.append((layer, start, end))
        if b is not None:
            self.disk.uploaded(b, end)
            nxt = self.disk.next_after(layer)
            if nxt is not None and nxt not in self.ready:
                self._disk(self.disk.start, nxt)  # read while the card computes

    def _disk(self, fn, layer: int):
        try:
            return fn(layer)
        except BaseException:
            self.ready.clear()  # the pass stops here: no upload queued so far is taken for done by a later one
            raise

    def weights(self, layer: int, names) -> dict[str, DeviceWeight]:
        """DeviceWeights of `names` for `layer`; the compute stream waits for the layer's upload."""
        if self.is_streamed(layer):
            self.prefetch(layer)
            self.compute.wait_for_event(self.ready.pop(layer))
        key = (layer, tuple(names))
        if key not in self._views:  # the slot views of a layer stay valid for this Streamer's life
            out = {}
            offs = dict(self.layout.get(layer, ()))
            for n in names:
                if n in self.resident:
                    out[n] = self.resident[n]
                else:
                    t = self.gm.tensor(n)
                    nb = self.infos[n].nbytes
                    out[n] = DeviceWeight(t.qtype, _shape(t, self.infos[n]),
                                          self.slots[layer % 2][offs[n] : offs[n] + nb])
            self._views[key] = out
        return self._views[key]

    def release(self, layer: int) -> None:
        """The compute stream is done with `layer`'s slot once the work queued so far has run."""
        if self.is_streamed(layer):
            self.free[layer % 2].record(self.compute)

    def copy_seconds(self) -> float:
        """Time the copy stream spent on uploads since the last reset (call after synchronising)."""
        return sum(end.time_since(start) for _, start, end in self.timing) / 1e3

    def reset_timing(self) -> None:
        self.timing.clear()
        self.bytes_h2d = 0

"""Routed experts read from the GGUF under a RAM budget: the reader pool and each layer's expert cache.

In a GGUF a layer's routed experts are stacked tensors (`blk.N.ffn_{gate,up,down}_exps`, expert outermost), so one
expert of one tensor is one contiguous byte range. A layer's cache is three stacked buffers of `n_slots` experts each
(gate, up, down), in the form the kernels take (repacked on read, as a weight copy is): the MoE calls get the cache's
buffers and the routed experts' slot numbers where a resident layer passes the file's tensors and the expert ids
(CPUOps.moe_impl), so decode, batched decode and prompt chunks run the same calls, and the same bits, either way.

Reads (backends/expert_io.py's ExpertReader) are plain `os.pread` on a small pool of threads (through the page cache;
flash-moe found that faster than anything fancier), or with `io="direct"` through `O_DIRECT` into aligned per-thread
buffers. They are issued when the router's choice is known, for all of the layer's missing experts at once, and waited
for only when the routed products start (the shared expert's product runs in between). While a layer runs, the experts
the previous step routed to in the next layers are read ahead (expert_plan.prefetch_plan). All bookkeeping runs on the
caller's thread (under the engine's lock); reader threads only fill the slots they were given.

Bad conditions are typed errors naming the file and the byte range (ExpertReadError): a short read (the file was
truncated), a file whose size or modification time changed or whose name now points at another file, a failed read,
or a read not done within `timeout` seconds. After one, the store refuses every later read (a timed-out read may
still write into its slot).
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass

import numpy as np

from ...errors import ExpertReadError
from ..expert_io import IO_MODES, ExpertReader  # noqa: F401 (expert_setup's)
from .expert_plan import expert_chunks, halvings, prefetch_plan, victims

DECAY_EVERY = 4096  # routed uses of a layer between two halvings of its usage counts
_ALIGN = 64


@dataclass
class Part:
    """One of a layer's stacked expert tensors: its file offset, one expert's bytes, its qtype as stored."""

    offset: int
    per: int
    qtype: int


class ExpertCache:
    """Block `block`'s routed experts in `n_slots` slots: slots 0 .. len(pinned)-1 hold the pinned experts for good,
    the rest start with `preload` and are refilled by the frequency-weighted policy (expert_plan.victims). `mats` are
    the Mats the MoE calls take (n_expert = n_slots); `lut[e]` is expert e's slot (-1: not held)."""

    def __init__(self, store: ExpertStore, block: int, mats, parts: list[Part], n_slots: int, pinned, buf,
                 preload=()):
        from .backend import Mat

        self.store, self.block, self.parts = store, block, parts
        self.n_expert = mats[0].n_expert
        self.n_slots, self.first = int(n_slots), len(pinned)
        self.k = store.n_used
        off, self.bufs = 0, []
        for p in parts:
            self.bufs.append(buf[off : off + p.per * self.n_slots])
            off += -(-p.per * self.n_slots // _ALIGN) * _ALIGN
        simd = store.simd
        # the qtype the kernels take after the repack every read gets (one row shows it: whole blocks)
        self.qtypes = [simd.repack(np.zeros(p.per // m.rows, np.uint8), p.qtype) for p, m in zip(parts, mats,
                                                                                                  strict=True)]
        self.mats = tuple(Mat(f"{m.name}@cache", b, q, m.rows, m.cols, self.n_slots)
                          for m, b, q in zip(mats, self.bufs, self.qtypes, strict=True))
        self.occupant = np.full(self.n_slots, -1, np.int64)
        self.lut = np.full(self.n_expert, -1, np.int32)
        self.counts = np.zeros(self.n_expert, np.int64)  # routed uses, halved every DECAY_EVERY
        self.total = np.zeros(self.n_expert, np.int64)  # routed uses since load
        self.last_use = np.zeros(self.n_slots, np.int64)
        self.pending: dict[int, list] = {}  # slot -> futures of its reads
        self.slot_ids = np.zeros(self.k, np.int32)  # one token's slots (the decode calls are bound to it)
        self.last: tuple | None = None  # the experts of this layer's latest step (what to read ahead next time)
        self.plan: list[list[int]] = []  # this step's experts in chunks (begin, rows)
        self.uses = 0
        self.hits = self.misses = self.prefetched = self.prefetch_hits = 0
        self.chunked = 0  # steps whose experts did not fit at once
        self._from_prefetch: set[int] = set()
        self.pinned = frozenset(int(e) for e in pinned)
        self._check(tuple(pinned[:1]) + tuple(preload[:1]))
        for s, e in enumerate(tuple(pinned) + tuple(preload)[: self.capacity]):  # read at load
            self._load(s, int(e))

    @property
    def capacity(self) -> int:
        """refillable slots"""
        return self.n_slots - self.first

    def _check(self, experts) -> None:
        """The file is still the one loaded, before reading `experts` (the store goes out of use if not)."""
        try:
            self.store.reader.check("; ".join(self._where(e) for e in experts))
        except ExpertReadError as err:
            self.store.broken = err
            raise

    def _load(self, slot: int, e: int) -> None:
        """Read expert e into `slot` (the caller checked the file: _check)."""
        old = int(self.occupant[slot])
        if old >= 0:
            self.lut[old] = -1
            self._from_prefetch.discard(old)
        self.occupant[slot], self.lut[e] = e, slot
        futs = []
        for p, b, q in zip(self.parts, self.bufs, self.qtypes, strict=True):
            after = None if q == p.qtype else (lambda v, q0=p.qtype: self.store.simd.repack(v, q0))
            futs.append(self.store.reader.submit(b[slot * p.per : (slot + 1) * p.per], p.offset + e * p.per, after))
        self.pending[slot] = futs

    def _where(self, e: int) -> str:
        spans = ", ".join(f"bytes {p.offset + e * p.per}..{p.offset + (e + 1) * p.per}" for p in self.parts)
        return f"expert {e} of block {self.block} ({spans})"

    def fetch(self, experts, keep=()) -> None:
        """Give every expert of `experts` (at most `capacity` not pinned) a slot, reading the missing ones; the
        slots in `keep` (a chunk still computing) are not given up."""
        self.store.check()
        want = [int(e) for e in experts]
        miss = [e for e in want if self.lut[e] < 0]
        held = {int(self.lut[e]) for e in want if self.lut[e] >= 0} | {int(s) for s in keep}
        for e in want:
            if self.lut[e] >= 0:
                self.hits += 1
                if e in self._from_prefetch:
                    self.prefetch_hits += 1
                    self._from_prefetch.discard(e)
        self.misses += len(miss)
        if miss:
            busy = self._busy()
            if self.capacity - len([s for s in held if s >= self.first]) - len(busy - held) < len(miss):
                self.ready_slots(busy - held)  # read-ahead still filling the slots this step needs
                busy = set()
            slots = victims(self.occupant, self.counts, self.last_use, held | busy, len(miss), self.first)
            self._check(miss)
            for s, e in zip(slots, miss, strict=True):
                self._load(s, e)
        self.store.clock += 1
        for e in want:
            self.last_use[self.lut[e]] = self.store.clock

    def _busy(self) -> set[int]:
        """slots whose reads are still under way"""
        return {s for s, fs in self.pending.items() if not all(f.done() for f in fs)}

    def ready(self, experts) -> None:
        """Wait for the reads of `experts`' slots (the store goes out of use at an error)."""
        self.ready_slots([int(self.lut[int(e)]) for e in experts], experts)

    def ready_slots(self, slots, experts=None) -> None:
        experts = [int(self.occupant[s]) for s in slots] if experts is None else experts
        futs = [f for s in slots for f in self.pending.get(s, ())]
        if futs:
            t0 = time.perf_counter()
            try:
                self.store.reader.wait(futs, f"the experts {sorted(map(int, experts))} of block {self.block}")
            except Exception as e:
                self.store.broken = e
                raise
            finally:
                self.store.wait_s += time.perf_counter() - t0
        for s in slots:
            self.pending.pop(s, None)

    def count(self, idx: np.ndarray) -> tuple:
        """Count a step's routing (T, k); its distinct experts."""
        b = np.bincount(idx.reshape(-1), minlength=self.n_expert)
        self.counts += b
        self.total += b
        n = halvings(self.uses, self.uses + idx.size, DECAY_EVERY)
        self.uses += idx.size
        if n:
            self.counts >>= min(n, 62)
        return tuple(np.flatnonzero(b).tolist())

    # the three steps the MoE op takes (CPUOps.moe_impl) -----------------------------------------------------
    def begin(self, idx: np.ndarray) -> None:
        """The router's choice is known: count it, read this step's missing experts (for a step of several rows
        whose experts do not fit at once, its first chunk's), and read ahead for the next layers."""
        experts = self.count(idx)
        self.last = experts
        if len([e for e in experts if e not in self.pinned]) <= self.capacity:
            self.plan = [list(experts)]
        else:  # the held ones first: they compute while the rest are read; then half the slots a chunk
            order = sorted(experts, key=lambda e: self.lut[e] < 0)
            self.plan = expert_chunks(order, self.pinned, max(1, self.capacity // 2))
        self.fetch(self.plan[0])
        self.store.read_ahead(self)

    def one(self, idx_row: np.ndarray) -> None:
        """One token: its experts ready, their slots in slot_ids."""
        self.ready(idx_row)
        np.take(self.lut, idx_row, out=self.slot_ids)

    def rows(self, simd, n_ff: int, n_embd: int, xq, idx, eg, eu, hq, ys, scratch, op) -> None:
        """moe_rows over the cache (the plan begin() made): one call when the step's experts fit at once, else one
        call per chunk of experts over the (token, expert) pairs routed to it, the next chunk read meanwhile. Every
        pair is computed in its one-token float shape, so the bits are those of one call over the file's tensors."""
        k = idx.shape[1]
        G, U, D = self.mats
        W = ((G.raw, G.qtype), (U.raw, U.qtype), (D.raw, D.qtype))
        plan = self.plan
        if len(plan) == 1:
            self.ready(plan[0])
            sid = np.ascontiguousarray(self.lut[idx], dtype=np.int32)
            simd.moe_rows(*W, n_ff, n_embd, xq, sid, eg, eu, hq, ys, scratch, op)
            return
        self.chunked += 1
        flat = idx.reshape(-1)
        xq = np.array(xq)  # gathered per chunk below; the products overwrite the shared input buffer
        for c, chunk in enumerate(plan):
            self.ready(chunk)
            if c + 1 < len(plan):
                self.fetch(plan[c + 1], keep=self.lut[chunk])
            pairs = np.flatnonzero(np.isin(flat, chunk))
            n = pairs.size
            sid = np.ascontiguousarray(self.lut[flat[pairs]].reshape(n, 1), dtype=np.int32)
            out = np.empty((n, ys.shape[1]), np.float32)
            simd.moe_rows(*W, n_ff, n_embd, xq[pairs // k], sid, eg[:n], eu[:n], hq[:n], out, scratch, op)
            ys[pairs] = out

    def prefetch(self, e: int) -> bool:
        """Read expert e ahead into the slot the policy would give up, if its occupant was used less; whether it
        did."""
        busy = self._busy()
        try:
            s = victims(self.occupant, self.counts, self.last_use, busy, 1, self.first)[0]
        except ValueError:
            return False
        old = int(self.occupant[s])
        if old >= 0 and self.counts[old] > self.counts[e]:
            return False
        self._check([e])
        self._load(s, e)
        self.prefetched += 1
        self._from_prefetch.add(e)
        return True


class ExpertStore:
    """Every disk-backed layer's ExpertCache, the reader and the read-ahead across layers (`order`: the trunk's
    caches in the order the layers run)."""

    def __init__(self, reader: ExpertReader, simd, n_used: int, depth: int = 1):
        self.reader, self.simd, self.n_used, self.depth = reader, simd, int(n_used), int(depth)
        self.caches: dict[int, ExpertCache] = {}  # by id of the file's gate Mat
        self.order: list[ExpertCache] = []
        self.clock = 0
        self.wait_s = 0.0
        self.broken: Exception | None = None

    def check(self) -> None:
        if self.broken is not None:
            raise ExpertReadError(f"{self.reader.path!r}: expert reads stopped after an earlier failure: "
                                  f"{self.broken}")

    def read_ahead(self, cache: ExpertCache) -> None:
        if self.depth < 1 or cache not in self.order:
            return
        j = self.order.index(cache)
        last = [c.last for c in self.order]
        plan = prefetch_plan(last, j, self.depth, lambda i, e: self.order[i].lut[e] >= 0,
                             min(c.capacity for c in self.order))
        for i, e in plan:
            self.order[i].prefetch(e)

    def usage_counts(self) -> dict[tuple[int, int], int]:
        """Tokens routed to each (block, expert) since load, the GPU placement's `expert_counts` kind: pass them as
        `expert_counts` to a later load to pin the most used."""
        return {(c.block, int(e)): int(n) for c in self.caches.values() for e, n in enumerate(c.total) if n}

    def stats(self) -> dict:
        cs = list(self.caches.values())
        hits, misses = sum(c.hits for c in cs), sum(c.misses for c in cs)
        return {"hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses),
                "prefetched": sum(c.prefetched for c in cs), "prefetch_hits": sum(c.prefetch_hits for c in cs),
                "chunked_steps": sum(c.chunked for c in cs),
                "bytes_read": self.reader.bytes_read, "reads": self.reader.reads, "wait_s": self.wait_s}

    def close(self) -> None:
        self.reader.close()
        self.caches.clear()
        self.order.clear()


def unmap(gm) -> None:
    """Drop the pages of gm's file mapping from this process (madvise DONTNEED) once the resident part is copied:
    under a budget nothing reads the mapping after load, and its touched pages would count as this process's memory
    until the kernel reclaimed them."""
    mm = getattr(getattr(gm, "_mm", None), "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass

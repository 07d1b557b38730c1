"""Per-node weight copies for the CPU backend (numa policy `replicate`): one copy of the weight matrices' bytes in
each chosen node's memory, and each pool thread reading the copy of the node whose CPUs it is pinned to.

A copy is an anonymous mapping given the policy MPOL_BIND to its node with mbind before any page of it is written,
so the copy's first touch puts every page there (a copy written first and moved later would pass through the
writer's node). The native side (native/simd/replica.c) swaps each product chunk's weight pointer for the same
offset in its thread's copy: the bytes are the same, so every logit is the same bit for bit.

What is copied: the spans of memory the model's matrices lie in (the GGUF mapping or the one huge-page buffer of
`weights="copy"`), merged where they touch or are close, at most MAX_SPANS of them; the bytes between matrices of
one span (norm vectors, the token embedding when the output head is not tied to it) are copied along."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .. import numa
from .simd_replicas import MAX_REPLICAS, MAX_SPANS

_HUGE = 2 << 20
# extents of one mapping this close merge: copying the small tensors between matrices (norms, biases) costs less than
# a longer table scan per chunk; a large tensor no product reads (an untied token embedding) stays out
MERGE_GAP = 16 << 20


def weight_spans(extents, max_spans: int = MAX_SPANS, merge_gap: int = MERGE_GAP) -> list[tuple[object, int, int]]:
    """Disjoint spans (group, start, end) covering `extents`, (group, start, end) byte ranges where extents of one
    group lie in one mapping (so the bytes between them can be read). Extents of a group that overlap or lie at
    most merge_gap bytes apart merge; while there are more than max_spans, the two neighbours of one group with the
    smallest gap between them merge. Raises ValueError when the groups alone are more than max_spans. Pure."""
    if max_spans < 1:
        raise ValueError(f"max_spans must be >= 1, got {max_spans}")
    by_group: dict[object, list[list[int]]] = {}
    for g, a, b in sorted(extents, key=lambda e: (str(e[0]), e[1])):
        if b <= a:
            continue
        runs = by_group.setdefault(g, [])
        if runs and a <= runs[-1][1] + merge_gap:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    if len(by_group) > max_spans:
        raise ValueError(f"the weights lie in {len(by_group)} separate mappings, more than the {max_spans} spans "
                         "the replica table holds")
    while sum(len(r) for r in by_group.values()) > max_spans:
        g, i = min(((g, i) for g, runs in by_group.items() for i in range(len(runs) - 1)),
                   key=lambda gi: by_group[gi[0]][gi[1] + 1][0] - by_group[gi[0]][gi[1]][1])
        runs = by_group[g]
        runs[i][1] = runs[i + 1][1]
        del runs[i + 1]
    return sorted(((g, a, b) for g, runs in by_group.items() for a, b in runs), key=lambda s: s[1])


def assign_threads(n_threads: int, shares: Sequence[int]) -> list[int]:
    """The replica each of n_threads pool threads reads, in proportion to `shares` (each copy's CPU count) and
    interleaved (smooth weighted round robin), so that threads 0 and 1 read different copies when there are two.
    Pure."""
    if n_threads < 1 or not shares or any(s < 1 for s in shares):
        raise ValueError(f"need n_threads >= 1 and positive shares, got {n_threads}, {list(shares)}")
    total, cur, out = sum(shares), [0] * len(shares), []
    for _ in range(n_threads):
        cur = [c + s for c, s in zip(cur, shares, strict=True)]
        k = max(range(len(cur)), key=lambda i: (cur[i], -i))
        cur[k] -= total
        out.append(k)
    return out


def node_buffer(nbytes: int, node: int) -> tuple[np.ndarray, str]:
    """A uint8 array of nbytes in a fresh anonymous mapping (2 MiB aligned, advised for huge pages) whose pages are
    bound to memory node `node` before any is touched; and how it was placed, in words (a kernel that refuses
    mbind leaves the default placement, and says so)."""
    m = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, np.uint8)
    addr = whole.ctypes.data
    try:
        numa.mbind(addr, len(m), numa.MPOL_BIND, (node,))
        how = f"bound to node {node}"
    except numa.NumaError as e:
        how = f"not bound ({e})"
    start = (-addr) % _HUGE
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE, start, (nbytes // _HUGE) * _HUGE or nbytes)
        except OSError:
            pass
    return whole[start : start + nbytes], how


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _view(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


@dataclass
class Replicas:
    """The copies a model's pool reads: nodes[k] holds copies[k] (one array per span), read by the pool threads t
    with thread_replica[t] == k; placed[k] says how copy k was bound, pinned[k] where its workers run."""

    nodes: tuple[int, ...]
    spans: list[np.ndarray]
    copies: list[list[np.ndarray]]
    thread_replica: list[int]
    placed: list[str]
    pinned: list[str]
    keep: list = field(default_factory=list, repr=False)  # the arrays the spans view (their mappings stay alive)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.spans)

    def describe(self) -> list[str]:
        out = [f"{len(self.nodes)} weight copy(ies) of {self.nbytes / 2**20:.1f} MiB in {len(self.spans)} span(s)"]
        for k, n in enumerate(self.nodes):
            ts = [t for t, r in enumerate(self.thread_replica) if r == k]
            page = self.policy_of(k)
            out.append(f"copy {k} on node {n}: {self.placed[k]}"
                       + (f" (get_mempolicy: {page})" if page else "")
                       + f"; read by pool thread(s) {','.join(map(str, ts)) or 'none'} ({self.pinned[k]})")
        return out + ["pool thread 0 is the calling thread: it reads its copy but is not pinned"]

    def policy_of(self, k: int) -> str:
        """The memory policy the kernel reports for copy k's first page ('' where it cannot be asked)."""
        try:
            mode, nodes = numa.get_mempolicy(self.copies[k][0].ctypes.data)
        except numa.NumaError:
            return ""
        return f"{numa.MODE_NAMES.get(mode, mode)} node(s) {','.join(map(str, nodes)) or '-'}"

    def hits(self, simd) -> list[int]:
        """Product chunks read from each copy since they were registered (all threads)."""
        return [int(x) for x in simd.replica_hits()[:, : len(self.nodes)].sum(axis=0)]


def replicate(simd, arrays: Sequence[np.ndarray], nodes: Sequence[int], node_cpus: Sequence[Sequence[int]] = (),
              pin: bool = True) -> Replicas:
    """Copy the memory `arrays` (the weight matrices' bytes) lie in once per node of `nodes` (a node may repeat: two
    copies on one node, as tests do on one-node machines), register the copies with `simd` and place its pool
    threads: thread t reads copy assign_threads(...)[t], in proportion to each copy's CPUs in node_cpus, and with
    `pin` each worker is pinned to its copy's CPUs (those this process may use). Returns what was made, which must
    stay referenced as long as simd reads through it (CPUModel keeps it)."""
    nodes = tuple(int(n) for n in nodes)
    if not 1 <= len(nodes) <= MAX_REPLICAS or any(n < 0 for n in nodes):
        raise ValueError(f"nodes must be 1 to {MAX_REPLICAS} node numbers >= 0, got {nodes}")
    cpus = [tuple(int(c) for c in cs) for cs in node_cpus] or [()] * len(nodes)
    if len(cpus) != len(nodes):
        raise ValueError(f"node_cpus gives {len(cpus)} CPU lists for {len(nodes)} nodes")
    roots, extents = {}, []
    for a in arrays:
        r = _root(a)
        roots[r.ctypes.data] = r
        extents.append((r.ctypes.data, a.ctypes.data, a.ctypes.data + a.nbytes))
    spans = [_view(a, b - a) for _, a, b in weight_spans(extents)]
    copies, placed = [], []
    for n in nodes:
        row, how = [], ""
        for s in spans:
            c, how = node_buffer(s.nbytes, n)
            np.copyto(c, s)
            row.append(c)
        copies.append(row)
        placed.append(how)
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    use = [tuple(c for c in cs if c in allowed) for cs in cpus]
    threads = assign_threads(simd.n_threads, [max(1, len(u)) for u in use])
    simd.set_replicas([(s, [copies[k][i] for k in range(len(nodes))]) for i, s in enumerate(spans)])
    pinned = ["workers not pinned" if not (pin and u) else f"workers pinned to CPUs {numa.cpu_ranges(u)}"
              for u in use]
    for t, k in enumerate(threads):
        try:
            simd.place_thread(t, k, use[k] if pin and t else ())
        except OSError as e:
            simd.place_thread(t, k)
            pinned[k] = f"workers not pinned: {e}"
    return Replicas(nodes, spans, copies, threads, placed, pinned, keep=list(roots.values()))

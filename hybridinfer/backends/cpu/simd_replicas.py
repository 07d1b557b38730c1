"""SimdLib's per-node weight copies (a part of simd.py's SimdLib): the native replica table and where each pool
thread reads from (native/simd/replica.c has the why). The copies themselves are made by
hybridinfer.backends.cpu.replicas."""

from __future__ import annotations

import numpy as np

from .simd_native import _U8, _check_rc

MAX_REPLICAS = 16  # hi_simd.h: HI_MAX_REPLICAS
MAX_SPANS = 16  # hi_simd.h: HI_MAX_SPANS


def _span_array(name: str, a) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != _U8 or a.ndim != 1 or not a.flags.c_contiguous:
        raise TypeError(f"{name} must be a contiguous 1-D uint8 array, got "
                        f"{type(a).__name__}{'' if not isinstance(a, np.ndarray) else f' {a.dtype} {a.shape}'}")
    if a.nbytes == 0:
        raise ValueError(f"{name} is empty")
    return a


class ReplicaCalls:
    """Mixed into SimdLib (which provides _ffi, _lib, _c and n_threads)."""

    def set_replicas(self, spans) -> None:
        """Register per-node weight copies: spans is a list of (weights, copies), `weights` a uint8 view of bytes
        the products are given (e.g. all of a model's matrices), `copies` one array of the same bytes per replica
        (the same count for every span). From now on a product whose weight matrix lies wholly in a span reads it,
        on a pool thread placed on replica k (place_thread), from copies[k]. The copies must keep the weights'
        bytes: this object holds references to them so they outlive the registration. [] clears the table."""
        spans = list(spans)
        if len(spans) > MAX_SPANS:
            raise ValueError(f"spans: at most {MAX_SPANS} weight spans, got {len(spans)}")
        n_copies = len(spans[0][1]) if spans else 0
        bases, lens, copies, keep = [], [], [], []
        for s, (w, cs) in enumerate(spans):
            w = _span_array(f"spans[{s}] weights", w)
            cs = list(cs)
            if not 1 <= len(cs) <= MAX_REPLICAS or len(cs) != n_copies:
                raise ValueError(f"spans[{s}] has {len(cs)} copies; every span needs the same count, 1 to "
                                 f"{MAX_REPLICAS} (spans[0] has {n_copies})")
            for k, c in enumerate(cs):
                c = _span_array(f"spans[{s}] copy {k}", c)
                if c.nbytes != w.nbytes:
                    raise ValueError(f"spans[{s}] copy {k} holds {c.nbytes} bytes, the weights {w.nbytes}")
                copies.append(self._ffi.cast("void *", c.ctypes.data))
                keep.append(c)
            bases.append(self._ffi.cast("void *", w.ctypes.data))
            lens.append(w.nbytes)
            keep.append(w)
        rc = self._lib.hi_ctx_set_replicas(self._c, len(spans), self._ffi.new("void *[]", bases) if spans else
                                           self._ffi.NULL, self._ffi.new("int64_t[]", lens) if spans else
                                           self._ffi.NULL, n_copies, self._ffi.new("void *[]", copies) if spans
                                           else self._ffi.NULL)
        if rc == -2:
            raise ValueError("spans overlap: each weight byte may belong to one span only")
        _check_rc(rc, "set_replicas")
        self._replica_refs = keep

    def place_thread(self, tid: int, replica: int, cpus=()) -> None:
        """Pool thread `tid` (0: the calling thread, 1..n_threads-1: the workers) reads replica `replica` (-1: the
        registered weights themselves); non-empty `cpus` pins worker tid to those CPUs (the calling thread is the
        application's and is never pinned here). A CPU set the kernel refuses raises OSError naming it."""
        for name, v in (("tid", tid), ("replica", replica)):
            if not isinstance(v, int | np.integer) or isinstance(v, bool):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if not 0 <= tid < self.n_threads:
            raise ValueError(f"tid must be in [0, {self.n_threads}), got {tid}")
        if not -1 <= replica < MAX_REPLICAS:
            raise ValueError(f"replica must be in [-1, {MAX_REPLICAS}), got {replica}")
        cpus = [int(c) for c in cpus]
        if any(c < 0 for c in cpus):
            raise ValueError(f"cpus must be CPU numbers >= 0, got {cpus}")
        if cpus and tid == 0:
            raise ValueError("tid 0 is the calling thread, which is not pinned here: give it no cpus")
        arr = self._ffi.new("int[]", cpus) if cpus else self._ffi.NULL
        rc = self._lib.hi_ctx_place_thread(self._c, int(tid), int(replica), arr, len(cpus))
        if rc == -4:
            raise OSError(f"the kernel refused to pin pool thread {tid} to CPUs {cpus}")
        _check_rc(rc, "place_thread")

    def thread_replica(self, tid: int) -> int:
        """The replica pool thread tid reads (-1: none)."""
        if not 0 <= int(tid) < self.n_threads:
            raise ValueError(f"tid must be in [0, {self.n_threads}), got {tid}")
        return int(self._lib.hi_ctx_thread_replica(self._c, int(tid)))

    def replica_hits(self, reset: bool = False) -> np.ndarray:
        """(n_threads, MAX_REPLICAS) int64: the product chunks each pool thread read from each copy since the
        table was set (or the last reset). A benchmark's or test's evidence of who read what."""
        out = np.zeros((self.n_threads, MAX_REPLICAS), np.int64)
        _check_rc(self._lib.hi_ctx_replica_hits(self._c, self._ffi.cast("int64_t *", out.ctypes.data),
                                                1 if reset else 0), "replica_hits")
        return out

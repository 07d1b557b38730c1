"""The one launcher of the native SIMD library `hybridinfer._simd` (C, built by setup.py through cffi).

The library multiplies GGUF weight rows, in their stored bytes, by activation rows quantized the way
llama.cpp quantizes them (Q8_0 for Q4_0/Q5_0/Q8_0 weights, Q8_1 for Q4_1/Q5_1, Q8_K for K-quants, fp16 for
F16, float32 for F32), with integer sums exact and llama.cpp's float operations (see the first comment of
native/simd/kernels_body.h). One binary holds every ISA level (scalar, ssse3, avx2, avx512vnni); a
`SimdLib` uses the best one this CPU runs unless told otherwise, and owns a persistent C thread pool.

Every array is checked before C sees it: dtype, shape, and contiguity (a 2-D array may be a view of
wider rows, e.g. `buf[:T, :n]`: its rows may be strided, each row must be contiguous). Bad arrays raise
TypeError / ValueError naming the argument; a weight type without a kernel raises
`UnsupportedTensorTypeError` naming the ggml type. Settings come in as arguments; nothing reads the
environment.

The library loading, the ISA and type tables and the argument checks are in `hybridinfer.backends.cpu.simd_native`;
this module holds `SimdLib` (the checked wrappers of the C calls) and re-exports their public names.
"""

from __future__ import annotations

import os

import numpy as np

from ...errors import BackendNotAvailableError, KernelArgumentError, UnsupportedTensorTypeError
from ...format.quant import type_name
from .replay import Bound
from .simd_gdn import GDNCalls
from .simd_moe import MoECalls
from .simd_native import (
    _F32,
    _U8,
    ACT_KINDS,
    GGML_DECODE_ROWS,
    GGML_MUL_MAT,
    GGML_MUL_MAT_ID,
    GGML_NONE,
    ISAS,
    KERNEL_TYPES,
    KQ_ZIPPED,
    _array,
    _check_rc,
    _native,
    _op,
    _ptr,
    _rows_fast,
    _sizes,
    _vector,
    _weights,
    act_kind,
    act_row_bytes,
    base_type,
    best_isa,
    supported_isas,
    weight_row_bytes,
)
from .simd_native import (
    _qtype as _qtype_of,
)
from .simd_ops import OpCalls, _mrope_ptr, attention_args, rope_freqs
from .simd_replicas import ReplicaCalls
from .simd_vision import VisionCalls
from .simd_vrows import VisionRowCalls

__all__ = [
    "ACT_KINDS",
    "GGML_DECODE_ROWS",
    "GGML_MUL_MAT",
    "GGML_MUL_MAT_ID",
    "GGML_NONE",
    "ISAS",
    "KERNEL_TYPES",
    "KQ_ZIPPED",
    "SimdLib",
    "act_kind",
    "act_row_bytes",
    "base_type",
    "best_isa",
    "supported_isas",
    "weight_row_bytes",
]


class _Recorder:
    """Stands in for the native library while `SimdLib.bind` runs a method: records its one call."""

    def __init__(self, lib):
        self._real, self.call = lib, None

    def __getattr__(self, name):
        fn = getattr(self._real, name)

        def record(*cargs):
            self.call = (fn, cargs, name.removeprefix("hi_"))
            return 0

        return record


# measured on a 16-core Xeon, 35B-A3B Q4_K_M decode: no prefetch 33-36 tok/s, 1-16 KiB 37-42, best 4-8 KiB;
# on a 2-core EPYC VM (0.8B, compute-bound) 4 KiB costs 7% (52.5 -> 48.7 tok/s)
PREFETCH_BYTES = 4096
PREFETCH_MIN_THREADS = 4


class SimdLib(MoECalls, OpCalls, ReplicaCalls, GDNCalls, VisionCalls, VisionRowCalls):
    """The native kernels at one ISA level with a persistent pool of `n_threads` threads (the caller
    included). `isa`: one of `supported_isas()`, or None for `best_isa()`. Calls on one object are
    serialized; use one object per concurrent caller."""

    def __init__(self, isa: str | None = None, n_threads: int | None = None, spin_us: int = 200,
                 prefetch: int | None = None):
        mod = _native()
        self._ffi, self._lib = mod.ffi, mod.lib
        if isa is None:
            level = self._lib.hi_best_isa()
        else:
            if isa not in ISAS:
                raise ValueError(f"unknown ISA {isa!r} (known: {', '.join(ISAS)})")
            level = ISAS.index(isa)
            if not self._lib.hi_isa_supported(level):
                raise BackendNotAvailableError(
                    f"ISA {isa!r} is not supported by this CPU (supported: {', '.join(supported_isas())})")
        n = (os.cpu_count() or 1) if n_threads is None else n_threads
        if not isinstance(n, int | np.integer) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n_threads must be a positive int, got {n_threads!r}")
        if not isinstance(spin_us, int | np.integer) or spin_us < 0:
            raise ValueError(f"spin_us must be a non-negative int, got {spin_us!r}")
        ctx = self._lib.hi_ctx_new(level, int(n), int(spin_us))
        if ctx == self._ffi.NULL:
            raise BackendNotAvailableError(f"could not start the SIMD library ({ISAS[level]}, {n} threads)")
        self._ctx = self._ffi.gc(ctx, self._lib.hi_ctx_free)
        self.isa: str = ISAS[level]
        self.n_threads: int = int(n)
        self._replica_refs: list = []  # set_replicas: the registered arrays, alive while C reads them
        self.prefetch = PREFETCH_BYTES if prefetch is None and n >= PREFETCH_MIN_THREADS else (prefetch or 0)

    def __repr__(self) -> str:
        return f"SimdLib(isa={self.isa!r}, n_threads={self.n_threads})"

    @property
    def prefetch(self) -> int:
        """Bytes of each thread's weight stream prefetched ahead in one-token products (0: none). Default
        (prefetch=None): PREFETCH_BYTES with PREFETCH_MIN_THREADS threads or more, where decode is bound by
        memory, else 0 (on 2 cores, bound by compute, the extra instructions cost ~7%). No result changes."""
        return int(self._lib.hi_ctx_prefetch(self._c))

    @prefetch.setter
    def prefetch(self, nbytes: int) -> None:
        if not isinstance(nbytes, int | np.integer) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"prefetch must be a non-negative int (bytes), got {nbytes!r}")
        self._lib.hi_ctx_set_prefetch(self._c, int(nbytes))

    _POOL_FIELDS = ("tasks", "chunks", "wall_us", "busy_us", "start_us", "start_max_us", "spread_us")

    def pool_stats(self, on: bool = True) -> dict[str, dict[str, float]]:
        """Where pooled calls lose time: turns the pool's clocks on (or off) and returns what they summed since the
        last call, reset: for "small" tasks (under 24 chunks) and "big" ones (the products), the tasks, their
        chunks, and per task the mean wall time, the chunks' time per thread (busy), how late the threads began
        their first chunk (start: mean over them, start_max: the latest) and the time from the first to the last
        thread done (spread), in microseconds."""
        nf = len(self._POOL_FIELDS)  # hi_pool_acc's fields, for small tasks then big
        out = self._ffi.new("double[]", 2 * nf)
        self._lib.hi_ctx_pool_stats(self._c, 1 if on else 0, out)
        res = {}
        for k, name in enumerate(("small", "big")):
            v = list(out[nf * k : nf * (k + 1)])
            n = v[0]
            res[name] = {"tasks": n, "chunks": v[1] / n if n else 0.0,
                         **{f: (x / n / 1e3 if n else 0.0) for f, x in zip(self._POOL_FIELDS[2:], v[2:], strict=True)}}
        return res

    def close(self) -> None:
        """Stop the thread pool now (otherwise it stops when the object is collected)."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            self._ffi.release(ctx)

    @property
    def _c(self):
        if self._ctx is None:
            raise ValueError("this SimdLib is closed")
        return self._ctx

    # types ------------------------------------------------------------------------------------------
    act_kind = staticmethod(act_kind)
    act_row_bytes = staticmethod(act_row_bytes)
    weight_row_bytes = staticmethod(weight_row_bytes)

    # calls ------------------------------------------------------------------------------------------
    def bind(self, method: str, *args):
        """Check the arguments of `method` once and return a `Bound` call (replay.py) that repeats it with
        everything resolved: called with no argument, or with the token's position for `attn_step` (its pos0
        is replaced). For a decode loop over fixed work buffers: the arrays must stay alive (the Bound keeps
        references) and keep their shapes; their contents may change between calls."""
        rec = _Recorder(self._lib)
        real, self._lib = self._lib, rec
        try:
            getattr(self, method)(*args)
        finally:
            self._lib = real
        if rec.call is None:
            raise ValueError(f"{method} made no native call to bind")
        fn, cargs, what = rec.call
        return Bound(fn, cargs, what, args)

    def quantize(self, x: np.ndarray, qtype, out: np.ndarray | None = None) -> np.ndarray:
        """Quantize activation rows x (T, n) or (n,) float32 to the format weight type `qtype` multiplies,
        into out (T, act_row_bytes(qtype, n)) or (act_row_bytes,) uint8 (allocated if None)."""
        x = _array("x", x, (_F32,))
        if x.ndim not in (1, 2):
            raise ValueError(f"x must be 1-D or 2-D, got shape {x.shape}")
        n = x.shape[-1]
        q, _, rb = _sizes(qtype, n)
        T, xs = _rows_fast("x", x, _F32, n)
        if out is None:
            out = np.empty((T, rb) if x.ndim == 2 else (rb,), np.uint8)
        elif getattr(out, "ndim", x.ndim) != x.ndim:
            raise ValueError(f"out has shape {out.shape}, expected {(T, rb) if x.ndim == 2 else (rb,)}")
        _, os_ = _rows_fast("out", out, _U8, rb, T, writable=True)
        ffi = self._ffi
        rc = self._lib.hi_quantize(self._c, q, _ptr(ffi, "float *", x), xs, T, n, _ptr(ffi, "uint8_t *", out), os_)
        if rc:
            _check_rc(rc, "quantize")
        return out

    def matmul(self, w: np.ndarray, qtype, rows: int, cols: int, xq: np.ndarray, out: np.ndarray,
               ggml_op: int = GGML_NONE) -> np.ndarray:
        """out[t, r] = W[r] . x[t] for the weight W (rows x cols, ggml type `qtype`, its raw bytes) and
        activation rows xq (T, act_row_bytes) from `quantize`; out (T, rows) float32 (1-D xq/out: T = 1).
        T = 1 is the GEMV; larger T reads each weight row once per block of tokens. `ggml_op`
        (GGML_NONE, GGML_MUL_MAT, GGML_MUL_MAT_ID): the llama.cpp operation whose K-quant float shape the
        product takes (native/simd/dot_kq_shapes.h); GGML_NONE is ggml_vec_dot's shape everywhere."""
        q, rb, ab = _sizes(qtype, cols)
        if not (type(w) is np.ndarray and w.dtype is _U8 and w.flags.c_contiguous and w.nbytes == rows * rb
                and rows > 0):
            rows = int(rows)
            if rows < 1:
                raise ValueError(f"rows must be positive, got {rows}")
            w, n_mat = _weights("w", w, q, rb, rows)
            if n_mat != 1:
                raise ValueError(f"w has {w.nbytes} bytes, expected {rows * rb} for {rows} x {cols} {type_name(q)}")
        T, xs = _rows_fast("xq", xq, _U8, ab)
        if getattr(out, "ndim", None) != xq.ndim:
            _array("out", out, (_F32,))
            raise ValueError(f"out has shape {out.shape}, expected {(T, rows) if xq.ndim == 2 else (rows,)}")
        _, os_ = _rows_fast("out", out, _F32, rows, T, writable=True)
        ffi = self._ffi
        rc = self._lib.hi_matmul(self._c, q, _ptr(ffi, "uint8_t *", w), rows, int(cols), _ptr(ffi, "uint8_t *", xq),
                                 xs, T, _ptr(ffi, "float *", out), os_, _op(ggml_op))
        if rc:
            _check_rc(rc, "matmul")
        return out

    def matmul_many(self, xq, cols: int, items, ggml_op: int = GGML_NONE) -> None:
        """Several products of the same input in one call (one task for the thread pool, which balances small
        matrices better and wakes the threads once): for each (w, qtype, rows, out) in `items`,
        out[t, r] = W[r] . x[t], as `matmul` computes it. xq: the input quantized for every qtype (one array),
        or a dict from activation format (act_kind) to the input quantized in it, when the types take
        different formats (say Q8_0 and Q4_K weights); all of them with the same rows. At most 64 items."""
        items = list(items)
        if not 1 <= len(items) <= 64:
            raise ValueError(f"matmul_many takes 1 to 64 matrices, got {len(items)}")
        ffi = self._ffi
        qts, wps, rws, ops, ors, xps, xrs = [], [], [], [], [], [], []
        T = None
        seen: dict = {}  # activation format -> (its array's pointer, row stride, ndim)
        for j, it in enumerate(items):
            try:
                w, qtype, rows, out = it
            except (TypeError, ValueError):
                raise TypeError(f"items[{j}] must be a (w, qtype, rows, out) tuple") from None
            q, rb, ab = _sizes(qtype, cols)
            kind = act_kind(q)
            rows = int(rows)
            if rows < 1:
                raise ValueError(f"items[{j}]: rows must be positive, got {rows}")
            w, n_mat = _weights(f"items[{j}] w", w, q, rb, rows)
            if n_mat != 1:
                raise ValueError(f"items[{j}] w has {w.nbytes} bytes, expected {rows * rb}")
            if kind not in seen:
                if isinstance(xq, dict):
                    if kind not in xq:
                        raise ValueError(f"items[{j}]: weight type {type_name(q)} takes {kind} activations, which "
                                         f"xq does not have (it has {sorted(xq)})")
                    x = xq[kind]
                elif seen:
                    raise ValueError(f"matmul_many: the weight types take different activation formats "
                                     f"{sorted({*seen, kind})}: pass xq as a dict of them")
                else:
                    x = xq
                n, xs = _rows_fast(f"xq[{kind!r}]" if isinstance(xq, dict) else "xq", x, _U8, ab)
                if T is not None and n != T:
                    raise ValueError(f"xq[{kind!r}] has {n} rows, the other formats {T}")
                T = n
                seen[kind] = (_ptr(ffi, "uint8_t *", x), xs, x.ndim)
            xp, xs, ndim = seen[kind]
            if getattr(out, "ndim", None) != ndim:
                _array(f"items[{j}] out", out, (_F32,))
                raise ValueError(f"items[{j}] out has shape {out.shape}, expected "
                                 f"{(T, rows) if ndim == 2 else (rows,)}")
            _, os_ = _rows_fast(f"items[{j}] out", out, _F32, rows, T, writable=True)
            qts.append(q)
            wps.append(_ptr(ffi, "uint8_t *", w))
            rws.append(rows)
            ops.append(_ptr(ffi, "float *", out))
            ors.append(os_)
            xps.append(xp)
            xrs.append(xs)
        rc = self._lib.hi_matmul_many(self._c, len(items), qts, wps, rws, int(cols), xps, xrs, T, ops, ors,
                                      _op(ggml_op))
        if rc:
            _check_rc(rc, "matmul_many")

    def attention_scratch_size(self, n_ctx: int, head_dim: int, group: int = 1) -> int:
        """float32 elements of `attention`'s scratch for a cache of n_ctx rows; with `group` (query heads per K/V
        head) room to compute those heads together (each K/V block read once for them)."""
        return int(self._lib.hi_attention_scratch(self._c, int(n_ctx), int(head_dim), int(group)))

    def attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos0: int, out: np.ndarray,
                  scratch: np.ndarray, ggml_op: int = GGML_MUL_MAT) -> None:
        """Causal softmax attention of the T queries q (T, H, hd) at positions pos0..pos0+T-1 over cache rows
        0..pos0+T-1 of k_cache, v_cache (n_ctx, H_kv, hd), scale 1/sqrtf(hd), with llama.cpp's float operations
        (native/simd/kernels_attn.h): for T tokens as its graph takes them, or with GGML_DECODE_ROWS each row as a
        one-token step (independent of T); out (T, H*hd) may be a view of wider rows; scratch (>=
        attention_scratch_size(n_ctx, hd),) float32. All float32, q and the caches C-contiguous."""
        T, H, hd, n_ctx, Hkv, os_ = attention_args(q, k_cache, v_cache, pos0, out, scratch)
        ffi = self._ffi
        rc = self._lib.hi_attention(self._c, _ptr(ffi, "float *", q), H * hd, T, H, hd, _ptr(ffi, "float *", k_cache),
                                    _ptr(ffi, "float *", v_cache), Hkv * hd, Hkv, int(pos0),
                                    float(np.float32(1.0) / np.sqrt(np.float32(hd))), _ptr(ffi, "float *", out), os_,
                                    _ptr(ffi, "float *", scratch), scratch.shape[0], _op(ggml_op))
        if rc:
            _check_rc(rc, "attention")

    def rope(self, x: np.ndarray, pos0: int, n_rot: int, theta_base: float, neox: bool,
             freq_factors: np.ndarray, shift: int = 0, mrope: np.ndarray | None = None) -> None:
        """Rotate the first n_rot dims of every head of x (T, H, hd), C-contiguous float32, in place; token t at
        position pos0 + t; neox pairs (i, i + n_rot/2), else (2i, 2i+1); freq_factors (n_rot/2,) or empty. As
        `ops.rope`, with llama.cpp's float operations (its powf/cosf/sinf and its contracted rotation). shift,
        mrope: multimodal positions as attn_step's (hi_rope_multi)."""
        if not (type(x) is np.ndarray and x.dtype is _F32 and x.ndim == 3 and x.flags.c_contiguous
                and x.flags.writeable):
            x = _array("x", x, (_F32,))
            raise ValueError(f"x must be a writable C-contiguous (T, H, hd) array, got shape {x.shape}")
        T, H, hd = x.shape
        ffi = self._ffi
        ff = rope_freqs(ffi, freq_factors, n_rot)
        if shift or mrope is not None:
            rc = self._lib.hi_rope_multi(self._c, _ptr(ffi, "float *", x), T, H, hd, int(pos0), int(shift),
                                         _mrope_ptr(ffi, mrope, n_rot, T), int(n_rot), float(np.float32(theta_base)),
                                         1 if neox else 0, ff)
        else:
            rc = self._lib.hi_rope(self._c, _ptr(ffi, "float *", x), T, H, hd, int(pos0), int(n_rot),
                                   float(np.float32(theta_base)), 1 if neox else 0, ff)
        if rc:
            _check_rc(rc, "rope")

    def swiglu(self, g: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
        """out = silu(g) * u for (T, n) float32 rows (each row contiguous; out may be g or u), with llama.cpp's
        vector exp (ggml_vec_swiglu_f32 of this ISA's build)."""
        T, gs = _rows_fast("g", g, _F32, g.shape[-1])
        n = g.shape[-1]
        _, us = _rows_fast("u", u, _F32, n, T)
        _, os_ = _rows_fast("out", out, _F32, n, T, writable=True)
        ffi = self._ffi
        rc = self._lib.hi_swiglu(self._c, _ptr(ffi, "float *", g), gs, _ptr(ffi, "float *", u), us,
                                 _ptr(ffi, "float *", out), os_, T, n)
        if rc:
            _check_rc(rc, "swiglu")

    @property
    def has_gemm(self) -> bool:
        """This unit has float products of many rows (`gemm_pack`, `gemm`): the AVX2 and AVX-512 units."""
        return self._lib.hi_gemm_packed_floats(self._c, 1, 1) > 0

    def gemm_pack(self, w: np.ndarray, transposed: bool = False) -> np.ndarray | None:
        """W [N, K] float32 (rows contiguous) packed for `gemm` in this unit's panels (transposed: w is Wᵀ [K, N], a
        matmul's right operand); None where the unit has no float-product kernel (scalar, SSSE3: the caller keeps
        its BLAS)."""
        R, ws = _rows_fast("w", w, _F32, w.shape[-1] if getattr(w, "ndim", 0) == 2 else -1)
        N, K = (w.shape[1], R) if transposed else (R, w.shape[1])
        n = self._lib.hi_gemm_packed_floats(self._c, N, K)
        if n < 0:
            _check_rc(n, "gemm_pack")
        if n == 0:
            return None
        packed = np.empty(n, np.float32)
        ffi = self._ffi
        rc = self._lib.hi_gemm_pack(self._c, _ptr(ffi, "float *", w), ws, N, K, int(transposed),
                                    _ptr(ffi, "float *", packed))
        if rc:
            _check_rc(rc, "gemm_pack")
        return packed

    def gemm(self, x: np.ndarray, packed: np.ndarray, n: int, out: np.ndarray, bias: np.ndarray | None = None,
             residual: np.ndarray | None = None) -> np.ndarray:
        """out[M, n] = x[M, K] Wᵀ for W packed by `gemm_pack` (n its rows), on the pool: each output's k summed in
        order, 256 at a time (float32; rows of x and out contiguous, any row stride); then + bias (float32 [n]) where
        given, the bits of numpy's `out += bias` after the product; then residual + out where given ([M, n] float32,
        rows contiguous, not out's memory), the bits of numpy's `residual + (x @ W.T + bias)`."""
        M, xs = _rows_fast("x", x, _F32, x.shape[-1] if getattr(x, "ndim", 0) == 2 else -1)
        K = x.shape[1]
        _, ys = _rows_fast("out", out, _F32, n, M, writable=True)
        if packed.dtype != np.float32 or packed.size != self._lib.hi_gemm_packed_floats(self._c, n, K):
            raise KernelArgumentError(f"gemm: packed weights of {packed.size} {packed.dtype} values are not this "
                                      f"unit's panels of a [{n}, {K}] matrix")
        ffi = self._ffi
        b = ffi.NULL
        if bias is not None:
            _vector("gemm", "bias", bias, n)
            b = _ptr(ffi, "float *", bias)
        r, rs = ffi.NULL, 0
        if residual is not None:
            _, rs = _rows_fast("residual", residual, _F32, n, M)
            if np.may_share_memory(residual, out):
                raise KernelArgumentError("gemm: the residual must not share memory with out")
            r = _ptr(ffi, "float *", residual)
        rc = self._lib.hi_gemm(self._c, _ptr(ffi, "float *", x), xs, _ptr(ffi, "float *", packed), n, K,
                               _ptr(ffi, "float *", out), ys, M, b, r, rs)
        if rc:
            _check_rc(rc, "gemm")
        return out

    def repack(self, raw: np.ndarray, qtype) -> int:
        """Repack weight rows in place into the layout this unit reads fastest and return the qtype to pass
        with them from then on. raw: a writable C-contiguous uint8 array of whole `qtype` blocks (any number of
        rows or matrices). The SSSE3 unit reads K-quants (Q4_K, Q5_K, Q6_K) with each block's quant bytes in
        the order its kernels would shuffle every row they read into (Q5_K zipped 16 bytes at a time, Q4_K and Q6_K
        in pair order 32 at a time; native/simd/dot_kquants.h): it moves them so and returns
        qtype | KQ_ZIPPED, which only that unit accepts. Every other (unit, type) keeps ggml's layout: raw is
        left as it is and qtype returned. Products of the repacked rows give the same bits."""
        q = _qtype_of(qtype)
        if q & KQ_ZIPPED:
            raise ValueError(f"qtype {q:#x} is already repacked")
        raw = _array("raw", raw, (_U8,))
        if not raw.flags.c_contiguous or not raw.flags.writeable:
            raise ValueError("raw must be a writable C-contiguous uint8 array")
        rc = self._lib.hi_repack_rows(self._c, q, self._ffi.from_buffer("uint8_t[]", raw), raw.nbytes)
        if rc == -2:
            raise ValueError(f"raw has {raw.nbytes} bytes, not a whole number of {type_name(q)} blocks")
        if rc < 0:
            raise UnsupportedTensorTypeError(f"repack: ggml type {type_name(q)} has no SIMD kernel")
        return int(rc)

    def read_bandwidth(self, nbytes: int = 1 << 30, reps: int = 5) -> float:
        """Measured memory read bandwidth in bytes/s: every thread of the pool streams its slice of a fresh
        buffer of `nbytes` (make it much larger than the caches), best of `reps` passes."""
        nbytes, reps = int(nbytes), int(reps)
        if nbytes < 1 << 20:
            raise ValueError(f"nbytes must be at least 1 MiB, got {nbytes}")
        if reps < 1:
            raise ValueError(f"reps must be positive, got {reps}")
        bw = self._lib.hi_read_bandwidth(self._c, nbytes, reps)
        if bw <= 0:
            raise MemoryError(f"read_bandwidth: could not allocate or read {nbytes} bytes")
        return float(bw)

    def read_bandwidth_at(self, buf: np.ndarray, reps: int = 5) -> float:
        """read_bandwidth's passes over the whole 4 KiB pages of an existing C-contiguous array (the weights
        where they lie, say), read only, in bytes/s; best of `reps`."""
        reps = int(reps)
        if reps < 1:
            raise ValueError(f"reps must be positive, got {reps}")
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
            raise ValueError("buf must be a C-contiguous numpy array")
        if buf.nbytes < (1 << 20) + 4096 * self.n_threads:
            raise ValueError(f"buf has {buf.nbytes} bytes: read_bandwidth_at needs at least 1 MiB and a whole page "
                             f"per thread")
        ptr = self._ffi.cast("const void *", buf.ctypes.data)
        bw = self._lib.hi_read_bandwidth_at(self._c, ptr, buf.nbytes, reps)
        if bw <= 0:
            raise ValueError("read_bandwidth_at: the buffer reads as all zero bytes")
        return float(bw)

"""SimdLib's small decode ops (a part of simd.py's SimdLib): the C twins (native/simd/ops.c) of the numba ops in
ops.py, bit-identical to them, and the attention step (cache write, rope, attention) in one call. They cost
microseconds; what they buy is a decode step with no Python between its native calls (replay.py)."""

from __future__ import annotations

import numpy as np

from ...format.quant_types import F32, cache_row
from .simd_native import _F32, _I32, GGML_MUL_MAT, _array, _check_rc, _op, _ptr, _rows_fast


def _heads(name: str, a, n: int, writable: bool = False) -> tuple[int, int, int]:
    """(T, D) rows, or (T, H, n) heads each contiguous and heads of a token adjacent: (T, H, token stride)."""
    if getattr(a, "ndim", None) == 3:
        a = _array(name, a, (_F32,))
        T, H, hn = a.shape
        if hn != n or a.strides[2] != 4 or a.strides[1] != 4 * n or a.strides[0] % 4 or T < 1 or H < 1:
            raise ValueError(f"{name} must be (T, H, {n}) with contiguous heads, got shape {a.shape} "
                             f"strides {a.strides}")
        if writable and not a.flags.writeable:
            raise ValueError(f"{name} is read-only")
        return T, H, (a.strides[0] // 4 if T > 1 else H * n)
    T, st = _rows_fast(name, a, _F32, a.shape[-1] if getattr(a, "ndim", 0) else 0, writable=writable)
    if a.shape[-1] % n:
        raise ValueError(f"{name} rows of {a.shape[-1]} are not whole heads of {n}")
    return T, a.shape[-1] // n, st


def attention_args(q, k_cache, v_cache, pos0: int, out, scratch, writable: bool = False, k_type: int = F32,
                   v_type: int = F32) -> tuple[int, int, int, int, int, int]:
    """The checks of an attention call: q (T, H, hd) C-contiguous float32, the caches (n_ctx, H_kv, row)
    C-contiguous in their types' storage (f32: float32 hd values; f16: float16; q8_0 / q4_0: uint8, hd / 32 blocks'
    bytes), positions inside the cache, out (T, H*hd) rows, scratch a writable 1-D float32 array; writable: q and
    the caches too (an attention step writes them). Returns (T, H, hd, n_ctx, H_kv, out's row stride)."""
    if not (type(q) is np.ndarray and q.dtype is _F32 and q.ndim == 3 and q.flags.c_contiguous
            and (q.flags.writeable or not writable)):
        q = _array("q", q, (_F32,))
        raise ValueError(f"q must be a{' writable' if writable else ''} C-contiguous 3-D array, got shape "
                         f"{q.shape}{' (read-only)' if q.ndim == 3 and q.flags.c_contiguous else ''}")
    T, H, hd = q.shape
    shapes = []
    for name, arr, t in (("k_cache", k_cache, k_type), ("v_cache", v_cache, v_type)):
        dt, row = cache_row(t, hd)
        if not (type(arr) is np.ndarray and arr.dtype == dt and arr.ndim == 3 and arr.flags.c_contiguous
                and (arr.flags.writeable or not writable)):
            arr = _array(name, arr, (dt,))
            raise ValueError(f"{name} must be a{' writable' if writable else ''} C-contiguous 3-D {dt} array, got "
                             f"shape {arr.shape}{' (read-only)' if arr.ndim == 3 and arr.flags.c_contiguous else ''}")
        shapes.append((arr.shape, row))
    (kshape, krow), (vshape, vrow) = shapes
    n_ctx, Hkv = kshape[:2]
    if kshape[2] != krow or vshape != (n_ctx, Hkv, vrow) or H % Hkv:
        raise ValueError(f"q {q.shape}, k_cache {kshape} and v_cache {vshape} do not fit")
    pos0 = int(pos0)
    if pos0 < 0 or pos0 + T > n_ctx:
        raise ValueError(f"positions {pos0}..{pos0 + T - 1} are outside the cache of {n_ctx} rows")
    if getattr(out, "ndim", None) != 2:
        _array("out", out, (_F32,))
        raise ValueError(f"out must have shape ({T}, {H * hd}), got {out.shape}")
    _, os_ = _rows_fast("out", out, _F32, H * hd, T, writable=True)
    if not (type(scratch) is np.ndarray and scratch.dtype is _F32 and scratch.ndim == 1
            and scratch.flags.c_contiguous and scratch.flags.writeable):
        _array("scratch", scratch, (_F32,))
        raise ValueError(f"scratch must be a writable contiguous 1-D array, got shape {scratch.shape}")
    return T, H, hd, n_ctx, Hkv, os_


def _mrope_ptr(ffi, mrope, n_rot: int, T: int):
    """hi_rope_multi's table (models/mrope.mrope_table) or NULL, after checking its length."""
    if mrope is None:
        return ffi.NULL
    if not (type(mrope) is np.ndarray and mrope.dtype == np.int32 and mrope.flags.c_contiguous
            and mrope.shape == (n_rot // 2 + 4 * T,)):
        raise ValueError(f"mrope must be a contiguous int32 array of {n_rot // 2 + 4 * T} (n_rot/2 + 4T) values")
    return ffi.from_buffer("int32_t[]", mrope)


def _shift_ptr(ffi, shift, B: int):
    """hi_attn_rows' per-sequence rope shifts (a copy the call, and a recording of it, keep) or NULL."""
    if shift is None:
        return ffi.NULL
    a = np.array(shift, dtype=np.int64).reshape(-1)
    if a.shape != (B,):
        raise ValueError(f"rope_shift must hold one value per sequence ({B}), got {a.shape}")
    return [int(x) for x in a]


def rope_freqs(ffi, freq_factors: np.ndarray, n_rot: int):
    """rope's frequency factors: an empty array (NULL) or (n_rot/2,) contiguous float32."""
    if not freq_factors.shape[0]:
        return ffi.NULL
    if freq_factors.dtype != _F32 or freq_factors.shape != (n_rot // 2,) or not freq_factors.flags.c_contiguous:
        raise ValueError(f"freq_factors must be ({n_rot // 2},) float32, got {freq_factors.shape}")
    return _ptr(ffi, "float *", freq_factors)


class OpCalls:
    """Mixed into SimdLib (which provides _ffi, _lib and _c)."""

    def rms_norm(self, h: np.ndarray, y: np.ndarray | None, w: np.ndarray | None, eps: float,
                 out: np.ndarray | None) -> None:
        """The residual add and RMSNorm of ops.add_rms_norm / rms_norm / rms_norm_heads / add_inplace, bit for
        bit: with y, h += y; with w, out = rms_norm(h) * w, per row of h (T, D) or per head of h (T, H, n)
        (w (n,)); out shaped as h (may be h). float32; rows may be views of wider rows."""
        if w is None:
            n = h.shape[-1]
        else:
            w = _array("w", w, (_F32,))
            if w.ndim != 1 or not w.flags.c_contiguous:
                raise ValueError(f"w must be a contiguous 1-D array, got shape {w.shape}")
            n = w.shape[0]
        T, H, hs = _heads("h", h, n, writable=y is not None)
        ffi = self._ffi
        yp, ys = ffi.NULL, 0
        if y is not None:
            if getattr(y, "shape", None) != h.shape:
                raise ValueError(f"y has shape {getattr(y, 'shape', None)}, expected {h.shape}")
            _, _, ys = _heads("y", y, n)
            yp = _ptr(ffi, "float *", y)
        wp, op, os_ = ffi.NULL, ffi.NULL, 0
        if w is not None:
            if getattr(out, "shape", None) != h.shape:
                raise ValueError(f"out has shape {getattr(out, 'shape', None)}, expected {h.shape}")
            _, _, os_ = _heads("out", out, n, writable=True)
            wp, op = _ptr(ffi, "float *", w), _ptr(ffi, "float *", out)
        rc = self._lib.hi_rms_norm(self._c, _ptr(ffi, "float *", h), hs, yp, ys, T, H, n, wp, float(eps), op, os_)
        if rc:
            _check_rc(rc, "rms_norm")

    def copy_many(self, dsts: list[np.ndarray], srcs: list[np.ndarray]) -> None:
        """dst[...] = src for each pair, the bytes of all of them split over the pool (tens of MiB of recurrent
        state, which one thread copies at a fraction of what the cores together do). Each pair of one dtype and
        shape, dst writable; each array C-contiguous, or 2-D rows each contiguous (views of wider rows)."""
        if len(dsts) != len(srcs):
            raise ValueError(f"copy_many takes as many sources as destinations, got {len(srcs)} and {len(dsts)}")
        ffi = self._ffi
        n = len(dsts)
        spans = []  # per pair: rows, bytes a row, the destination's and the source's row strides in bytes
        for i, (d, x) in enumerate(zip(dsts, srcs, strict=True)):
            if not (type(d) is np.ndarray and type(x) is np.ndarray and d.flags.writeable and d.dtype == x.dtype
                    and d.shape == x.shape):
                raise ValueError(f"copy_many pair {i}: needs arrays of one dtype and shape, the destination "
                                 f"writable; got {getattr(d, 'shape', d)!r} <- {getattr(x, 'shape', x)!r}")
            if d.flags.c_contiguous and x.flags.c_contiguous or d.size == 0:
                spans.append((1, d.nbytes, d.nbytes, x.nbytes))
                continue
            row = d.shape[-1] * d.itemsize if d.ndim == 2 else 0
            if not (row and all(a.strides[1] == a.itemsize and a.strides[0] >= row for a in (d, x))):
                raise ValueError(f"copy_many pair {i}: arrays must be C-contiguous or 2-D rows each contiguous, got "
                                 f"strides {d.strides} <- {x.strides}")
            spans.append((d.shape[0], row, d.strides[0], x.strides[0]))
        rows, rb, dst_row, src_row = zip(*spans, strict=True) if n else ((),) * 4

        def arg(t: str, v) -> object:
            return ffi.new(t, list(v)) if n else ffi.NULL

        # addresses: the arrays stay alive through the call (and a bound call keeps them: SimdLib.bind)
        rc = self._lib.hi_copy_many(self._c, n, arg("void *[]", [_ptr(ffi, "char *", d) for d in dsts]),
                                    arg("int64_t[]", dst_row), arg("void *[]", [_ptr(ffi, "char *", x) for x in srcs]),
                                    arg("int64_t[]", src_row), arg("int64_t[]", rows), arg("int64_t[]", rb))
        if rc:
            _check_rc(rc, "copy_many")

    def split_qgate(self, qg: np.ndarray, q: np.ndarray, gate: np.ndarray | None) -> None:
        """ops.split_qgate: qg (T, H*2*hd), per head [query, gate] -> q (T, H, hd) C-contiguous and gate
        (T, H*hd); gate None: qg (T, H*hd) holds the queries alone (q = qg)."""
        if not (type(q) is np.ndarray and q.dtype is _F32 and q.ndim == 3 and q.flags.c_contiguous
                and q.flags.writeable):
            q = _array("q", q, (_F32,))
            raise ValueError(f"q must be a writable C-contiguous (T, H, hd) array, got shape {q.shape}")
        T, H, hd = q.shape
        T_, qs = _rows_fast("qg", qg, _F32, H * hd * (1 if gate is None else 2), T)
        ffi = self._ffi
        gp, gs = ffi.NULL, 0
        if gate is not None:
            _, gs = _rows_fast("gate", gate, _F32, H * hd, T, writable=True)
            gp = _ptr(ffi, "float *", gate)
        rc = self._lib.hi_split_qgate(self._c, _ptr(ffi, "float *", qg), qs, T, H, hd, _ptr(ffi, "float *", q), gp,
                                      gs)
        if rc:
            _check_rc(rc, "split_qgate")

    def sigmoid_gate(self, o: np.ndarray, gate: np.ndarray) -> None:
        """ops.attn_gate: o (T, n) *= 1 / (1 + expf(-gate)) in place."""
        T, os_ = _rows_fast("o", o, _F32, o.shape[-1], writable=True)
        _, gs = _rows_fast("gate", gate, _F32, o.shape[-1], T)
        ffi = self._ffi
        rc = self._lib.hi_sigmoid_gate(self._c, _ptr(ffi, "float *", o), os_, _ptr(ffi, "float *", gate), gs, T,
                                       o.shape[-1])
        if rc:
            _check_rc(rc, "sigmoid_gate")

    def moe_route(self, logits: np.ndarray, k: int, idx: np.ndarray, w: np.ndarray) -> None:
        """ops.moe_route: the k best experts of each row of logits (T, E) float32 into idx (T, k) int32, their
        renormalized softmax weights into w (T, k) float32."""
        T, ls = _rows_fast("logits", logits, _F32, logits.shape[-1])
        E, k = logits.shape[-1], int(k)
        if not 1 <= k <= E:
            raise ValueError(f"k must be in [1, {E}], got {k}")
        for name, a, dt in (("idx", idx, _I32), ("w", w, _F32)):
            if not (type(a) is np.ndarray and a.dtype is dt and a.shape == (T, k) and a.flags.c_contiguous
                    and a.flags.writeable):
                _array(name, a, (dt,))
                raise ValueError(f"{name} must be a writable C-contiguous ({T}, {k}) array, got shape {a.shape}")
        ffi = self._ffi
        rc = self._lib.hi_moe_route(self._c, _ptr(ffi, "float *", logits), ls, T, E, k, _ptr(ffi, "int32_t *", idx),
                                    _ptr(ffi, "float *", w))
        if rc:
            _check_rc(rc, "moe_route")

    def moe_combine(self, ys: np.ndarray, w: np.ndarray, out: np.ndarray, s: np.ndarray | None = None,
                    x: np.ndarray | None = None, w_shg: np.ndarray | None = None) -> None:
        """ops.moe_combine (s None) or ops.moe_combine_gated: out (T, D) = the k experts' rows ys (T*k, D)
        weighted by w (T, k), plus s (T, D) gated by sigmoid(x[t] . w_shg). Contiguous float32 arrays."""
        w = _array("w", w, (_F32,))
        if w.ndim != 2 or not w.flags.c_contiguous:
            raise ValueError(f"w must be a C-contiguous (T, k) array, got shape {w.shape}")
        T, k = w.shape
        D = out.shape[-1]
        arrs = [("ys", ys, (T * k, D), False), ("out", out, (T, D), True)]
        if s is not None:
            arrs += [("s", s, (T, D), False), ("x", x, (T, D), False), ("w_shg", w_shg, (D,), False)]
        ffi = self._ffi
        ptrs = {}
        for name, a, shape, wr in arrs:
            a = _array(name, a, (_F32,))
            if a.shape != shape or not a.flags.c_contiguous or (wr and not a.flags.writeable):
                raise ValueError(f"{name} must be a C-contiguous {shape} array, got shape {a.shape}")
            ptrs[name] = _ptr(ffi, "float *", a)
        rc = self._lib.hi_moe_combine(self._c, ptrs["ys"], _ptr(ffi, "float *", w), T, k, D, ptrs["out"],
                                      *(ptrs[n] if s is not None else ffi.NULL for n in ("s", "x", "w_shg")))
        if rc:
            _check_rc(rc, "moe_combine")

    def attn_step(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                  pos0: int, out: np.ndarray, scratch: np.ndarray, n_rot: int, theta_base: float, neox: bool,
                  freq_factors: np.ndarray, ggml_op: int = GGML_MUL_MAT, k_type: int = F32, v_type: int = F32,
                  rot_k: int = 0, rot_v: int = 0, rope_shift: int = 0, mrope: np.ndarray | None = None) -> None:
        """One attention step of T tokens at pos0..: `rope` of q and their k (T, H_kv, hd) (views of wider rows
        allowed), those K rows and the v rows written to the caches' rows pos0.. in the caches' ggml types k_type,
        v_type (f32, f16, q8_0, q4_0), then attention into out: both F32 as `attention` (ggml_op as there), any
        other type in the order of llama.cpp's CPU flash attention. rot_k, rot_v: the rotation of quantized K / V
        rows (state_kinds.kv_rotation; 0: none)."""
        T, H, hd, n_ctx, Hkv, os_ = attention_args(q, k_cache, v_cache, pos0, out, scratch, True, k_type, v_type)
        _, _, kvs = _heads("k", k, hd)
        if k.shape != (T, Hkv, hd) or v.shape != k.shape or _heads("v", v, hd)[2] != kvs:
            raise ValueError(f"k {k.shape} and v {v.shape} must be ({T}, {Hkv}, {hd}) with the same strides")
        ffi = self._ffi
        ff = rope_freqs(ffi, freq_factors, n_rot)
        rc = self._lib.hi_attn_step(
            self._c, _ptr(ffi, "float *", q), T, H, hd, _ptr(ffi, "float *", k), _ptr(ffi, "float *", v), kvs,
            _ptr(ffi, "char *", k_cache), _ptr(ffi, "char *", v_cache), int(k_type), int(v_type), n_ctx, Hkv,
            int(pos0), int(n_rot), float(np.float32(theta_base)), 1 if neox else 0, ff,
            float(np.float32(1.0) / np.sqrt(np.float32(hd))), _ptr(ffi, "float *", out), os_,
            _ptr(ffi, "float *", scratch), scratch.shape[0], _op(ggml_op), int(rot_k), int(rot_v), int(rope_shift),
            _mrope_ptr(ffi, mrope, n_rot, T))
        if rc:
            _check_rc(rc, "attn_step")

    def attn_store(self, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos0: int,
                   n_rot: int, theta_base: float, neox: bool, freq_factors: np.ndarray, k_type: int = F32,
                   v_type: int = F32, rot_k: int = 0, rot_v: int = 0, rope_shift: int = 0,
                   mrope: np.ndarray | None = None) -> None:
        """attn_step's cache writes alone (no query, no attention): the same bytes at rows pos0.. of the caches."""
        if getattr(k, "ndim", None) != 3:
            raise ValueError(f"k must be (T, H_kv, hd) heads, got shape {getattr(k, 'shape', None)}")
        hd = k.shape[2]
        T, Hkv, kvs = _heads("k", k, hd)
        if v.shape != k.shape or _heads("v", v, hd)[2] != kvs:
            raise ValueError(f"k {k.shape} and v {v.shape} must be (T, H_kv, hd) with the same strides")
        q = np.empty((T, Hkv, hd), np.float32)  # only for the caches' checks: the call reads no query
        n_ctx = attention_args(q, k_cache, v_cache, pos0, np.empty((T, Hkv * hd), np.float32),
                               np.empty(1, np.float32), True, k_type, v_type)[3]
        ffi = self._ffi
        rc = self._lib.hi_attn_store(
            self._c, T, hd, _ptr(ffi, "float *", k), _ptr(ffi, "float *", v), kvs, _ptr(ffi, "char *", k_cache),
            _ptr(ffi, "char *", v_cache), int(k_type), int(v_type), n_ctx, Hkv, int(pos0), int(n_rot),
            float(np.float32(theta_base)), 1 if neox else 0, rope_freqs(ffi, freq_factors, n_rot), int(rot_k),
            int(rot_v), int(rope_shift), _mrope_ptr(ffi, mrope, n_rot, T))
        if rc:
            _check_rc(rc, "attn_store")

    def attn_rows(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, k_caches, v_caches, positions, dpos: int,
                  out: np.ndarray, scratch: np.ndarray, n_rot: int, theta_base: float, neox: bool,
                  freq_factors: np.ndarray, k_type: int = F32, v_type: int = F32, rot_k: int = 0,
                  rot_v: int = 0, rope_shift=None) -> None:
        """attn_step for one token of each of B sequences in one call: row j of q (B, H, hd), k, v (B, H_kv, hd)
        and out (B, H*hd) is sequence j's token, at position positions[j] + dpos of its caches k_caches[j],
        v_caches[j] (n_ctx rows, in types k_type / v_type); every (sequence, head) row in one pool run, bit-identical
        to B attn_step calls. The positions are copied (a recorded call replays them, dpos moving on); rope_shift
        (None, or one int a sequence, copied too): each sequence's rotary position minus its row (models/mrope)."""
        k_caches, v_caches = list(k_caches), list(v_caches)
        B = len(k_caches)
        if B == 0 or len(v_caches) != B:
            raise ValueError(f"attn_rows takes one K and one V cache per sequence, got {B} and {len(v_caches)}")
        T, H, hd, n_ctx, Hkv, os_ = attention_args(q, k_caches[0], v_caches[0], 0, out, scratch, True, k_type,
                                                   v_type)
        if T != B:
            raise ValueError(f"q has {T} rows for {B} sequences")
        for j, (kc, vc) in enumerate(zip(k_caches, v_caches, strict=True)):
            for name, c, c0 in ((f"k_caches[{j}]", kc, k_caches[0]), (f"v_caches[{j}]", vc, v_caches[0])):
                if not (type(c) is np.ndarray and c.dtype == c0.dtype and c.shape == c0.shape
                        and c.flags.c_contiguous and c.flags.writeable):
                    raise ValueError(f"{name} must be a writable C-contiguous {c0.dtype} array of shape {c0.shape}")
        pos = np.array(positions, dtype=np.int64).reshape(-1)
        if pos.shape != (B,) or (pos + int(dpos) < 0).any() or (pos + int(dpos) >= n_ctx).any():
            raise ValueError(f"positions {pos.tolist()} (+ {int(dpos)}) must be one per sequence inside the cache of "
                             f"{n_ctx} rows")
        _, _, kvs = _heads("k", k, hd)
        if k.shape != (B, Hkv, hd) or v.shape != k.shape or _heads("v", v, hd)[2] != kvs:
            raise ValueError(f"k {k.shape} and v {v.shape} must be ({B}, {Hkv}, {hd}) with the same strides")
        ffi = self._ffi
        rc = self._lib.hi_attn_rows(
            self._c, B, _ptr(ffi, "float *", q), H * hd, H, hd, _ptr(ffi, "float *", k), _ptr(ffi, "float *", v), kvs,
            [ffi.from_buffer("char[]", c) for c in k_caches], [ffi.from_buffer("char[]", c) for c in v_caches],
            int(k_type), int(v_type), n_ctx, Hkv, ffi.from_buffer("int64_t[]", pos), int(dpos), int(n_rot),
            float(np.float32(theta_base)), 1 if neox else 0, rope_freqs(ffi, freq_factors, n_rot),
            float(np.float32(1.0) / np.sqrt(np.float32(hd))), _ptr(ffi, "float *", out), os_,
            _ptr(ffi, "float *", scratch), scratch.shape[0], int(rot_k), int(rot_v), _shift_ptr(ffi, rope_shift, B))
        if rc:
            _check_rc(rc, "attn_rows")

"""SimdLib's row ops of the vision tower (a part of simd.py's SimdLib): LayerNorm, the tanh and erf GELUs and the
rotary layout of the attention's heads (native/simd/vrows.c), the bits of the numba kernels of vision_kernels.py on
the library's own pool, whose hand-over to its threads costs microseconds where a Python pool's cost a millisecond.
A bad array raises KernelArgumentError naming the op, the argument and what was wrong with it."""

from __future__ import annotations

import numpy as np

from ...errors import KernelArgumentError
from .simd_native import _F32, _check_rc, _ptr, _rows_fast, _vector


def _rows(op: str, name: str, a, width: int | None = None, T: int | None = None,
          writable: bool = False) -> tuple[int, int]:
    """(rows, row stride in floats) of a float32 (T, width) array with contiguous rows (or one (width,) row)."""
    if width is None:
        width = a.shape[-1] if isinstance(a, np.ndarray) and a.ndim in (1, 2) else -1
    try:
        return _rows_fast(name, a, _F32, width, T, writable=writable)
    except (TypeError, ValueError) as e:
        raise KernelArgumentError(f"{op}: {e}") from None


def _same_rows(a: np.ndarray, b: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.strides == b.strides \
        and a.shape == b.shape


def _dense(op: str, name: str, a, shape: tuple, writable: bool = False) -> None:
    if not (isinstance(a, np.ndarray) and a.dtype == _F32 and a.shape == shape and a.flags.c_contiguous
            and (a.flags.writeable or not writable)):
        what = "a writable" if writable else "a"
        flags = getattr(a, "flags", None)
        how = "" if flags is None else " (strided)" if not flags.c_contiguous else " (read-only)" if not \
            flags.writeable else ""
        raise KernelArgumentError(f"{op}: {name} must be {what} C-contiguous float32 array of shape {shape}, got "
                                  f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}{how}")


class VisionRowCalls:
    """Mixed into SimdLib (which provides _ffi, _lib and _c)."""

    def layer_norm(self, x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
        """out = (x - mean) / sqrt(var + eps) · w + b for each row of x (rows, c) float32 (rows contiguous, any row
        stride; out likewise, not x's memory): the statistics in double summed in order, then
        float((x - mu) / sd) · w + b in float32 (vision_kernels.layer_norm_rows' bits)."""
        T, xs = _rows("layer_norm", "x", x)
        n = x.shape[-1]
        _, os_ = _rows("layer_norm", "out", out, n, T, writable=True)
        _vector("layer_norm", "w", w, n)
        _vector("layer_norm", "b", b, n)
        if np.may_share_memory(x, out):
            raise KernelArgumentError("layer_norm: out must not share memory with x")
        ffi = self._ffi
        rc = self._lib.hi_vrows_layer_norm(self._c, _ptr(ffi, "float *", x), xs, T, n, _ptr(ffi, "float *", w),
                                           _ptr(ffi, "float *", b), float(eps), _ptr(ffi, "float *", out), os_)
        if rc:
            _check_rc(rc, "layer_norm")
        return out

    def gelu_tanh(self, x: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> np.ndarray:
        """out = gelu(x + bias) by tanh, as v / (1 + e^(-2u)), u = sqrt(2/pi) (v + 0.044715 v³), in float32 with
        Cephes' float exp (vision_kernels.gelu_tanh_rows' bits); bias None: v = x. out may be x."""
        return self._gelu(0, "gelu_tanh", x, bias, out)

    def gelu_erf(self, x: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> np.ndarray:
        """out = v/2 (1 + erf(v / sqrt 2)), v = x + bias in float32 (bias None: v = x), in double, rounded
        (vision_kernels.gelu_erf_rows' bits). out may be x."""
        return self._gelu(1, "gelu_erf", x, bias, out)

    def _gelu(self, kind: int, op: str, x, bias, out) -> np.ndarray:
        T, xs = _rows(op, "x", x)
        n = x.shape[-1]
        _, os_ = _rows(op, "out", out, n, T, writable=True)
        ffi = self._ffi
        bp = ffi.NULL
        if bias is not None:
            _vector(op, "bias", bias, n)
            bp = _ptr(ffi, "float *", bias)
        if out is not x and not _same_rows(x, out) and np.may_share_memory(x, out):
            raise KernelArgumentError(f"{op}: out must be x itself or not share memory with it")
        rc = self._lib.hi_vrows_gelu(self._c, kind, _ptr(ffi, "float *", x), xs, T, n, bp,
                                     _ptr(ffi, "float *", out), os_)
        if rc:
            _check_rc(rc, op)
        return out

    def rope_heads(self, qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, qh: np.ndarray, k: np.ndarray,
                   vh: np.ndarray, k_transposed: bool = True) -> None:
        """The attention's heads from qkv [rows, 3, heads, hd]: qh, vh [heads, rows, hd] and k [heads, hd, rows]
        (k_transposed, kᵀ by head for the score products) or [heads, rows, hd], q and k rotated x · cos +
        rotate_half(x) · sin by cos, sin [rows, hd] (NeoX halves; vision_kernels.rope_heads' bits). All float32
        C-contiguous; the outputs writable, apart from each other and from the inputs."""
        op = "rope_heads"
        if not (isinstance(qkv, np.ndarray) and qkv.ndim == 4 and qkv.shape[1] == 3 and qkv.shape[0] > 0
                and qkv.shape[2] > 0 and qkv.shape[3] >= 2 and qkv.shape[3] % 2 == 0):
            raise KernelArgumentError(f"{op}: qkv must be [rows, 3, heads, head_dim] with an even head_dim, got "
                                      f"shape {getattr(qkv, 'shape', type(qkv).__name__)}")
        n, _, H, hd = qkv.shape
        _dense(op, "qkv", qkv, qkv.shape)
        for name, a in (("cos", cos), ("sin", sin)):
            _dense(op, name, a, (n, hd))
        for name, a, shape in (("qh", qh, (H, n, hd)), ("k", k, (H, hd, n) if k_transposed else (H, n, hd)),
                               ("vh", vh, (H, n, hd))):
            _dense(op, name, a, shape, writable=True)
        outs = (("qh", qh), ("k", k), ("vh", vh))
        for i, (name, a) in enumerate(outs):
            for other, b in (("qkv", qkv), ("cos", cos), ("sin", sin), *outs[i + 1:]):
                if np.may_share_memory(a, b):
                    raise KernelArgumentError(f"{op}: {name} shares memory with {other}")
        ffi = self._ffi
        rc = self._lib.hi_vrows_rope_heads(self._c, _ptr(ffi, "float *", qkv), _ptr(ffi, "float *", cos),
                                           _ptr(ffi, "float *", sin), n, H, hd, _ptr(ffi, "float *", qh),
                                           _ptr(ffi, "float *", k), 1 if k_transposed else 0,
                                           _ptr(ffi, "float *", vh))
        if rc:
            _check_rc(rc, op)

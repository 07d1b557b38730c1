"""SimdLib's fused attention for the vision tower (a part of simd.py's SimdLib; native/simd/vattn.c and
kernels_vattn.h): every head's full softmax attention in one call, an online softmax over blocks of keys with the
float products' register-blocked kernel, no score buffer. The AVX2 and AVX-512 units have it; below, the tower keeps
its numpy path."""

from __future__ import annotations

import numpy as np

from .simd_native import _F32, _array, _check_rc
from .simd_native import _exact as _heads


class VisionCalls:
    """Mixed into SimdLib (which provides _ffi, _lib and _c)."""

    @property
    def has_attention_full(self) -> bool:
        """This unit has the fused full attention (`attention_full`): the AVX2 and AVX-512 units."""
        return self._lib.hi_vision_attention_floats(self._c, 1, 1, 1) > 0

    def attention_full_floats(self, n: int, nh: int, hd: int) -> int:
        """float32 values of workspace `attention_full` takes for n rows of nh heads of hd values on this context
        (its threads included); 0 where the unit has no such kernel."""
        r = self._lib.hi_vision_attention_floats(self._c, int(n), int(nh), int(hd))
        if r < 0:
            raise ValueError(f"attention_full: n {n}, heads {nh} and head_dim {hd} must be positive")
        return int(r)

    def attention_full(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, out: np.ndarray,
                       workspace: np.ndarray | None = None) -> np.ndarray:
        """out[i, h, :] = softmax_j(scale · q[h, i] · k[h, j]) v[h] for every row i, head h and key j (no mask), on the
        pool: q, k, v [heads, n, head_dim], out [n, heads, head_dim], all C-contiguous float32. workspace: at
        least attention_full_floats(n, heads, head_dim) float32 values (None: allocated for this call). A row's
        bits do not depend on the thread count. Raises NotImplementedError on a unit without the kernel (scalar,
        SSSE3)."""
        q = _array("q", q, (_F32,))
        if q.ndim != 3 or 0 in q.shape:
            raise ValueError(f"q must be [heads, n, head_dim] with none empty, got shape {q.shape}")
        nh, n, hd = q.shape
        _heads("q", q, (nh, n, hd))
        _heads("k", k, (nh, n, hd))
        _heads("v", v, (nh, n, hd))
        _heads("out", out, (n, nh, hd), writable=True)
        need = self.attention_full_floats(n, nh, hd)
        if need == 0:
            raise NotImplementedError(f"attention_full: the {self.isa} unit has no fused attention")
        if workspace is None:
            workspace = np.empty(need, np.float32)
        ws = _array("workspace", workspace, (_F32,))
        if ws.ndim != 1 or not ws.flags.c_contiguous or not ws.flags.writeable or ws.size < need:
            raise ValueError(f"workspace must be a writable contiguous float32 vector of at least {need} values, got "
                             f"shape {ws.shape}")
        scale = float(np.float32(scale))
        if not np.isfinite(scale):
            raise ValueError(f"attention_full: scale must be finite, got {scale}")
        ffi = self._ffi

        def ptr(a):
            return ffi.from_buffer("float[]", a, require_writable=False)

        rc = self._lib.hi_vision_attention(self._c, ptr(q), ptr(k), ptr(v), n, nh, hd, scale, ptr(out), ptr(ws),
                                           ws.size)
        if rc:
            _check_rc(rc, "attention_full")
        return out

"""The vision tower's products on the CPU. The tower is compute-bound (hundreds of rows per product): F32 and F16
matrices (what mmproj files hold) go through numpy's BLAS on F32 copies made once, a blocked SGEMM that runs about
five times the SIMD library's row kernels, which are built for the few-row products of decode (2026-11-28, 2-core
EPYC: 62 against 12 GFLOP/s a core); the BLAS threads are numpy's (OPENBLAS_NUM_THREADS). A quantized mmproj's
matrices go through the SIMD library in their stored bytes, activations in the format the type takes, in the
MUL_MAT float shape (as llama.cpp); a type it lacks is dequantized to F32 once. The rest of the tower (norms,
rotary, attention, GELUs) is the reference's numpy (backends/vision.py)."""

from __future__ import annotations

import numpy as np

from ...format.quant_types import F16, F32
from ..vision import RefVisionOps
from .simd import GGML_MUL_MAT, KERNEL_TYPES


class CPUVisionOps(RefVisionOps):
    def __init__(self, gm, args, tower, simd):
        super().__init__(gm, args, tower)
        self.simd = simd
        self._raw: dict[str, tuple[np.ndarray, int, int, int]] = {}

    def _float(self, name: str) -> bool:
        t = self.gm.tensor("v.patch_embd.weight" if name == "v.patch_embd" else name + ".weight")
        return t.qtype in (F32, F16)

    def _weights(self, name: str) -> tuple[np.ndarray, int, int, int]:
        """(raw bytes, ggml type, rows, cols) of a product's matrix."""
        hit = self._raw.get(name)
        if hit is not None:
            return hit
        gm = self.gm
        t = gm.tensor("v.patch_embd.weight" if name == "v.patch_embd" else name + ".weight")
        rows, cols = int(t.ne[-1]), int(t.n_elements // t.ne[-1]) * (2 if name == "v.patch_embd" else 1)
        if name == "v.patch_embd":
            t0, t1 = gm.tensor("v.patch_embd.weight"), gm.tensor("v.patch_embd.weight.1")
            if t0.qtype == t1.qtype and t0.qtype in (F32, F16):
                dt = np.float32 if t0.qtype == F32 else np.float16
                halves = [t.raw().view(dt).reshape(t.shape) for t in (t0, t1)]
                w, q = np.ascontiguousarray(np.stack(halves, axis=2).reshape(t0.shape[0], -1)), t0.qtype
            else:
                w, q = self.matrix(name), F32
        else:
            if t.qtype in KERNEL_TYPES:
                w, q = t.raw(), t.qtype
            else:
                w, q = self.matrix(name), F32
        hit = self._raw[name] = (np.ascontiguousarray(w).reshape(-1).view(np.uint8), q, rows, cols)
        return hit

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if self._float(name):
            return super().linear(x, name)
        w, q, rows, cols = self._weights(name)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], rows), np.float32)
        self.simd.matmul(w, q, rows, cols, self.simd.quantize(x, q), out, GGML_MUL_MAT)
        out += self.vector(name + ".bias")
        return out

"""The vision tower's products on the CPU. The tower is compute-bound (hundreds of rows per product): F32 and F16
matrices (what mmproj files hold) go through the SIMD library's float products (kernels_gemm.h: register-blocked, on
its thread pool, the bias and a block's residual added in their last pass) on weights packed once into its unit's
panels, on the AVX2 and AVX-512 units; one-thread OpenBLAS calls side by side had not scaled past a third of 16
threads on the GPU machine's Xeon (2026-11-28). Below AVX2 they go through numpy's BLAS on F32 copies made once (the
SIMD library's row kernels are built for the few-row products of decode: 12 against 62 GFLOP/s a core), split by rows
(the attention: by heads) over `n_threads` threads of the tower's own, numpy's OpenBLAS held to one thread meanwhile
(cpu/blas_threads.py says why). A quantized mmproj's matrices go through the SIMD library in their stored bytes,
activations in the format the type takes, in the MUL_MAT float shape (as llama.cpp); a type it lacks is dequantized
to F32 once. The attention, on the AVX2 and AVX-512 units, is the library's fused kernel (native/simd/vattn.c: an
online softmax over blocks of keys, no score buffer); below, the reference's blocks (backends/vision.py) with the
softmax in a numba kernel on the tower's threads. The norms, GELUs and the rotary layout run in the SIMD library's
row ops on its pool (native/simd/vrows.c, the bits of the numba kernels of cpu/vision_kernels.py: handing a call to a
Python pool's threads had cost a millisecond, their work a fraction of that on 16 threads)."""

from __future__ import annotations

import numpy as np

from ...format.quant_types import F16, F32
from ..vision import ATTN_SCORE_FLOATS, RefVisionOps, attention_heads
from . import blas_threads
from . import vision_kernels as vk
from .simd import GGML_MUL_MAT, KERNEL_TYPES


class CPUVisionOps(RefVisionOps):
    def __init__(self, gm, args, tower, simd):
        super().__init__(gm, args, tower)
        self.simd = simd
        self._raw: dict[str, tuple[np.ndarray, int, int, int]] = {}
        self._packed: dict[str, tuple[np.ndarray | None, int]] = {}
        self._gemm = getattr(simd, "has_gemm", False)  # the library's float products, else numpy's BLAS
        self.rows = vk.RowPool(getattr(simd, "n_threads", 1))
        self._scores = np.empty(0, np.float32)
        self._fused = getattr(simd, "has_attention_full", False)  # the library's fused attention, else blocks
        self._split = blas_threads.available()

    def _matmul(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = a @ b on a unit without float products or fused attention (scalar, SSSE3): over the tower's threads
        in parts, each a one-thread BLAS product: b's columns (out's) for a matrix b, the stack's first axis for
        stacked ones (the attention's heads); without a handle on numpy's BLAS threads, one product on BLAS's own."""
        if not self._split:
            return np.matmul(a, b, out=out)
        with blas_threads.one_thread():
            if a.ndim == b.ndim == 3:
                self.rows.run(_mm, (a, b, out), chunks=2 * self.rows.n)
            else:  # by the weight's rows (out's columns): each part packs only its slice of the weights but all of
                # the activations, so one part a thread (four cost ~10% on 1152-wide products)
                self.rows.run_ranges(_mm_cols, b.shape[1], a, b, out)
        return out

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
            return self._float_product(x, name, self.vector(name + ".bias"))
        w, q, rows, cols = self._weights(name)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], rows), np.float32)
        self.simd.matmul(w, q, rows, cols, self.simd.quantize(x, q), out, GGML_MUL_MAT)
        out += self.vector(name + ".bias")
        return out

    def linear_add(self, x: np.ndarray, name: str, residual: np.ndarray) -> np.ndarray:
        if not self._float(name):
            return super().linear_add(x, name, residual)
        return self._float_product(x, name, self.vector(name + ".bias"), residual)

    def _float_product(self, x: np.ndarray, name: str, bias: np.ndarray | None = None,
                       residual: np.ndarray | None = None) -> np.ndarray:
        """residual + (x Wᵀ + bias) (each part where given) of an F32/F16 matrix over the pool: the SIMD library's
        float products on W packed once into its unit's panels (the F32 copy then dropped) where the unit has them,
        the bias and the residual added there while each tile is in cache (numpy passes over the output on one
        core: a few milliseconds a layer at 448x448), else numpy's BLAS on the F32 copy."""
        hit = self._packed.get(name)
        if hit is None:
            w = self.matrix(name)
            p = self.simd.gemm_pack(w) if self._gemm else None
            if p is not None:
                self._mat.pop(name, None)
            hit = self._packed[name] = (p, w.shape[0])
        p, n = hit
        out = np.empty((x.shape[0], n), np.float32)
        if p is None:
            self._matmul(x, self.matrix(name).T, out)
            if bias is not None:
                out += bias
            return out if residual is None else residual + out
        if x.shape[0]:
            res = None if residual is None else np.ascontiguousarray(residual, dtype=np.float32)
            self.simd.gemm(np.ascontiguousarray(x, dtype=np.float32), p, n, out, bias, res)
        return out

    def layer_norm(self, x: np.ndarray, name: str, eps: float) -> np.ndarray:
        return _row_op(self.simd.layer_norm, x, self.vector(name + ".weight"), self.vector(name + ".bias"), float(eps))

    def gelu_tanh(self, x: np.ndarray) -> np.ndarray:
        return _row_op(self.simd.gelu_tanh, x, None)

    def gelu_erf(self, x: np.ndarray) -> np.ndarray:
        return _row_op(self.simd.gelu_erf, x, None)

    def linear_gelu(self, x: np.ndarray, name: str, kind: str) -> np.ndarray:
        """The bias and the GELU in one pass over the product, in place (the MLP's rows are the tower's largest)."""
        if not self._float(name):
            return super().linear_gelu(x, name, kind)
        out = self._float_product(x, name)
        if out.shape[0]:
            (self.simd.gelu_tanh if kind == "tanh" else self.simd.gelu_erf)(out, self.vector(name + ".bias"), out)
        return out

    def rotary_attention(self, qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, scale: float) -> np.ndarray:
        """q and k rotated and laid out by head in one pass on the library's pool (k in rows for the fused kernel, kᵀ
        for the products), then on a unit that has it the library's fused attention (every head in one call, an
        online softmax over blocks of keys, no score buffer), else the reference's blocks of products with the
        softmax on the tower's threads. The fused kernel's workspace and the blocks' scores buffer (at most
        ATTN_SCORE_FLOATS, 64 MiB) are kept for the next layer and image."""
        n, _, nh, hd = qkv.shape
        qh, vh = np.empty((nh, n, hd), np.float32), np.empty((nh, n, hd), np.float32)
        k = np.empty((nh, n, hd) if self._fused else (nh, hd, n), np.float32)
        c32 = np.ascontiguousarray
        self.simd.rope_heads(c32(qkv, dtype=np.float32), c32(cos, dtype=np.float32), c32(sin, dtype=np.float32), qh,
                             k, vh, k_transposed=not self._fused)
        if self._fused:
            need = self.simd.attention_full_floats(n, nh, hd)
            if self._scores.size < need:
                self._scores = np.empty(need, np.float32)
            return self.simd.attention_full(qh, k, vh, scale, np.empty((n, nh, hd), np.float32),
                                            workspace=self._scores)
        need = nh * n * min(n, max(1, ATTN_SCORE_FLOATS // (n * nh)))
        if self._scores.size < need:
            self._scores = np.empty(need, np.float32)
        return attention_heads(qh, k, vh, scale, lambda sc, s: self.rows.run(vk.softmax_rows, (sc,), s),
                               buf=self._scores, matmul=self._matmul)

    def close(self) -> None:
        self.rows.close()
        self._scores = np.empty(0, np.float32)


def _row_op(op, x: np.ndarray, *args) -> np.ndarray:
    """op(x's rows, *args, out's rows) into a new array of x's shape: the SIMD library's row ops (native/simd/vrows.c)
    on its pool."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    if x.size:
        op(x.reshape(-1, x.shape[-1]), *args, out.reshape(-1, x.shape[-1]))
    return out


def _mm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b, out=out)


def _mm_cols(s: int, e: int, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b[:, s:e], out=out[:, s:e])

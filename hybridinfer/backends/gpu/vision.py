"""The vision tower's products on the card, through gemm.cu (k_gemm.gemm); everything else is the reference's
numpy (backends/vision.py), on the host. Weights are uploaded once, F32 and F16 in their stored bytes (any other
type dequantized to F32), each row zero-padded to a multiple of 32 weights (the kernels step K by 32; the MLP's
4304 is not one), the activations padded the same way per call: zeros add nothing to the sums."""

from __future__ import annotations

import re

import numpy as np

from ...format.quant_types import F16, F32
from ..vision import RefVisionOps
from . import loader

K_STEP = 32


def _pad_cols(a: np.ndarray, k: int) -> np.ndarray:
    if a.shape[1] == k:
        return np.ascontiguousarray(a)
    out = np.zeros((a.shape[0], k), a.dtype)
    out[:, :a.shape[1]] = a
    return out


class GPUVisionOps(RefVisionOps):
    def __init__(self, gm, args, tower, device: int = 0):
        super().__init__(gm, args, tower)
        loader.init(device)
        self._dev: dict = {}
        # the products' work and the card's time for them (kernel time between events, no transfers), summed since
        # load: `bench vision` gives their FLOP/s against the card's FMA peak
        self.product_flops, self.product_s = 0, 0.0
        self.by_product: dict[str, list] = {}  # a product's name over the blocks -> [FLOPs, seconds, tile]

    def reset_counters(self) -> None:
        self.product_flops, self.product_s, self.by_product = 0, 0.0, {}

    def _host_matrix(self, name: str) -> tuple[np.ndarray, int]:
        """(W [N, K] as float32 or float16, its ggml type) without dequantizing F16."""
        gm = self.gm
        if name == "v.patch_embd":
            t0, t1 = gm.tensor("v.patch_embd.weight"), gm.tensor("v.patch_embd.weight.1")
            if t0.qtype == t1.qtype == F16:
                halves = [t.raw().view(np.float16).reshape(t.shape) for t in (t0, t1)]
                return self.tower.patch_weight(*halves), F16
            return self.matrix(name), F32
        t = gm.tensor(name + ".weight")
        if t.qtype == F16:
            return t.raw().view(np.float16).reshape(t.shape), F16
        return self.matrix(name), F32

    def _weight(self, name: str):
        hit = self._dev.get(name)
        if hit is None:
            from .k_gemm import DeviceWeight

            w, q = self._host_matrix(name)
            k = -(-w.shape[1] // K_STEP) * K_STEP
            hit = self._dev[name] = (DeviceWeight.upload(_pad_cols(w, k), q, (w.shape[0], k)), k)
        return hit

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        import pycuda.driver as drv
        from pycuda import gpuarray

        from .k_gemm import gemm, pick_tile

        with loader.on_this_thread():
            w, k = self._weight(name)
            xs = gpuarray.to_gpu(_pad_cols(np.asarray(x, dtype=np.float32), k))
            tile = pick_tile(x.shape[0], x.shape[0], w.shape[0], qtype=w.qtype, K=k)
            start, end = drv.Event(), drv.Event()
            start.record()
            ys = gemm(xs, w, tile=tile)
            end.record()
            end.synchronize()
            sec, fl = end.time_since(start) / 1e3, 2 * x.shape[0] * w.shape[0] * x.shape[1]  # the unpadded work
            self.product_s += sec
            self.product_flops += fl
            got = self.by_product.setdefault(re.sub(r"blk\.\d+\.", "blk.*.", name), [0, 0.0, tile])
            got[0] += fl
            got[1] += sec
            y = ys.get()
        return y + self.vector(name + ".bias")

    def close(self) -> None:
        with loader.on_this_thread():
            self._dev.clear()

"""The vision tower on the card: one image's activations stay there from the patch embedding to the merger's rows,
which come down once. Products through gemm.cu (k_gemm.gemm), their epilogues (bias, the tanh and erf GELUs, the
residual add), the LayerNorms and the rotary split through elementwise.cu, the attention through attention.cu's
non-causal attn_full. The forward is models/qwen3vl_vision.forward's, op for op; the host computes only the inputs
(the patch rows, the position table resampled to the grid, the rotary angles).

Weights: F32 and F16 in their stored bytes (any other type dequantized to F32), each row zero-padded to a multiple
of 32 weights (vision_plan.padded), and each activation that feeds a product written with its rows padded the same
way: zeros add nothing to the sums. Resident (uploaded at first use and kept) or streamed (each stage's matrices
uploaded for its products and freed after them), as vision_plan.tower_plan decides beside the text model."""

from __future__ import annotations

import re
from contextlib import contextmanager

import numpy as np

from ...errors import CapacityError, ParameterError
from ...format.quant_types import F16, F32
from ..vision import RefVisionOps
from . import k_attention as ka
from . import k_elementwise as ke
from . import loader
from .vision_plan import RESIDENT, STREAMED, activation_bytes, buffer_floats, matrix_shape, padded


def _pad_cols(a: np.ndarray, k: int) -> np.ndarray:
    if a.shape[1] == k:
        return np.ascontiguousarray(a)
    out = np.zeros((a.shape[0], k), a.dtype)
    out[:, :a.shape[1]] = a
    return out


def _view(flat, shape: tuple, offset: int = 0):
    """A C-contiguous view of `shape` into a flat float32 GPUArray, `offset` values in."""
    size = int(np.prod(shape))
    return flat[offset:offset + size].reshape(shape)


def _put(flat, host: np.ndarray, offset: int = 0):
    """host (2-D float32) copied into `flat` at `offset`; its view."""
    import pycuda.driver as drv

    host = np.ascontiguousarray(host, dtype=np.float32)
    v = _view(flat, host.shape, offset)
    drv.memcpy_htod(int(v.gpudata), host)
    return v


def itemsize_of(gm):
    """The card bytes a weight of product `name` takes per value (vision_plan.matrix_bytes' itemsize)."""
    def size(name: str) -> int:
        parts = ("v.patch_embd.weight", "v.patch_embd.weight.1") if name == "v.patch_embd" else (name + ".weight",)
        return 2 if all(gm.tensor(p).qtype == F16 for p in parts) else 4

    return size


class GPUVisionOps(RefVisionOps):
    """`forward(patches, grid)` on the card. mode: RESIDENT or STREAMED; plan: the vision_plan.TowerPlan this tower
    was given (None: no limit), whose activations bound the image an encode takes (CapacityError past it); ctx: the
    card context it runs in (loader.card_context's: one card of a multi-card prefill), None: the process's first
    (loader.init's). Its buffers live in that context, so every encode and the close enter it."""

    def __init__(self, gm, args, tower, device: int = 0, mode: str = RESIDENT, plan=None, ctx=None):
        super().__init__(gm, args, tower)
        if mode not in (RESIDENT, STREAMED):
            raise ParameterError(f"GPU vision tower mode must be {RESIDENT!r} or {STREAMED!r}, got {mode!r}")
        loader.init(device)
        self.mode, self.plan, self.ctx = mode, plan, ctx
        self._dev: dict = {}  # product name -> DeviceWeight (rows padded)
        self._dvec: dict = {}  # vector name -> float32 GPUArray
        self._buf: dict = {}  # an encode's activation buffers (vision_plan.buffer_floats)
        self._timed: list = []  # (name, FLOPs, tile, (start, end) events) of the products enqueued, not yet read
        self.encodes = 0  # images this tower encoded on the card
        self.held_bytes = self.peak_bytes = 0  # card bytes of its weights, vectors and buffers: now, and the most
        # the products' work and the card's time for them (kernel time between events, no transfers), summed since
        # load: `bench vision` gives their FLOP/s against the card's FMA peak
        self.product_flops, self.product_s = 0, 0.0
        self.by_product: dict[str, list] = {}  # a product's name over the blocks -> [FLOPs, seconds, tile]

    def _current(self):
        """Its context current on the calling thread (the encoder's, not the thread that loaded the engine)."""
        return loader.on_this_thread() if self.ctx is None else loader.on_card(self.ctx)

    def reset_counters(self) -> None:
        self.product_flops, self.product_s, self.by_product = 0, 0.0, {}

    def _note(self) -> None:
        self.held_bytes = (sum(w.data.nbytes for w in self._dev.values()) + sum(v.nbytes for v in self._dvec.values())
                           + sum(b.nbytes for b in self._buf.values()))
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

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
            k = padded(w.shape[1])
            hit = self._dev[name] = DeviceWeight.upload(_pad_cols(w, k), q, (w.shape[0], k))
            self._note()
        return hit

    def _on_card(self, name: str):
        v = self._dvec.get(name)
        if v is None:
            from pycuda import gpuarray

            v = self._dvec[name] = gpuarray.to_gpu(self.vector(name))
            self._note()
        return v

    def _product(self, x, name: str, out_flat, part=None):
        """out = x @ W(name)ᵀ into the front of out_flat, timed between two events (read after the download). part:
        a buffer free at this point, which lets a product of too few tiles for the card split over K
        (k_gemm.split_count); its partial sums go there."""
        import pycuda.driver as drv

        from .k_gemm import gemm, pick_tile

        w = self._weight(name)
        rows, n = int(x.shape[0]), w.shape[0]
        y = _view(out_flat, (rows, n))
        tile = pick_tile(rows, rows, n, qtype=w.qtype, K=w.shape[1])
        ev = (drv.Event(), drv.Event())
        ev[0].record()
        gemm(x, w, out=y, tile=tile, part=part)
        ev[1].record()
        self._timed.append((name, 2 * rows * n * matrix_shape(self.args, name)[1], tile, ev))  # the unpadded work
        return y

    def _settle(self) -> None:
        for name, fl, tile, (start, end) in self._timed:
            end.synchronize()
            sec = end.time_since(start) / 1e3
            self.product_s += sec
            self.product_flops += fl
            got = self.by_product.setdefault(re.sub(r"blk\.\d+\.", "blk.*.", name), [0, 0.0, tile])
            got[0] += fl
            got[1] += sec
        self._timed = []

    @contextmanager
    def _stage(self, names):
        """A stage's products; streamed, their weights are freed after them (once the card is done with them)."""
        yield
        if self.mode == STREAMED:
            import pycuda.driver as drv

            drv.Context.synchronize()
            for n in names:
                self._dev.pop(n, None)
            self._note()

    def forward(self, patches: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        """Patch rows [h·w, patch_dim] of one image -> merged rows [h·w/m², out_dim] (qwen3vl_vision.forward)."""
        a = self.args
        self.tower.check_grid(a, patches, grid)
        need = activation_bytes(a, int(patches.shape[0]))
        if self.plan is not None and need > self.plan.activations:
            raise CapacityError(f"an image of {patches.shape[0]} patches needs {need} B of activations on the card; "
                                f"the vision tower was planned for {self.plan.activations} B")
        with self._current():
            try:
                rows = self._run(np.asarray(patches, dtype=np.float32), grid)
            finally:
                self._timed, self._buf = [], {}
                if self.mode == STREAMED:
                    self._dev.clear()
                self._note()
        self.encodes += 1
        return rows

    def _run(self, patches: np.ndarray, grid) -> np.ndarray:
        from pycuda import gpuarray

        a, t = self.args, self.tower
        _, gh, gw = grid
        m, c, nh, hd, eps = a.merge_size, a.n_embd, a.n_head, a.head_dim, a.eps
        n, cp = gh * gw, padded(c)
        B = self._buf = {k: gpuarray.empty(v, np.float32) for k, v in buffer_floats(a, n).items()}
        self._note()
        x = _put(B["x"], _pad_cols(t.position_embedding(self.vector("v.position_embd.weight"), a.pos_side, gh, gw, m),
                                   cp))
        cos, sin = t.rope_tables(gh, gw, m, hd)
        cs, sn = _put(B["rope"], cos), _put(B["rope"], sin, n * hd)
        with self._stage(("v.patch_embd",)):
            y = self._product(_put(B["h"], _pad_cols(patches, padded(a.prep.patch_dim))), "v.patch_embd", B["y"],
                              B["qkv"])
            ke.bias_act(y, x, self._on_card("v.patch_embd.bias"), "add")  # the position rows + (patches W + b)
        h, g = _view(B["h"], (n, cp)), _view(B["g"], (n, padded(a.n_ff)))
        qkv, o = _view(B["qkv"], (3, n, nh, hd)), _view(B["o"], (n, nh, hd))
        q, k, v = (_view(B["qkv"], (n, nh, hd), j * n * c) for j in range(3))
        o2 = o.reshape(n, c)
        for i in range(a.n_layer):
            b = f"v.blk.{i}."
            with self._stage([b + p for p in ("attn_qkv", "attn_out", "ffn_up", "ffn_down")]):
                ke.layer_norm(x, self._on_card(b + "ln1.weight"), self._on_card(b + "ln1.bias"), eps, h)
                y = self._product(h, b + "attn_qkv", B["y"], B["g"])
                ke.rope_split(y, self._on_card(b + "attn_qkv.bias"), cs, sn, qkv)
                ka.attention_full(q, k, v, o, hd ** -0.5)
                src = o2 if c == cp else ke.bias_act(o2, h)  # rows padded for the product
                y = self._product(src, b + "attn_out", B["y"], B["g"])
                ke.bias_act(y, x, self._on_card(b + "attn_out.bias"), "add")
                ke.layer_norm(x, self._on_card(b + "ln2.weight"), self._on_card(b + "ln2.bias"), eps, h)
                y = self._product(h, b + "ffn_up", B["y"], B["qkv"])
                ke.bias_act(y, g, self._on_card(b + "ffn_up.bias"), "gelu_tanh")
                y = self._product(g, b + "ffn_down", B["y"], B["qkv"])
                ke.bias_act(y, x, self._on_card(b + "ffn_down.bias"), "add")
        nm, mc = n // (m * m), a.merged_dim
        ke.layer_norm(x, self._on_card("v.post_ln.weight"), self._on_card("v.post_ln.bias"), eps, o2)
        merged = _view(B["o"], (nm, mc))  # each merge window's m² rows side by side
        if mc != padded(mc):
            merged = ke.bias_act(merged, _view(B["h"], (nm, padded(mc))))
        with self._stage(("mm.0", "mm.2")):
            y = self._product(merged, "mm.0", B["y"], B["qkv"])
            y = self._product(ke.bias_act(y, _view(B["g"], (nm, padded(mc))), self._on_card("mm.0.bias"), "gelu_erf"),
                              "mm.2", B["y"], B["qkv"])
            ke.bias_act(y, y, self._on_card("mm.2.bias"))
            out = y.get()
        self._settle()
        return out

    def close(self) -> None:
        with self._current():
            self._dev.clear()
            self._dvec.clear()
            self._buf = {}

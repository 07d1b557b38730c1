"""The vision tower (models/qwen3vl_vision.py) on a backend: the numpy reference's ops, and the encoder object the
engine holds (`ImageEncoder` of models/vision_types.py). The reference is the oracle: the CPU's ops (cpu/vision.py)
replace its numpy with threaded products and numba row kernels, and the tests hold them to it."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from ..errors import ParameterError
from ..format.gguf_model import GGUFModel
from ..format.image_prep import Prepared, prepare
from ..models import vision_args
from ..models.vision_types import ImageEmbedding

ATTN_SCORE_FLOATS = 1 << 24  # query rows per attention block: at most this many scores (64 MiB) at once


def _gelu_erf_kernel():
    import numba

    @numba.vectorize(["float32(float32)"], cache=True)
    def gelu_erf(x):  # torch's nn.GELU(): x/2 (1 + erf(x/sqrt 2)), in float64 then rounded
        xd = np.float64(x)
        return np.float32(0.5 * xd * (1.0 + math.erf(xd * 0.7071067811865476)))

    return gelu_erf


_GELU_ERF = None


def _softmax_kernel():
    import numba

    @numba.njit(["void(float32[:, :], float32)"], parallel=True, cache=True)
    def softmax_rows(sc, scale):  # each row: scaled, max-subtracted, exponentiated, normalized; rows over threads
        for r in numba.prange(sc.shape[0]):
            row = sc[r]
            m = np.float32(-np.inf)
            for j in range(row.shape[0]):
                row[j] *= scale
                m = max(m, row[j])
            t = np.float32(0.0)
            for j in range(row.shape[0]):
                row[j] = np.exp(row[j] - m)
                t += row[j]
            for j in range(row.shape[0]):
                row[j] /= t

    return softmax_rows


_SOFTMAX = None


class RefVisionOps:
    """The tower's ops in numpy: float32 products and activations, LayerNorm statistics in float64."""

    def __init__(self, gm: GGUFModel, args, tower):
        self.gm, self.args, self.tower = gm, args, tower
        self._vec: dict[str, np.ndarray] = {}
        self._mat: dict[str, np.ndarray] = {}

    def vector(self, name: str) -> np.ndarray:
        v = self._vec.get(name)
        if v is None:
            v = self._vec[name] = np.ascontiguousarray(self.gm.dequant(name), dtype=np.float32)
        return v

    def matrix(self, name: str) -> np.ndarray:
        """W [out, in] float32 (the patch embedding's two halves joined)."""
        w = self._mat.get(name)
        if w is None:
            if name == "v.patch_embd":
                halves = (self.gm.dequant("v.patch_embd.weight"), self.gm.dequant("v.patch_embd.weight.1"))
                w = self.tower.patch_weight(*halves)
            else:
                w = self.gm.dequant(name + ".weight")
            w = self._mat[name] = np.ascontiguousarray(w, dtype=np.float32)
        return w

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return np.matmul(x, self.matrix(name).T) + self.vector(name + ".bias")

    def layer_norm(self, x: np.ndarray, name: str, eps: float) -> np.ndarray:
        xd = x.astype(np.float64)
        mu = xd.mean(-1, keepdims=True)
        var = ((xd - mu) ** 2).mean(-1, keepdims=True)
        y = ((xd - mu) / np.sqrt(var + eps)).astype(np.float32)
        return y * self.vector(name + ".weight") + self.vector(name + ".bias")

    def gelu_tanh(self, x: np.ndarray) -> np.ndarray:
        """0.5 x (1 + tanh(c (x + 0.044715 x^3))), evaluated in place in that order (few temporaries: the MLP's
        rows are large)."""
        c = np.float32(math.sqrt(2.0 / math.pi))
        t = x * np.float32(0.044715)
        t *= x
        t *= x
        t += x
        t *= c
        np.tanh(t, out=t)
        t += np.float32(1)
        y = x * np.float32(0.5)
        y *= t
        return y

    def gelu_erf(self, x: np.ndarray) -> np.ndarray:
        global _GELU_ERF
        if _GELU_ERF is None:
            _GELU_ERF = _gelu_erf_kernel()
        return _GELU_ERF(np.ascontiguousarray(x, dtype=np.float32))

    def linear_add(self, x: np.ndarray, name: str, residual: np.ndarray) -> np.ndarray:
        """residual + linear(x, name): a block's residual add after its product."""
        return residual + self.linear(x, name)

    def linear_gelu(self, x: np.ndarray, name: str, kind: str) -> np.ndarray:
        return (self.gelu_tanh if kind == "tanh" else self.gelu_erf)(self.linear(x, name))

    def rotary_attention(self, qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, scale: float) -> np.ndarray:
        """attention(rotary(q), rotary(k), v) of qkv [rows, 3, heads, head_dim] -> [rows, heads, head_dim]."""
        q, k = self.rotary(qkv[:, 0], cos, sin), self.rotary(qkv[:, 1], cos, sin)
        return self.attention(q, k, np.ascontiguousarray(qkv[:, 2]), scale)

    def rotary(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return self.tower.rotate(x, cos, sin)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
        """Full (non-causal) attention within the image, all heads in one batched product per block of query rows
        (bounded memory), each score row scaled, max-subtracted, exponentiated and normalized in place over numba's
        threads (numpy's ufuncs run on one core, and the exponentials were half the tower's attention time)."""
        global _SOFTMAX
        if _SOFTMAX is None:
            _SOFTMAX = _softmax_kernel()
        return attention_blocks(q, k, v, scale, _SOFTMAX)


def attention_blocks(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, softmax,
                     score_floats: int = ATTN_SCORE_FLOATS) -> np.ndarray:
    """`attention_heads` of q, k, v [rows, heads, head_dim] laid out head-major."""
    qh = np.ascontiguousarray(q.transpose(1, 0, 2))  # (heads, rows, hd): contiguous operands for BLAS
    kt = np.ascontiguousarray(k.transpose(1, 2, 0))
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))
    return attention_heads(qh, kt, vh, scale, softmax, score_floats)


def attention_heads(qh: np.ndarray, kt: np.ndarray, vh: np.ndarray, scale: float, softmax,
                    score_floats: int = ATTN_SCORE_FLOATS, buf: np.ndarray | None = None, matmul=None) -> np.ndarray:
    """softmax(q kᵀ · scale) v per head -> [rows, heads, head_dim], from qh, vh [heads, rows, head_dim] and kt
    [heads, head_dim, rows] (or a transposed view): a batched product over the heads per block of query rows holding
    at most `score_floats` scores; softmax(scores [r, n], scale) normalizes rows in place. buf: a float32 buffer for
    the scores, used when large enough (a fresh large array costs a page fault per 4 KiB on every call). matmul(a, b,
    out): the batched product (None: numpy's)."""
    mm = matmul or (lambda a, b, out: np.matmul(a, b, out=out))
    nh, n, hd = qh.shape
    out = np.empty((n, nh, hd), np.float32)
    oh = out.transpose(1, 0, 2)  # the products write the heads' rows in place: no transpose after
    block = min(n, max(1, score_floats // (n * nh)))
    if buf is None or buf.size < nh * block * n:
        buf = np.empty(nh * block * n, np.float32)
    for s in range(0, n, block):
        rows = min(block, n - s)
        sc = buf[:nh * rows * n].reshape(nh, rows, n)
        mm(qh[:, s:s + rows], kt, sc)
        softmax(sc.reshape(-1, n), np.float32(scale))
        mm(sc, vh, oh[:, s:s + rows])
    return out


class VisionEncoder:
    """One mmproj's tower on one backend's ops: `encode(rgb PIL image) -> ImageEmbedding` (models/vision_types.py).
    `prepare` and `encode_prepared` are its two halves, so a cache can key on the digest before computing."""

    def __init__(self, gm: GGUFModel, args, tower, ops):
        self.gm, self.args, self.tower, self.ops = gm, args, tower, ops
        self.n_embd = args.out_dim

    def prepare(self, image) -> Prepared:
        return prepare(image, self.args.prep)

    def rows(self, patches: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        """One image's patch rows -> the projector's rows: the ops' own forward where they have one (the card's whole
        tower, gpu/vision.py), else the tower module's over the ops."""
        own = getattr(self.ops, "forward", None)
        return own(patches, grid) if own is not None else self.tower.forward(self.args, self.ops, patches, grid)

    def encode_prepared(self, p: Prepared) -> ImageEmbedding:
        rows = self.rows(p.patches, p.grid)
        t, h, w = p.grid
        m = self.args.merge_size
        return ImageEmbedding(np.ascontiguousarray(rows, dtype=np.float32), (t, h // m, w // m), p.digest)

    def encode(self, image) -> ImageEmbedding:
        return self.encode_prepared(self.prepare(image))

    def close(self) -> None:
        if hasattr(self.ops, "close"):
            self.ops.close()
        self.ops = None
        self.gm.close()


def load_image_encoder(path, n_embd_text: int | None, simd=None, min_pixels: int | None = None,
                       max_pixels: int | None = None, gpu: bool = False, min_tokens: int | None = None,
                       max_tokens: int | None = None, vram_room: int | None = None, card=None) -> VisionEncoder:
    """The mmproj at `path` as an encoder: the whole tower on the card with `gpu` (gpu/vision.py), else on the CPU
    through `simd` (a cpu.simd.SimdLib), else the numpy reference. vram_room: the card bytes the tower may take
    (gpu/vision_plan.tower_plan: its weights resident, streamed, or where not even that fits, the CPU's tower;
    `ops.plan` says which); None: resident, unbounded. card: the CUDA context of the card the tower runs on (a
    multi-card prefill's `tower_context`), None: the process's first. n_embd_text: the text model's embedding width,
    which the projector's rows must have (MMProjWidthError). The image's size limits: min/max_pixels, or in merged
    tokens (llama.cpp's --image-min-tokens / --image-max-tokens; a token is (patch·merge)² pixels), else the file's
    or Qwen3.5's processor defaults (format/image_prep.py)."""
    for name, v in (("min_tokens", min_tokens), ("max_tokens", max_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ParameterError(f"image {name} must be a positive integer, got {v!r}")
    if not os.path.isfile(path):
        raise ParameterError(f"mmproj {os.fspath(path)!r}: no such file")
    gm = GGUFModel(path)
    try:
        gm.check_finite()
        tower, args = vision_args(gm, min_pixels, max_pixels)
        if min_tokens is not None or max_tokens is not None:
            px = args.prep.factor ** 2
            lo = min_tokens * px if min_tokens is not None else args.prep.min_pixels
            hi = max_tokens * px if max_tokens is not None else args.prep.max_pixels
            if lo > hi:
                raise ParameterError(f"image min tokens ({lo // px}) must not exceed max tokens ({hi // px})")
            args = dataclasses.replace(args, prep=dataclasses.replace(args.prep, min_pixels=lo, max_pixels=hi))
        if n_embd_text is not None:
            tower.check_text_width(args, n_embd_text, str(path))
        ops = _gpu_ops(gm, args, tower, vram_room, card) if gpu else None
        if ops is None and simd is None:
            ops = RefVisionOps(gm, args, tower)
        elif ops is None:
            from .cpu.vision import CPUVisionOps

            ops = CPUVisionOps(gm, args, tower, simd)
    except BaseException:
        gm.close()
        raise
    return VisionEncoder(gm, args, tower, ops)


def _gpu_ops(gm: GGUFModel, args, tower, vram_room: int | None, card=None):
    """The card's tower (in context `card`) as vram_room allows (None: resident, unbounded), or None where it does
    not fit."""
    from .gpu.vision import GPUVisionOps, itemsize_of
    from .gpu.vision_plan import CPU, RESIDENT, tower_plan

    if vram_room is None:
        return GPUVisionOps(gm, args, tower, mode=RESIDENT, ctx=card)
    plan = tower_plan(args, itemsize_of(gm), int(vram_room))
    return None if plan.mode == CPU else GPUVisionOps(gm, args, tower, mode=plan.mode, plan=plan, ctx=card)

"""`clip` / `qwen3vl_merger`: the Qwen3.5 (and Qwen3-VL without deepstack) vision tower of an mmproj GGUF, as
llama.cpp's converter writes it for `Qwen3_5ForConditionalGeneration` (docs/vision.md).

The forward is written once here over a small op vocabulary (`VisionOps`: linear, layer norm, the two GELUs,
attention); the reference and CPU backends implement it. It follows transformers' `Qwen3_5VisionModel`, the
trained model, where llama.cpp differs (docs/vision.md §traps: the merger's GELU is erf, not tanh).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import GGUFError, TensorShapeError, UnsupportedArchitectureError
from ..format.gguf_model import GGUFModel
from ..format.image_prep import QWEN_MAX_PIXELS, QWEN_MIN_PIXELS, PrepConfig
from .base import Meta, TensorSpec, check_tensors, require

ARCH = "clip"
PROJECTOR = "qwen3vl_merger"
ROPE_THETA = 10000.0  # not in the file; transformers' vision config default and llama.cpp's constant


class MMProjWidthError(TensorShapeError):
    """The projector's output rows are not as wide as the text model's embeddings."""


@dataclass(frozen=True)
class VisionArgs:
    n_embd: int  # the tower's width C
    n_ff: int
    n_layer: int
    n_head: int
    patch_size: int
    merge_size: int
    pos_side: int  # the learned position table is pos_side x pos_side
    eps: float
    out_dim: int  # the projector's rows: the text model's embedding width
    prep: PrepConfig

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def merged_dim(self) -> int:
        return self.n_embd * self.merge_size * self.merge_size

    @classmethod
    def from_gguf(cls, gm: GGUFModel, min_pixels: int | None = None, max_pixels: int | None = None) -> VisionArgs:
        if gm.arch != ARCH:
            raise UnsupportedArchitectureError(
                f"{gm.path!r}: an mmproj must have general.architecture 'clip', got {gm.arch!r}")
        m = Meta(gm, ARCH)
        proj = m.get("projector_type", None) or m.get("vision.projector_type", None)
        if proj != PROJECTOR:
            raise UnsupportedArchitectureError(
                f"{gm.path!r}: projector type {proj!r} is not supported (supported: {PROJECTOR!r})")
        if any(m.get("vision.is_deepstack_layers", []) or []):
            raise UnsupportedArchitectureError(
                f"{gm.path!r}: deepstack layers (Qwen3-VL) are not supported; Qwen3.5's tower has none")
        c = m.int("vision.embedding_length", lo=1)
        n_head = m.int("vision.attention.head_count", lo=1)
        patch = m.int("vision.patch_size", lo=1)
        require(c % n_head == 0 and (c // n_head) % 4 == 0, gm,
                f"vision embedding_length {c} must be n_head {n_head} heads of a multiple of 4")
        n_pos = int(gm.tensor("v.position_embd.weight").ne[1])
        side = int(round(n_pos ** 0.5))
        require(side * side == n_pos, gm, f"v.position_embd holds {n_pos} rows, not a square grid")
        mean, std = m.get("vision.image_mean", None), m.get("vision.image_std", None)
        for key, v in (("image_mean", mean), ("image_std", std)):
            if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, int | float) for x in v)):
                raise GGUFError(f"{gm.path!r}: metadata clip.vision.{key} = {v!r} is not 3 numbers")
        if any(s <= 0 for s in std):
            raise GGUFError(f"{gm.path!r}: metadata clip.vision.image_std = {std!r} must be positive")
        file_min = m.get("vision.image_min_pixels", None)
        file_max = m.get("vision.image_max_pixels", None)
        prep = PrepConfig(
            patch_size=patch, merge_size=m.int("vision.spatial_merge_size", 2, lo=1), temporal_patch_size=2,
            image_mean=tuple(float(x) for x in mean), image_std=tuple(float(x) for x in std),
            min_pixels=int(min_pixels or file_min or QWEN_MIN_PIXELS),
            max_pixels=int(max_pixels or file_max or QWEN_MAX_PIXELS))
        args = cls(n_embd=c, n_ff=m.int("vision.feed_forward_length", lo=1), n_layer=m.int("vision.block_count", lo=1),
                   n_head=n_head, patch_size=patch, merge_size=prep.merge_size, pos_side=side,
                   eps=m.float("vision.attention.layer_norm_epsilon", 1e-6, positive=True),
                   out_dim=m.int("vision.projection_dim", lo=1), prep=prep)
        check_tensors(gm, tensor_specs(args))
        return args


def tensor_specs(a: VisionArgs) -> list[TensorSpec]:
    c, f, p, mc = a.n_embd, a.n_ff, a.patch_size, a.merged_dim
    specs = [TensorSpec("v.patch_embd.weight", (p, p, 3, c)), TensorSpec("v.patch_embd.weight.1", (p, p, 3, c)),
             TensorSpec("v.patch_embd.bias", (c,)), TensorSpec("v.position_embd.weight", (c, a.pos_side ** 2)),
             TensorSpec("v.post_ln.weight", (c,)), TensorSpec("v.post_ln.bias", (c,)),
             TensorSpec("mm.0.weight", (mc, mc)), TensorSpec("mm.0.bias", (mc,)),
             TensorSpec("mm.2.weight", (mc, a.out_dim)), TensorSpec("mm.2.bias", (a.out_dim,))]
    for i in range(a.n_layer):
        b = f"v.blk.{i}."
        specs += [TensorSpec(b + "ln1.weight", (c,)), TensorSpec(b + "ln1.bias", (c,)),
                  TensorSpec(b + "attn_qkv.weight", (c, 3 * c)), TensorSpec(b + "attn_qkv.bias", (3 * c,)),
                  TensorSpec(b + "attn_out.weight", (c, c)), TensorSpec(b + "attn_out.bias", (c,)),
                  TensorSpec(b + "ln2.weight", (c,)), TensorSpec(b + "ln2.bias", (c,)),
                  TensorSpec(b + "ffn_up.weight", (c, f)), TensorSpec(b + "ffn_up.bias", (f,)),
                  TensorSpec(b + "ffn_down.weight", (f, c)), TensorSpec(b + "ffn_down.bias", (c,))]
    return specs


def check_text_width(a: VisionArgs, n_embd_text: int, path: str = "") -> None:
    if a.out_dim != n_embd_text:
        raise MMProjWidthError(
            f"mmproj {path!r} projects to rows of width {a.out_dim}, but the text model's embedding width is "
            f"{n_embd_text}: this mmproj belongs to another model")


def patch_weight(w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """The converter's two Conv2D halves [C, 3, p, p] joined into the Conv3D as a matrix [C, 3·2·p·p], columns in
    the patch rows' (channel, t, y, x) order."""
    return np.ascontiguousarray(np.stack([w0, w1], axis=2).reshape(w0.shape[0], -1))


def matrix_names(a: VisionArgs) -> list[str]:
    """The products of the tower (GGUF names without `.weight`); `v.patch_embd` is `patch_weight`'s join."""
    names = ["v.patch_embd"]
    for i in range(a.n_layer):
        names += [f"v.blk.{i}.{n}" for n in ("attn_qkv", "attn_out", "ffn_up", "ffn_down")]
    return names + ["mm.0", "mm.2"]


class VisionOps(Protocol):
    """What a backend supplies: `linear(x, name)` = x @ W(name)ᵀ + b(name) for a name of `matrix_names`."""

    def linear(self, x: np.ndarray, name: str) -> np.ndarray: ...
    def layer_norm(self, x: np.ndarray, name: str, eps: float) -> np.ndarray: ...
    def gelu_tanh(self, x: np.ndarray) -> np.ndarray: ...
    def gelu_erf(self, x: np.ndarray) -> np.ndarray: ...
    def linear_gelu(self, x: np.ndarray, name: str, kind: str) -> np.ndarray: ...  # gelu_<kind>(linear(x, name))
    def linear_add(self, x: np.ndarray, name: str, residual: np.ndarray) -> np.ndarray: ...  # residual + linear
    def rotary_attention(self, qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, scale: float) -> np.ndarray: ...
    def vector(self, name: str) -> np.ndarray: ...


def window_coords(gh: int, gw: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in merge-window order (the processor's and transformers' order)."""
    r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    shape = (gh // m, m, gw // m, m)
    return r.reshape(shape).transpose(0, 2, 1, 3).ravel(), c.reshape(shape).transpose(0, 2, 1, 3).ravel()


def position_embedding(table: np.ndarray, side: int, gh: int, gw: int, m: int) -> np.ndarray:
    """The learned side x side table resampled to the gh x gw grid, bilinear with align_corners (transformers'
    `get_vision_interpolation_indices_and_weights`, in float32), rows in merge-window order."""
    rows, cols = window_coords(gh, gw, m)

    def taps(index: np.ndarray, size: int):
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        fl = np.floor(src)
        t = np.clip(fl.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
        wts = np.maximum(np.float32(1) - np.abs(src[:, None] - fl[:, None] - np.arange(2, dtype=np.float32)), 0)
        return t, wts.astype(np.float32)

    ht, hw = taps(rows, gh)
    wt, ww = taps(cols, gw)
    idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    wgt = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    out = table[idx[:, 0]] * wgt[:, 0:1]  # the four taps summed in order, without a [N, 4, C] temporary
    for j in range(1, 4):
        out += table[idx[:, j]] * wgt[:, j:j + 1]
    return out


def rope_tables(gh: int, gw: int, m: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [N, head_dim]: axial 2-D rotary angles, (h, w) frequencies over head_dim/4 each, the pair
    [h, w] repeated for the two halves that NeoX-style rotation pairs (transformers' Qwen3_5VisionRotaryEmbedding)."""
    half = head_dim // 2
    inv = (1.0 / (ROPE_THETA ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))).astype(np.float32)
    rows, cols = window_coords(gh, gw, m)
    fh = rows.astype(np.float32)[:, None] * inv
    fw = cols.astype(np.float32)[:, None] * inv
    f = np.concatenate([fh, fw, fh, fw], axis=1)
    return np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [rows, heads, head_dim] rotated: x · cos + rotate_half(x) · sin (the reference's rotary embedding)."""
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def check_grid(a: VisionArgs, patches: np.ndarray, grid: tuple[int, int, int]) -> None:
    """TensorShapeError unless `patches` are the rows of one still image's grid (t = 1, sides whole merge windows)."""
    t, gh, gw = grid
    if t != 1 or gh % a.merge_size or gw % a.merge_size or patches.shape != (gh * gw, a.prep.patch_dim):
        raise TensorShapeError(f"patch rows {patches.shape} do not fit the grid {grid} (patch_dim {a.prep.patch_dim})")


def forward(a: VisionArgs, ops: VisionOps, patches: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    """Patch rows [t·h·w, patch_dim] of one image -> merged rows [t·h·w/m², out_dim]."""
    check_grid(a, patches, grid)
    _, gh, gw = grid
    m, c, nh, hd = a.merge_size, a.n_embd, a.n_head, a.head_dim
    x = ops.linear(patches, "v.patch_embd")
    x = x + position_embedding(ops.vector("v.position_embd.weight"), a.pos_side, gh, gw, m)
    cos, sin = rope_tables(gh, gw, m, hd)
    n = x.shape[0]
    for i in range(a.n_layer):
        b = f"v.blk.{i}."
        qkv = ops.linear(ops.layer_norm(x, b + "ln1", a.eps), b + "attn_qkv").reshape(n, 3, nh, hd)
        o = ops.rotary_attention(qkv, cos, sin, hd ** -0.5)
        x = ops.linear_add(o.reshape(n, c), b + "attn_out", x)
        y = ops.linear_gelu(ops.layer_norm(x, b + "ln2", a.eps), b + "ffn_up", "tanh")
        x = ops.linear_add(y, b + "ffn_down", x)
    y = ops.layer_norm(x, "v.post_ln", a.eps).reshape(n // (m * m), a.merged_dim)
    return ops.linear(ops.linear_gelu(y, "mm.0", "erf"), "mm.2")

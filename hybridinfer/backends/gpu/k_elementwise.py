"""Launchers of native/cuda_sm20/elementwise.cu: RMSNorm, NEOX RoPE, embedding gather, residual add,
scale, SwiGLU, sigmoid gating and row dot products, and the vision tower's LayerNorm, product epilogues (bias, the
two GELUs, residual) and rotary split. Every buffer is a float32 (int32 for ids and positions) C-contiguous
pycuda GPUArray; shapes are in each docstring. Ops marked "in place" overwrite their first argument.
"""

from __future__ import annotations

import numpy as np

from ...errors import KernelArgumentError
from ...format.quant_types import TYPES
from . import loader
from .k_gemm import _ALIGN, DeviceWeight, _aligned, _check_weight

FAMILY = "elementwise"
THREADS = 256
EMBED_TYPES = {q: t.kernel_name for q, t in TYPES.items() if t.gpu_embed}  # format/quant_types.py
ROPE_MAX_HALF = 256


def _empty(shape):
    from pycuda import gpuarray

    return gpuarray.empty(shape, np.float32)


def _flat_grid(n: int) -> tuple:
    if n >= 2**31:
        raise KernelArgumentError(f"{n} elements exceed int32")
    return (max(1, min(loader.grid_for(n, THREADS), loader.MAX_GRID)),)


def _dims2(a, what: str) -> tuple[int, int]:
    if len(a.shape) != 2:
        raise KernelArgumentError(f"{what}: shape {a.shape}, expected 2 dimensions")
    return int(a.shape[0]), int(a.shape[1])


def _row_threads(d: int) -> int:
    t = 32
    while t < THREADS and 2 * t < d:
        t *= 2
    return t


def rms_norm(x, w, eps: float, out=None, stream=None):
    """out[r, :D] = x[r, :D] / sqrt(mean(x[r, :D]^2) + eps) * w, D = len(w).

    x: (R, Sx) with Sx >= D (a q/k head norm: R = T*H rows of pitch hd, or 2*hd for Qwen3.5's interleaved
    [query, gate] heads); w: (D,); out: (R, So) with So >= D, default a new (R, D); out may be x (in place).
    Columns >= D of out are left as they are. Returns out.
    """
    R, Sx = _dims2(x, "rms_norm x")
    D = int(w.shape[0]) if len(w.shape) == 1 else -1
    xp = loader.arg(x, np.float32, (R, Sx), "rms_norm x")
    wp = loader.arg(w, np.float32, (D,), "rms_norm w")
    if D > Sx or D < 1:
        raise KernelArgumentError(f"rms_norm: weight length {D} exceeds the row pitch {Sx} of x")
    out = _empty((R, D)) if out is None else out
    _, So = _dims2(out, "rms_norm out")
    yp = loader.arg(out, np.float32, (R, So), "rms_norm out")
    if So < D:
        raise KernelArgumentError(f"rms_norm: out rows of {So} are shorter than {D}")
    if R:
        loader.launch(FAMILY, "rms_norm_f32", (min(R, loader.MAX_GRID),), (_row_threads(D),),
                      [xp, wp, yp, np.int32(R), np.int32(D), np.int32(Sx), np.int32(So), np.float32(eps)],
                      stream=stream)
    return out


def rope_neox(x, pos, n_rot: int, theta: float, stream=None, neox: bool = True, sections=None):
    """In place: rotate dims (i, i + n_rot/2), i < n_rot/2, of every head by pos[t] * theta^(-2i/n_rot)
    (neox=False: dims (2i, 2i+1), llama.cpp's NORM mode).

    x: (T, H, S) float32 with n_rot <= S (dims >= n_rot untouched); pos: (T,) int32 absolute positions, or with
    `sections` (the model's rope.dimension_sections, 4 ints) (T, 4) multimodal positions, pair i at the one its
    IMROPE stream names (models/mrope.imrope_streams); n_rot even, at most 512. Returns x.
    """
    if len(x.shape) != 3:
        raise KernelArgumentError(f"rope_neox x: shape {x.shape}, expected (T, H, S)")
    T, H, S = (int(s) for s in x.shape)
    xp = loader.arg(x, np.float32, (T, H, S), "rope_neox x")
    secs = [int(v) for v in (tuple(sections or ()) + (0, 0, 0, 0))[:4]]
    if sections is not None and sum(secs) <= 0:
        raise KernelArgumentError(f"rope_neox: sections {tuple(sections)} name no stream")
    pp = loader.arg(pos, np.int32, (T, 4) if sections is not None else (T,), "rope_neox pos")
    if n_rot % 2 or not 0 < n_rot <= min(S, 2 * ROPE_MAX_HALF):
        raise KernelArgumentError(f"rope_neox: n_rot {n_rot} must be even and in 2..min({S}, 512)")
    if T:
        loader.launch(FAMILY, "rope_neox_f32", (min(T, loader.MAX_GRID),), (_row_threads(H * n_rot // 2),),
                      [xp, pp, np.int32(T), np.int32(H), np.int32(S), np.int32(n_rot), np.float64(theta),
                       np.int32(bool(neox)), *(np.int32(v) for v in (secs if sections is not None else (0,) * 4))],
                      stream=stream)
    return x


def embed(table: DeviceWeight, ids, out=None, stream=None):
    """out[t, :] = dequantized table row ids[t].

    table: DeviceWeight (V, D) of type F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K (D % 32 == 0);
    ids: (T,) int32 in 0..V-1 (not checked: they stay on the card); out: (T, D) float32. Returns out.
    """
    name = _check_weight(table, 2, EMBED_TYPES)
    _, D = table.shape
    T = int(ids.shape[0]) if len(ids.shape) == 1 else -1
    ip = loader.arg(ids, np.int32, (T,), "embed ids")
    out = _empty((T, D)) if out is None else out
    op = _aligned(loader.arg(out, np.float32, (T, D), "embed out"), 16, "embed out")
    tp = _aligned(table.data.gpudata, _ALIGN.get(table.qtype, 2), "embed table")
    if T:
        loader.launch(FAMILY, f"embed_{name}", (min(T, loader.MAX_GRID),), (_row_threads(D // 16),),
                      [tp, ip, op, np.int32(T), np.int32(D), np.int32(table.row_nbytes)], stream=stream)
    return out


def add(y, x, a: float = 1.0, stream=None):
    """In place: y += a * x (a = 1: the residual add, exact). y, x: float32 of the same shape. Returns y."""
    yp = loader.arg(y, np.float32, tuple(y.shape), "add y")
    xp = loader.arg(x, np.float32, tuple(y.shape), "add x")
    n = int(y.size)
    if n:
        loader.launch(FAMILY, "add_f32", _flat_grid(n), (THREADS,), [yp, xp, np.float32(a), np.int32(n)],
                      stream=stream)
    return y


def scale(x, s: float, stream=None):
    """In place: x *= s. x: float32, any shape. Returns x."""
    xp = loader.arg(x, np.float32, tuple(x.shape), "scale x")
    n = int(x.size)
    if n:
        loader.launch(FAMILY, "scale_f32", _flat_grid(n), (THREADS,), [xp, np.float32(s), np.int32(n)],
                      stream=stream)
    return x


def swiglu(g, u, out=None, width: int | None = None, g_off: int = 0, u_off: int = 0, stream=None):
    """out[r, j] = silu(g[r, g_off + j]) * u[r, u_off + j], j < F.

    g: (R, Sg), u: (R, Su) float32 (may be the same buffer, e.g. a fused [gate | up] projection with
    u_off = F); out: (R, F), F = out.shape[1], else `width`, else Sg - g_off. Returns out.
    """
    R, Sg = _dims2(g, "swiglu g")
    _, Su = _dims2(u, "swiglu u")
    gp = loader.arg(g, np.float32, (R, Sg), "swiglu g")
    up = loader.arg(u, np.float32, (R, Su), "swiglu u")
    F = int(out.shape[-1]) if out is not None else int(width or Sg - g_off)
    out = _empty((R, F)) if out is None else out
    op = loader.arg(out, np.float32, (R, F), "swiglu out")
    if g_off < 0 or u_off < 0 or g_off + F > Sg or u_off + F > Su:
        raise KernelArgumentError(f"swiglu: columns [{g_off}, +{F}) of g ({Sg}) or [{u_off}, +{F}) of u ({Su})")
    if R * F:
        loader.launch(FAMILY, "swiglu_f32", _flat_grid(R * F), (THREADS,),
                      [gp, up, op, np.int32(R), np.int32(F), np.int32(Sg), np.int32(g_off), np.int32(Su),
                       np.int32(u_off)], stream=stream)
    return out


def sigmoid_mul(out, g, g_off: int = 0, per_row: bool = False, stream=None):
    """In place: out[r, j] *= sigmoid(g[r, g_off + j]), or sigmoid(g[r, g_off]) for every j when per_row.

    out: (R, D) float32; g: (R, Sg) float32 (attention gate: R = T*H, D = hd, Sg = 2*hd, g_off = hd for
    Qwen3.5's interleaved q projection; shared-expert gate: g (T, 1), per_row). Returns out.
    """
    R, D = _dims2(out, "sigmoid_mul out")
    _, Sg = _dims2(g, "sigmoid_mul g")
    op = loader.arg(out, np.float32, (R, D), "sigmoid_mul out")
    gp = loader.arg(g, np.float32, (R, Sg), "sigmoid_mul g")
    if g_off < 0 or g_off + (1 if per_row else D) > Sg:
        raise KernelArgumentError(f"sigmoid_mul: gate columns from {g_off} exceed g's {Sg}")
    if R * D:
        loader.launch(FAMILY, "sigmoid_mul_f32", _flat_grid(R * D), (THREADS,),
                      [op, gp, np.int32(R), np.int32(D), np.int32(Sg), np.int32(g_off), np.int32(0 if per_row else 1)],
                      stream=stream)
    return out


def dot_rows(x, w, out=None, stream=None):
    """out[r] = x[r, :] . w: a one-row matrix times every token (the shared-expert gate logit), where a GEMM
    would fill one of its 128 tile rows. x: (R, D); w: (D,); out: (R,) or (R, 1), default new (R,).
    Returns out."""
    R, D = _dims2(x, "dot_rows x")
    xp = loader.arg(x, np.float32, (R, D), "dot_rows x")
    wp = loader.arg(w, np.float32, (D,), "dot_rows w")
    out = _empty((R,)) if out is None else out
    if tuple(out.shape) not in ((R,), (R, 1)):
        raise KernelArgumentError(f"dot_rows out: shape {tuple(out.shape)}, expected ({R},) or ({R}, 1)")
    op = loader.arg(out, np.float32, tuple(out.shape), "dot_rows out")
    if R:
        loader.launch(FAMILY, "dot_rows_f32", (min(R, loader.MAX_GRID),), (_row_threads(D),),
                      [xp, wp, op, np.int32(R), np.int32(D)], stream=stream)
    return out


# the vision tower's row ops (gpu/vision.py) ---------------------------------------------------------------------
ACTS = {"store": 0, "gelu_tanh": 1, "gelu_erf": 2, "add": 3}  # bias_act_f32's modes (VIT_* in elementwise.cu)


def layer_norm(x, w, b, eps: float, out, stream=None):
    """out[r, :D] = (x[r, :D] - mean) / sqrt(var + eps) * w + b (the row's mean and variance in double, as the
    vision reference's), out[r, D:] = 0, D = len(w). x: (R, Sx), Sx >= D; w, b: (D,); out: (R, So), So >= D,
    not x. Returns out."""
    R, Sx = _dims2(x, "layer_norm x")
    _, So = _dims2(out, "layer_norm out")
    D = int(w.shape[0]) if len(w.shape) == 1 else -1
    args = [loader.arg(x, np.float32, (R, Sx), "layer_norm x"), loader.arg(w, np.float32, (D,), "layer_norm w"),
            loader.arg(b, np.float32, (D,), "layer_norm b"), loader.arg(out, np.float32, (R, So), "layer_norm out"),
            np.int32(Sx), np.int32(So)]
    if not 0 < D <= min(Sx, So):
        raise KernelArgumentError(f"layer_norm: weight length {D} exceeds the rows of x ({Sx}) or out ({So})")
    if R:
        loader.launch(FAMILY, "layer_norm_f32", (min(R, loader.MAX_GRID),), (_row_threads(D),),
                      args + [np.int32(R), np.int32(D), np.float64(eps)], stream=stream)
    return out


def bias_act(x, out, b=None, act: str = "store", n: int | None = None, stream=None):
    """A product's epilogue: v = x[r, j] + b[j] (no b: x[r, j]) for j < N (len(b), else n, else x's width), then
    out[r, j] = v ("store"), gelu_tanh(v), gelu_erf(v) (the vision reference's two GELUs) or out[r, j] + v ("add",
    the residual); out[r, N:] = 0 but under "add" (left). x: (R, Sx), out: (R, So), Sx and So >= N; x may be out
    (same width). Returns out."""
    R, Sx = _dims2(x, "bias_act x")
    _, So = _dims2(out, "bias_act out")
    if act not in ACTS:
        raise KernelArgumentError(f"bias_act: act {act!r} is not one of {', '.join(ACTS)}")
    N = int(b.shape[0]) if b is not None else int(n if n is not None else Sx)
    bp = loader.arg(b, np.float32, (N,), "bias_act b") if b is not None else np.uintp(0)
    args = [loader.arg(x, np.float32, (R, Sx), "bias_act x"), bp, loader.arg(out, np.float32, (R, So), "bias_act out"),
            np.int32(Sx), np.int32(So)]
    if not 0 < N <= min(Sx, So) or R * So >= 2**31:
        raise KernelArgumentError(f"bias_act: {N} columns of rows {Sx} -> {So} ({R} rows)")
    if R:
        loader.launch(FAMILY, "bias_act_f32", _flat_grid(R * So), (THREADS,),
                      args + [np.int32(R), np.int32(N), np.int32(ACTS[act])], stream=stream)
    return out


def rope_split(y, b, cos, sin, out, stream=None):
    """The vision attention's operands: out[s, t] = the qkv product's rows y[t, s] + b[s] (y: (T, 3, H, hd) as
    (T, 3 H hd), b: (3 H hd,)), q and k (s = 0, 1) rotated by x cos + rotate_half(x) sin with cos, sin: (T, hd);
    out: (3, T, H, hd). Returns out."""
    if len(out.shape) != 4 or out.shape[0] != 3:
        raise KernelArgumentError(f"rope_split out: shape {out.shape}, expected (3, T, H, hd)")
    _, T, H, hd = (int(s) for s in out.shape)
    if hd % 2 or T * 3 * H * hd >= 2**31:
        raise KernelArgumentError(f"rope_split: {T} rows of {H} heads of {hd} (even, under 2^31 values)")
    args = [loader.arg(y, np.float32, (T, 3 * H * hd), "rope_split y"),
            loader.arg(b, np.float32, (3 * H * hd,), "rope_split b"),
            loader.arg(cos, np.float32, (T, hd), "rope_split cos"),
            loader.arg(sin, np.float32, (T, hd), "rope_split sin"),
            loader.arg(out, np.float32, (3, T, H, hd), "rope_split out")]
    if T:
        loader.launch(FAMILY, "vit_rope_split_f32", _flat_grid(T * 3 * H * hd), (THREADS,),
                      args + [np.int32(T), np.int32(H), np.int32(hd)], stream=stream)
    return out

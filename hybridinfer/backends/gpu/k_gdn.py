"""Launchers for native/cuda_sm20/gdn.cu: the Gated DeltaNet layer over a prompt chunk, from the
projections (u, z, b, a: GEMMs done elsewhere) to the gated-normed output y (ssm_out is a GEMM too).

All buffers are pycuda GPUArrays, C-contiguous, float32 unless said otherwise; shapes are checked by
loader.arg() before each launch. Names: T tokens, C = 2*H_k*d_k + H_v*d_v conv channels, K conv taps.
The state buffers have DecoderState's layout: conv (K-1, C), S (H_v, d_k, d_v), GGUF head order.
Snapshot positions count tokens of this chunk: p = 0 is the incoming state, p = T the outgoing one.
"""

from __future__ import annotations

import numpy as np

from ...errors import KernelArgumentError
from . import kclass, loader

FAMILY = "gdn"
MAXK = 8  # GDN_MAXK
TC = 16  # GDN_TC
# GDN_MAXR and GDN_MAX_THREADS (its __launch_bounds__) depend on the kernel class: kclass.GDN_MAXR / GDN_MAX_THREADS
CONV_THREADS = 128
CONV_TCHUNK = 64
NORM_THREADS = 128
_NULL = np.intp(0)


def _ptr(a, dtype, shape: tuple, what: str):
    """loader.arg(), except that an empty array (pycuda gives it no pointer) passes as NULL after the
    same dtype and shape checks."""
    if int(np.prod(a.shape)) == 0:
        if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
            raise KernelArgumentError(f"{what}: {a.dtype} {a.shape}, expected {np.dtype(dtype)} {shape}")
        return _NULL
    return loader.arg(a, dtype, shape, what)


def _snap(snap_pos, snap, shape_tail: tuple, what: str):
    """(pointer to positions, count, pointer to snapshot buffer) for optional snapshot arguments."""
    if snap_pos is None and snap is None:
        return _NULL, np.int32(0), _NULL
    if snap_pos is None or snap is None:
        raise KernelArgumentError(f"{what}: snap_pos and the snapshot buffer go together")
    n = snap_pos.shape[0] if len(snap_pos.shape) == 1 else -1
    pp = _ptr(snap_pos, np.int32, (n,), "snap_pos")
    sp = _ptr(snap, np.float32, (n, *shape_tail), what)
    return (pp, np.int32(n), sp) if n > 0 else (_NULL, np.int32(0), _NULL)


def conv_silu(u, conv_state, conv_w, c, stream=None) -> None:
    """c = SiLU(causal depthwise conv of [conv_state; u] with conv_w); conv_state is only read.

    u (T, C); conv_state (K-1, C); conv_w (C, K) (ssm_conv1d, w[:, K-1] multiplies the current token);
    c (T, C) output.
    """
    T, C = u.shape
    K = conv_w.shape[1] if len(conv_w.shape) == 2 else 0
    if not 1 <= K <= MAXK:
        raise KernelArgumentError(f"gdn conv: kernel width {K} outside 1..{MAXK}")
    args = [
        loader.arg(u, np.float32, (T, C), "u"),
        _ptr(conv_state, np.float32, (K - 1, C), "conv_state"),  # K = 1: no rows, NULL
        loader.arg(conv_w, np.float32, (C, K), "conv_w"),
        loader.arg(c, np.float32, (T, C), "c"),
        np.int32(T), np.int32(C), np.int32(K), np.int32(CONV_TCHUNK),
    ]
    grid = (loader.grid_for(C, CONV_THREADS), loader.grid_for(T, CONV_TCHUNK))
    loader.launch(FAMILY, "gdn_conv_silu", grid, (CONV_THREADS,), args, stream=stream)


def conv_state_update(u, conv_state, snap_pos=None, snap_conv=None, stream=None) -> None:
    """conv_state <- the last K-1 rows of [conv_state; u]; snap_conv[s] <- the conv state after
    snap_pos[s] tokens. Run after conv_silu (it overwrites what conv_silu reads).

    u (T, C); conv_state (K-1, C) read and written; snap_pos (n_snap,) int32 ascending in [0, T];
    snap_conv (n_snap, K-1, C).
    """
    T, C = u.shape
    km1 = conv_state.shape[0]
    if km1 + 1 > MAXK:
        raise KernelArgumentError(f"gdn conv: kernel width {km1 + 1} above {MAXK}")
    pp, n, sp = _snap(snap_pos, snap_conv, (km1, C), "snap_conv")
    if km1 == 0:
        return  # K = 1: the conv keeps no state
    args = [loader.arg(u, np.float32, (T, C), "u"), _ptr(conv_state, np.float32, (km1, C), "conv_state"),
            pp, n, sp, np.int32(T), np.int32(C), np.int32(km1 + 1)]
    loader.launch(FAMILY, "gdn_conv_state", (loader.grid_for(C, CONV_THREADS),), (CONV_THREADS,), args,
                  stream=stream)


def l2norm_qk(c, n_k_heads: int, d_k: int, eps: float, stream=None) -> None:
    """In place on c (T, C): each of the 2*n_k_heads q and k heads (the first 2*H_k*d_k channels)
    x <- x / sqrt(sum x^2 + eps); q heads also times 1/sqrt(d_k)."""
    T, C = c.shape
    if 2 * n_k_heads * d_k > C:
        raise KernelArgumentError(f"gdn l2norm: 2*{n_k_heads}*{d_k} channels exceed C={C}")
    args = [loader.arg(c, np.float32, (T, C), "c"), np.int32(T), np.int32(C), np.int32(n_k_heads),
            np.int32(d_k), np.float32(eps), np.float32(1.0 / np.sqrt(d_k))]
    loader.launch(FAMILY, "gdn_l2norm_qk", (2 * n_k_heads, min(T, loader.MAX_GRID)), (NORM_THREADS,), args,
                  stream=stream)


def delta_rule_shape(d_k: int, d_v: int, cls: str = kclass.R255) -> tuple[int, int]:
    """(VB, NG): value columns per block and row groups (block = VB x NG threads) for kernel class `cls`: enough
    row groups that each thread holds at most the class's GDN_MAXR rows of S, and as many columns (32 at most, a
    power of two) as its block size bound leaves."""
    maxr, max_threads = kclass.GDN_MAXR[cls], kclass.GDN_MAX_THREADS[cls]
    ng = max(8, -(-d_k // maxr))
    vb = 32 if d_v >= 32 else max(1, 1 << (d_v - 1).bit_length())
    while vb > 1 and vb * ng > max_threads:
        vb //= 2
    if vb * ng > max_threads or delta_rule_smem(vb, ng, cls) > loader.MAX_SHARED:
        raise KernelArgumentError(f"gdn delta rule: d_k={d_k} needs {ng} row groups (at most {max_threads} threads "
                                  f"and {loader.MAX_SHARED} bytes of shared memory a block)")
    return vb, ng


def delta_rule_smem(vb: int, ng: int, cls: str) -> int:
    """Bytes of dynamic shared memory of a (vb, ng) block (gdn.cu's gdn_smem): q and k rows padded to ng GDN_MAXR, v
    (then the outputs), decay and beta of TC tokens, and the two partial-sum tiles at pitch ng + 1."""
    dkp = ng * kclass.GDN_MAXR[cls]
    return (2 * TC * dkp + TC * vb + 2 * TC + 2 * (ng + 1) * vb) * 4


def delta_rule(c, a, b, ssm_a, dt_bias, S, o, n_k_heads: int, d_k: int, head_map: str = "mod",
               snap_pos=None, snap_S=None, stream=None) -> None:
    """The gated delta rule over the chunk, S carried in and written back.

    c (T, C): [q | k | v] after conv+SiLU, q and k normalised by l2norm_qk;
    a, b (T, H_v): the ssm_alpha and ssm_beta projections; ssm_a (H_v,) (= -exp(A_log));
    dt_bias (H_v,) (ssm_dt.bias); S (H_v, d_k, d_v) read and written; o (T, H_v, d_v) output;
    head_map "mod" (qwen35 GGUF: value head j reads key head j % H_k) or "div" (j // (H_v/H_k));
    snap_pos (n_snap,) int32 ascending in [0, T]; snap_S (n_snap, H_v, d_k, d_v).
    """
    T, C = c.shape
    H_v, dk, d_v = S.shape
    if dk != d_k or C != 2 * n_k_heads * d_k + H_v * d_v or H_v % n_k_heads:
        raise KernelArgumentError(f"gdn delta rule: C={C}, S {S.shape}, H_k={n_k_heads}, d_k={d_k} disagree")
    if head_map not in ("mod", "div"):
        raise KernelArgumentError(f"gdn delta rule: head_map {head_map!r} is not 'mod' or 'div'")
    cls = loader.kernel_class()
    vb, ng = delta_rule_shape(d_k, d_v, cls)
    pp, n, sp = _snap(snap_pos, snap_S, (H_v, d_k, d_v), "snap_S")
    args = [
        loader.arg(c, np.float32, (T, C), "c"),
        loader.arg(a, np.float32, (T, H_v), "a"),
        loader.arg(b, np.float32, (T, H_v), "b"),
        loader.arg(ssm_a, np.float32, (H_v,), "ssm_a"),
        loader.arg(dt_bias, np.float32, (H_v,), "dt_bias"),
        loader.arg(S, np.float32, (H_v, d_k, d_v), "S"),
        loader.arg(o, np.float32, (T, H_v, d_v), "o"),
        pp, n, sp,
        np.int32(T), np.int32(C), np.int32(n_k_heads), np.int32(H_v), np.int32(d_k), np.int32(d_v),
        np.int32(head_map == "mod"),
    ]
    shared = delta_rule_smem(vb, ng, cls)
    loader.launch(FAMILY, "gdn_delta_rule", (loader.grid_for(d_v, vb), H_v), (vb, ng), args, shared=shared,
                  stream=stream)


def gated_norm(o, z, w, y, eps: float, stream=None) -> None:
    """y = o / sqrt(mean(o^2) + eps) * w * SiLU(z) per (token, value head).

    o, y (T, H_v, d_v) (y may be o); z (T, H_v*d_v) (attn_gate projection); w (d_v,) (ssm_norm)."""
    T, H_v, d_v = o.shape
    args = [loader.arg(o, np.float32, (T, H_v, d_v), "o"), loader.arg(z, np.float32, (T, H_v * d_v), "z"),
            loader.arg(w, np.float32, (d_v,), "w"), loader.arg(y, np.float32, (T, H_v, d_v), "y"),
            np.int32(T), np.int32(H_v), np.int32(d_v), np.float32(eps)]
    loader.launch(FAMILY, "gdn_gated_norm", (H_v, min(T, loader.MAX_GRID)), (NORM_THREADS,), args, stream=stream)


def gdn_prefill(u, z, a, b, conv_w, ssm_a, dt_bias, norm_w, conv_state, S, y, n_k_heads: int, d_k: int,
                eps: float, head_map: str = "mod", snap_pos=None, snap_conv=None, snap_S=None, c=None,
                stream=None) -> None:
    """The whole GDN mixer between the projections and ssm_out, advancing (conv_state, S) by T tokens.

    u (T, C) attn_qkv projection; z (T, H_v*d_v); a, b (T, H_v); conv_w (C, K); ssm_a, dt_bias (H_v,);
    norm_w (d_v,); conv_state (K-1, C) and S (H_v, d_k, d_v) read and written; y (T, H_v, d_v) output;
    snap_pos (n_snap,) int32 ascending in [0, T] with snap_conv (n_snap, K-1, C) and snap_S
    (n_snap, H_v, d_k, d_v); c (T, C) scratch (allocated when None).
    """
    if c is None:
        from pycuda import gpuarray

        c = gpuarray.empty(u.shape, np.float32)
    conv_silu(u, conv_state, conv_w, c, stream)
    conv_state_update(u, conv_state, snap_pos, snap_conv, stream)
    l2norm_qk(c, n_k_heads, d_k, eps, stream)
    delta_rule(c, a, b, ssm_a, dt_bias, S, y, n_k_heads, d_k, head_map, snap_pos, snap_S, stream)
    gated_norm(y, z, norm_w, y, eps, stream)

"""Launchers for native/cuda_sm20/attention.cu: causal GQA prefill attention and the K/V cache append.

All buffers are pycuda GPUArrays, float32, C-contiguous; shapes are checked by loader.arg() before a
launch. Kernels run asynchronously on `stream` (None: the default stream).
"""

from __future__ import annotations

import numpy as np

from ...errors import KernelArgumentError
from . import loader

FAMILY = "attention"
BQ = 16  # ATT_BQ: query rows per block
THREADS = 256
MAX_HD = 256
SMEM_LIMIT = 48 * 1024
_NULL = np.intp(0)


def _smem_floats(hd: int, bk: int) -> int:
    return BQ * (hd + 1) + bk * (hd + 1) + BQ * bk + 3 * BQ


def key_tile(hd: int) -> int:
    """Keys per tile: 32 where the tiles fit in 48 KiB of shared memory, else 16."""
    return 32 if _smem_floats(hd, 32) * 4 <= SMEM_LIMIT else 16


def attention_prefill(q, k_cache, v_cache, out, pos0: int, gate=None, stream=None) -> None:
    """out = causal softmax attention of the T queries at positions pos0..pos0+T-1 over cache rows
    0..pos0+T-1, scale 1/sqrt(hd), times sigmoid(gate) when gate is given.

    q       (T, H, hd) float32, already q-normed and roped
    k_cache (n_ctx, H_kv, hd) float32, rows [0, pos0+T) valid (K after k_norm and RoPE)
    v_cache (n_ctx, H_kv, hd) float32
    gate    (T, H*hd) float32 or None
    out     (T, H, hd) float32 (must not alias q)
    Query head h reads KV head h // (H // H_kv). hd <= 256.
    """
    if len(q.shape) != 3 or len(k_cache.shape) != 3:
        raise KernelArgumentError(f"attention: q {q.shape} and k_cache {k_cache.shape} must be 3-D")
    T, H, hd = q.shape
    n_ctx, H_kv = k_cache.shape[0], k_cache.shape[1]
    if hd > MAX_HD or H_kv < 1 or H % H_kv:
        raise KernelArgumentError(f"attention: hd={hd} (max {MAX_HD}), H={H} not a multiple of H_kv={H_kv}")
    if pos0 < 0 or pos0 + T > n_ctx:
        raise KernelArgumentError(f"attention: rows [{pos0}, {pos0 + T}) outside the cache of {n_ctx}")
    args = [
        loader.arg(q, np.float32, (T, H, hd), "q"),
        loader.arg(k_cache, np.float32, (n_ctx, H_kv, hd), "k_cache"),
        loader.arg(v_cache, np.float32, (n_ctx, H_kv, hd), "v_cache"),
        _NULL if gate is None else loader.arg(gate, np.float32, (T, H * hd), "gate"),
        loader.arg(out, np.float32, (T, H, hd), "out"),
    ]
    bk = key_tile(hd)
    args += [np.int32(T), np.int32(H), np.int32(H_kv), np.int32(hd), np.int32(pos0), np.int32(bk),
             np.float32(1.0 / np.sqrt(hd))]
    loader.launch(FAMILY, "attn_prefill", (loader.grid_for(T, BQ), H), (THREADS,), args,
                  shared=_smem_floats(hd, bk) * 4, stream=stream)


def gate_mul(out, gate, stream=None) -> None:
    """out *= sigmoid(gate), elementwise. out (T, H, hd) or any shape; gate the same size (T, H*hd)."""
    n = int(np.prod(out.shape))
    if int(np.prod(gate.shape)) != n:
        raise KernelArgumentError(f"gate_mul: out {out.shape} and gate {gate.shape} differ in size")
    args = [loader.arg(out, np.float32, tuple(out.shape), "out"),
            loader.arg(gate, np.float32, tuple(gate.shape), "gate"), np.int32(n)]
    loader.launch(FAMILY, "attn_gate_mul", (min(loader.grid_for(n, THREADS), 4096),), (THREADS,), args,
                  stream=stream)


def kv_append(k_new, v_new, k_cache, v_cache, pos0: int, stream=None) -> None:
    """k_cache[pos0:pos0+T] = k_new; v_cache[pos0:pos0+T] = v_new.

    k_new, v_new (T, H_kv, hd) float32; k_cache, v_cache (n_ctx, H_kv, hd) float32.
    """
    if len(k_new.shape) != 3 or len(k_cache.shape) != 3:
        raise KernelArgumentError(f"kv_append: k_new {k_new.shape} and k_cache {k_cache.shape} must be 3-D")
    T, H_kv, hd = k_new.shape
    n_ctx = k_cache.shape[0]
    if pos0 < 0 or pos0 + T > n_ctx:
        raise KernelArgumentError(f"kv_append: rows [{pos0}, {pos0 + T}) outside the cache of {n_ctx}")
    n = T * H_kv * hd
    args = [
        loader.arg(k_new, np.float32, (T, H_kv, hd), "k_new"),
        loader.arg(v_new, np.float32, (T, H_kv, hd), "v_new"),
        loader.arg(k_cache, np.float32, (n_ctx, H_kv, hd), "k_cache"),
        loader.arg(v_cache, np.float32, (n_ctx, H_kv, hd), "v_cache"),
        np.int32(n), np.int32(H_kv * hd), np.int32(pos0),
    ]
    loader.launch(FAMILY, "kv_append", (min(loader.grid_for(n, THREADS), 4096),), (THREADS,), args, stream=stream)

"""Launchers for native/cuda_sm20/attention.cu: causal GQA prefill attention, the K/V cache append, and for caches
of other types (-ctk / -ctv) the typed store, the queries' rounding and the Walsh-Hadamard rotation.

All buffers are pycuda GPUArrays, C-contiguous (float32, except typed caches: float16 values or uint8 blocks, as
DecoderState keeps them); shapes are checked by loader.arg() before a launch. Kernels run asynchronously on
`stream` (None: the default stream).
"""

from __future__ import annotations

import numpy as np

from ...errors import KernelArgumentError
from ...format.quant_types import CACHE_ONLY, F32, cache_row
from . import loader

FAMILY = "attention"
BQ = 16  # ATT_BQ: query rows per block
THREADS = 256
MAX_HD = 256
SMEM_LIMIT = 48 * 1024
_NULL = np.intp(0)


def _smem_floats(hd: int, bk: int) -> int:
    return BQ * (hd + 1) + bk * (hd + 1) + BQ * bk + 3 * BQ


def _tiled_smem_floats(hd: int, bk: int) -> int:
    return BQ * (hd + 4) + bk * (hd + 4) + BQ * (bk + 1) + bk * BQ + 2 * BQ


TILED_HD = (64, 128, 256)  # heads with a register-tiled kernel (attention_tiled.cuh), one kernel each
SPLIT_ROWS = 4096  # segments x query rows x heads the partials of a call split over the context may hold
SPLIT_MIN_KEYS = 1024  # keys a segment takes at least


def split_count(T: int, H: int, span: int, sms: int) -> int:
    """Segments of the context an attention call is split into (1: none), a pure rule of its shape and the card's
    multiprocessors: only where its query tiles x heads would leave most of them idle over a long context (a short
    prompt after a long history), enough to give each about two blocks, each segment at least SPLIT_MIN_KEYS keys,
    the partials within SPLIT_ROWS rows."""
    blocks = -(-T // BQ) * H
    if sms <= 0 or blocks >= 2 * sms or span < 2 * SPLIT_MIN_KEYS:
        return 1
    return max(1, min(-(-2 * sms // blocks), span // SPLIT_MIN_KEYS, SPLIT_ROWS // (T * H)))


def _launch(args: list, T: int, H: int, hd: int, bk: int, typed: bool, stream, part, nseg, gate, out) -> None:
    """The register-tiled kernel (the same sums in the same order, with the key tile it fixes for the head: key_tile's)
    where the head has one, split over the context into nseg segments joined by attn_merge where nseg > 1 (None:
    split_count's, given `part`, a (SPLIT_ROWS, hd + 2) float32 scratch; without it no split); else the plain
    kernel (which takes hd and bk)."""
    if hd not in TILED_HD:
        name, smem = "attn_prefill_kv" if typed else "attn_prefill", _smem_floats(hd, bk) * 4
        loader.launch(FAMILY, name, (loader.grid_for(T, BQ), H), (THREADS,), args, shared=smem, stream=stream)
        return
    if nseg is None:
        nseg = 1 if part is None else split_count(T, H, int(args[9]) + T, loader.limits().sm_count)
    if nseg > 1 and (part is None or part.size < nseg * T * H * (hd + 2) or part.dtype != np.float32):
        raise KernelArgumentError(f"attention: {nseg} segments of {T} rows x {H} heads need a float32 scratch of "
                                  f"{nseg * T * H * (hd + 2)} values, got {None if part is None else part.size}")
    name, smem = f"attn_prefill_tiled{hd}" + ("_kv" if typed else ""), _tiled_smem_floats(hd, bk) * 4
    args = [x for j, x in enumerate(args) if j not in (8, 10)]  # hd and bk are the kernel's constants
    args += [np.int32(nseg), loader.ptr(part) if nseg > 1 else _NULL]
    loader.launch(FAMILY, name, (loader.grid_for(T, BQ), H, nseg), (THREADS,), args, shared=smem, stream=stream)
    if nseg > 1:
        n = T * H * hd
        loader.launch(FAMILY, "attn_merge", (min(loader.grid_for(n, THREADS), 4096),), (THREADS,),
                      [loader.ptr(part), _NULL if gate is None else loader.ptr(gate), loader.ptr(out), np.int32(n),
                       np.int32(hd), np.int32(nseg)], stream=stream)


def key_tile(hd: int) -> int:
    """Keys per tile: 32 where the tiles fit in 48 KiB of shared memory, else 16."""
    return 32 if _smem_floats(hd, 32) * 4 <= SMEM_LIMIT else 16


def _attn_shape(q, k_cache, pos0: int) -> tuple[int, int, int, int, int]:
    """(T, H, hd, n_ctx, H_kv) of an attention call, after the checks every cache type shares."""
    if len(q.shape) != 3 or len(k_cache.shape) != 3:
        raise KernelArgumentError(f"attention: q {q.shape} and k_cache {k_cache.shape} must be 3-D")
    T, H, hd = q.shape
    n_ctx, H_kv = k_cache.shape[0], k_cache.shape[1]
    if hd > MAX_HD or H_kv < 1 or H % H_kv:
        raise KernelArgumentError(f"attention: hd={hd} (max {MAX_HD}), H={H} not a multiple of H_kv={H_kv}")
    if pos0 < 0 or pos0 + T > n_ctx:
        raise KernelArgumentError(f"attention: rows [{pos0}, {pos0 + T}) outside the cache of {n_ctx}")
    return T, H, hd, n_ctx, H_kv


def attention_prefill(q, k_cache, v_cache, out, pos0: int, gate=None, stream=None, part=None,
                      nseg: int | None = None) -> None:
    """out = causal softmax attention of the T queries at positions pos0..pos0+T-1 over cache rows
    0..pos0+T-1, scale 1/sqrt(hd), times sigmoid(gate) when gate is given.

    q       (T, H, hd) float32, already q-normed and roped
    k_cache (n_ctx, H_kv, hd) float32, rows [0, pos0+T) valid (K after k_norm and RoPE)
    v_cache (n_ctx, H_kv, hd) float32
    gate    (T, H*hd) float32 or None
    out     (T, H, hd) float32 (must not alias q)
    Query head h reads KV head h // (H // H_kv). hd <= 256. part, nseg: the split over the context (_launch).
    """
    T, H, hd, n_ctx, H_kv = _attn_shape(q, k_cache, pos0)
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
    _launch(args, T, H, hd, bk, False, stream, part, nseg, gate, out)


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


def _cache_arg(c, t: int, n_ctx: int, H_kv: int, hd: int, what: str):
    """The device pointer of a cache of ggml type t: (n_ctx, H_kv, hd) float32 / float16 values, or (n_ctx, H_kv,
    hd / 32 * block bytes) uint8 for q8_0 / q4_0."""
    try:
        dt, row = cache_row(t, hd)
    except ValueError as e:
        raise KernelArgumentError(f"{what}: {e}") from None
    return loader.arg(c, dt, (n_ctx, H_kv, row), what)


def attention_prefill_kv(q, k_cache, v_cache, out, pos0: int, k_type: int, v_type: int, stream=None, part=None,
                         nseg: int | None = None) -> None:
    """attention_prefill over caches of ggml types k_type, v_type (f32, f16, q8_0, q4_0; _cache_arg's shapes), each
    K / V value taken as its type gives it back (attn_prefill_kv's kv_load); part, nseg as attention_prefill's."""
    T, H, hd, n_ctx, H_kv = _attn_shape(q, k_cache, pos0)
    bk = key_tile(hd)
    args = [loader.arg(q, np.float32, (T, H, hd), "q"), _cache_arg(k_cache, k_type, n_ctx, H_kv, hd, "k_cache"),
            _cache_arg(v_cache, v_type, n_ctx, H_kv, hd, "v_cache"), _NULL,
            loader.arg(out, np.float32, (T, H, hd), "out"), np.int32(T), np.int32(H), np.int32(H_kv),
            np.int32(hd), np.int32(pos0), np.int32(bk), np.float32(1.0 / np.sqrt(hd)), np.int32(k_type),
            np.int32(v_type)]
    _launch(args, T, H, hd, bk, True, stream, part, nseg, None, out)


def kv_store(k_new, v_new, k_cache, v_cache, pos0: int, k_type: int, v_type: int, stream=None) -> None:
    """kv_append into caches of ggml types k_type, v_type: the T new rows (T, H_kv, hd) float32 written at pos0 as
    llama.cpp's set_rows writes them (fp16 rounded to nearest even, quantize_row_q8_0, quantize_row_q4_0_ref)."""
    T, H_kv, hd = k_new.shape
    n_ctx = k_cache.shape[0]
    if pos0 < 0 or pos0 + T > n_ctx:
        raise KernelArgumentError(f"kv_store: rows [{pos0}, {pos0 + T}) outside the cache of {n_ctx}")
    if hd % 32:
        raise KernelArgumentError(f"kv_store: heads of {hd} values are not whole blocks of 32")
    nb = T * H_kv * hd // 32
    args = [loader.arg(k_new, np.float32, (T, H_kv, hd), "k_new"),
            loader.arg(v_new, np.float32, (T, H_kv, hd), "v_new"),
            _cache_arg(k_cache, k_type, n_ctx, H_kv, hd, "k_cache"),
            _cache_arg(v_cache, v_type, n_ctx, H_kv, hd, "v_cache"), np.int32(nb), np.int32(H_kv * hd),
            np.int32(pos0), np.int32(k_type), np.int32(v_type)]
    loader.launch(FAMILY, "kv_store", (min(loader.grid_for(2 * nb, THREADS), 4096),), (THREADS,), args,
                  stream=stream)


def q_round(q, k_type: int, stream=None) -> None:
    """The queries (any shape, a multiple of 32 values) rounded in place through the type llama.cpp's flash attention
    converts them to for K of ggml type k_type: fp16 for f16, q8_0 for q8_0 and q4_0 (nothing for f32)."""
    if int(k_type) == F32 or int(k_type) in CACHE_ONLY:  # Lloyd-Max K is taken back to float: the queries stay
        return
    n = int(np.prod(q.shape))
    if n % 32:
        raise KernelArgumentError(f"q_round: {n} values are not whole blocks of 32")
    args = [loader.arg(q, np.float32, tuple(q.shape), "q"), np.int32(n // 32), np.int32(k_type)]
    loader.launch(FAMILY, "q_round", (min(loader.grid_for(n // 32, THREADS), 4096),), (THREADS,), args,
                  stream=stream)


def fwht(x, n: int, stream=None) -> None:
    """ggml's Walsh-Hadamard rotation of each n consecutive values of x (float32, a multiple of n values; n a power of
    two) in place; n = 0 does nothing."""
    if not n:
        return
    total = int(np.prod(x.shape))
    if n & (n - 1) or total % n:
        raise KernelArgumentError(f"fwht: {total} values are not whole chunks of {n} (a power of two)")
    args = [loader.arg(x, np.float32, tuple(x.shape), "x"), np.int32(total // n), np.int32(n)]
    loader.launch(FAMILY, "kv_fwht", (min(loader.grid_for(total // n, THREADS), 4096),), (THREADS,), args,
                  stream=stream)


def attention_full(q, k, v, out, scale: float, stream=None) -> None:
    """out = softmax(q kᵀ · scale) v per head over every key row, no mask (the vision tower's attention within one
    image): q (T, H, hd), k and v (n, H, hd), out (T, H, hd) float32, out not aliasing q; hd <= 256, n >= 1. The
    plain body (attn_full) for every head size."""
    if len(q.shape) != 3 or len(k.shape) != 3:
        raise KernelArgumentError(f"attention_full: q {q.shape} and k {k.shape} must be 3-D")
    T, H, hd = (int(s) for s in q.shape)
    n = int(k.shape[0])
    if hd > MAX_HD or n < 1:
        raise KernelArgumentError(f"attention_full: hd={hd} (max {MAX_HD}) over {n} keys")
    bk = key_tile(hd)
    args = [loader.arg(q, np.float32, (T, H, hd), "q"), loader.arg(k, np.float32, (n, H, hd), "k"),
            loader.arg(v, np.float32, (n, H, hd), "v"), loader.arg(out, np.float32, (T, H, hd), "out"),
            np.int32(T), np.int32(H), np.int32(hd), np.int32(n), np.int32(bk), np.float32(scale)]
    if T:
        loader.launch(FAMILY, "attn_full", (loader.grid_for(T, BQ), H), (THREADS,), args,
                      shared=_smem_floats(hd, bk) * 4, stream=stream)

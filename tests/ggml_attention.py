"""Test helper: llama.cpp's own CPU flash attention (ggml_flash_attn_ext in libggml from llama-cpp-python, through
ctypes) over K/V rows in a cache type, as the oracle of the CPU backend's typed-cache attention."""

from __future__ import annotations

import ctypes
import os

import numpy as np

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_libs = None


def _load():
    global _libs
    if _libs is None:
        import llama_cpp

        d = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
        base = ctypes.CDLL(os.path.join(d, "libggml-base.so"))
        cpu = ctypes.CDLL(os.path.join(d, "libggml-cpu.so"))
        cpu.ggml_cpu_init()
        vp = ctypes.c_void_p
        base.ggml_init.argtypes, base.ggml_init.restype = [_InitParams], vp
        base.ggml_free.argtypes = [vp]
        base.ggml_new_tensor_4d.argtypes = [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int64]
        base.ggml_new_tensor_4d.restype = vp
        base.ggml_get_data.argtypes, base.ggml_get_data.restype = [vp], vp
        base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [vp], ctypes.c_size_t
        base.ggml_flash_attn_ext.argtypes = [vp, vp, vp, vp, vp, ctypes.c_float, ctypes.c_float, ctypes.c_float]
        base.ggml_flash_attn_ext.restype = vp
        base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [vp], vp
        base.ggml_build_forward_expand.argtypes = [vp, vp]
        cpu.ggml_graph_compute_with_ctx.argtypes, cpu.ggml_graph_compute_with_ctx.restype = [vp, vp, ctypes.c_int], \
            ctypes.c_int
        _libs = base, cpu
    return _libs


def _tensor(base, ctx, t: int, ne: tuple[int, ...], data: np.ndarray):
    p = base.ggml_new_tensor_4d(ctx, t, *ne, *([1] * (4 - len(ne))))
    buf = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if base.ggml_nbytes(p) != buf.nbytes:
        raise ValueError(f"tensor of {base.ggml_nbytes(p)} bytes for {buf.nbytes} bytes of data")
    ctypes.memmove(base.ggml_get_data(p), buf.ctypes.data, buf.nbytes)
    return p


def flash_attention(q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, k_type: str, v_type: str, pos0: int,
                    n_threads: int = 1) -> np.ndarray:
    """ggml_flash_attn_ext of q (T, H, hd) float32 (already roped) over cache rows k_rows, v_rows (n, H_kv, row) in
    the cache types' storage (float32, float16, or each head's blocks as bytes; n = pos0 + T), causal: query t sees
    positions 0 .. pos0 + t. Scale 1/sqrtf(hd). Returns (T, H, hd) float32."""
    base, cpu = _load()
    T, H, hd = q.shape
    n, Hkv = k_rows.shape[:2]
    scale = float(np.float32(1.0) / np.sqrt(np.float32(hd)))
    mask = np.where(np.arange(n)[None, :] <= pos0 + np.arange(T)[:, None], 0.0, -np.inf).astype(np.float16)
    need = 4 * (q.nbytes + k_rows.nbytes + v_rows.nbytes + mask.nbytes + T * H * hd * 4) + (64 << 20)
    ctx = base.ggml_init(_InitParams(need, None, False))
    try:
        tq = _tensor(base, ctx, 0, (hd, T, H), q.transpose(1, 0, 2).astype(np.float32))
        tk = _tensor(base, ctx, GGML_TYPES[k_type], (hd, n, Hkv), k_rows.transpose(1, 0, 2))
        tv = _tensor(base, ctx, GGML_TYPES[v_type], (hd, n, Hkv), v_rows.transpose(1, 0, 2))
        tm = _tensor(base, ctx, 1, (n, T), mask)
        out = base.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, scale, 0.0, 0.0)
        gf = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(gf, out)
        if cpu.ggml_graph_compute_with_ctx(ctx, gf, int(n_threads)) != 0:
            raise RuntimeError("ggml_graph_compute_with_ctx failed")
        res = np.empty(T * H * hd, np.float32)  # [hd, H, T]: token-major, then head
        ctypes.memmove(res.ctypes.data, base.ggml_get_data(out), res.nbytes)
        return res.reshape(T, H, hd)
    finally:
        base.ggml_free(ctx)

"""The numpy maths of the reference forward pass, one function per op, slow and obvious on purpose.

Activations are float32 (T, ...) arrays for T tokens; norms accumulate in float64.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as _Q
from gguf import quants as _gq

# the K/V cache types in gguf.quants' names (an independent implementation of ggml's blocks)
_KV = {"f16": _Q.F16, "q8_0": _Q.Q8_0, "q4_0": _Q.Q4_0}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis."""
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * inv).astype(np.float32) * w


def rms_norm_ggml(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm rounded as ggml does: float32 squares summed in float64, the mean narrowed to float32,
    scale = 1/sqrtf(mean + eps) in float32, then (x * scale) * w in float32. Used where activations are
    quantized next, since one ulp can flip a Q8 rounding."""
    x = x.astype(np.float32)
    mean = (np.sum((x * x).astype(np.float64), axis=-1, keepdims=True) / x.shape[-1]).astype(np.float32)
    scale = (np.float32(1.0) / np.sqrt(mean + np.float32(eps))).astype(np.float32)
    return (x * scale) * w


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """y = x / sqrt(sum(x^2) + eps) over the last axis (docs/gguf-qwen35.md §3 step 4)."""
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True) + eps)).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), linear above 20 as in both torch and ggml."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def rope_freqs(n_rot: int, theta: float, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """w_i = theta^(-2i/n_rot), i < n_rot/2, optionally divided by per-frequency factors."""
    w = theta ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        w = w / freq_factors.astype(np.float64)
    return w


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, theta: float, neox: bool,
         freq_factors: np.ndarray | None = None, streams: np.ndarray | None = None) -> np.ndarray:
    """Rotate the first n_rot dims of x (T, H, hd) by angle pos*w_i; the rest pass through.

    neox: pairs (i, i + n_rot/2) (Qwen); otherwise adjacent pairs (2i, 2i+1) (llama.cpp's NORM mode).
    positions (T,), or (T, 4) multimodal positions with `streams` (n_rot/2,) naming the one pair i takes
    (models/mrope.imrope_streams): pos = positions[:, streams[i]].
    """
    w = rope_freqs(n_rot, theta, freq_factors)[None, :]
    if positions.ndim == 2:
        pos = positions.astype(np.float64)[:, np.asarray(streams)]  # (T, n_rot/2)
        ang = pos * w
    else:
        ang = positions.astype(np.float64)[:, None] * w
    cos = np.cos(ang).astype(np.float32)[:, None, :]  # (T, 1, n_rot/2)
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    out = x.copy()
    half = n_rot // 2
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = b * cos + a * sin
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = b * cos + a * sin
    return out


def hadamard(x: np.ndarray, n: int) -> np.ndarray:
    """x with each consecutive n values of its last axis multiplied by the orthonormal Sylvester-Hadamard matrix of
    order n (n a power of two; its own inverse): every value times 1/sqrt(n) in float32, then the butterflies
    (u, v) -> (u + v, u - v) over spans 1, 2, 4, .. in float32; n = 0 leaves x as it is."""
    if not n:
        return x
    y = (x.astype(np.float32) * (np.float32(1) / np.sqrt(np.float32(n)))).reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        u, v = y[:, :, 0, :].copy(), y[:, :, 1, :].copy()
        y[:, :, 0, :], y[:, :, 1, :] = u + v, u - v
        h *= 2
    return y.reshape(x.shape)


def _lm_levels(t: str) -> np.ndarray:
    from ..format.quant_types import LLOYD_MAX, cache_type

    return np.array(LLOYD_MAX[cache_type(t).id], np.float32)


def lm_encode(x: np.ndarray, t: str) -> np.ndarray:
    """Rows (..., n) float32, n a multiple of 32, as lm3 / lm4 blocks (..., n / 32 * (2 + bits * 4)) uint8: per 32
    values the fp16 scale d (of 0.8, 0.9, 1.0, 1.1, 1.2 times the RMS, squares summed in order and fused, and the
    largest magnitude over the outermost level) whose codes leave the least squared error (summed in float64 in
    order; the first of equals), codes of the nearest Lloyd-Max level to x * (1 / d)."""
    lv = _lm_levels(t)
    bits = 3 if len(lv) == 8 else 4
    b = np.ascontiguousarray(x, np.float32).reshape(-1, 32)
    s = np.zeros(len(b), np.float32)
    for j in range(32):  # fmaf(x, x, s) in order: the square is exact in float64, then one rounding
        s = (b[:, j].astype(np.float64) ** 2 + s).astype(np.float32)
    rms = np.sqrt(s / np.float32(32)).astype(np.float32)
    amax = np.abs(b).max(axis=1)
    mids = (np.float32(0.5) * (lv[:-1] + lv[1:])).astype(np.float32)

    def codes_of(d):
        df = d.astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(df != 0, np.float32(1) / df, np.float32(0)).astype(np.float32)
        return df, ((b * inv[:, None])[:, :, None] > mids[None, None, :]).sum(-1)

    best, d = np.full(len(b), np.inf), np.zeros(len(b), np.float16)
    for k in range(6):
        cand = (rms * np.float32((0.8, 0.9, 1.0, 1.1, 1.2)[k]) if k < 5 else amax / lv[-1]).astype(np.float16)
        df, codes = codes_of(cand)
        e = b - df[:, None] * lv[codes]
        err = np.zeros(len(b))
        for j in range(32):
            err = err + e[:, j].astype(np.float64) ** 2
        take = err < best
        best, d = np.where(take, err, best), np.where(take, cand, d)
    codes = codes_of(d)[1].astype(np.uint32)
    if bits == 3:
        w = (codes.reshape(-1, 4, 8) << (3 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
        q = np.stack([w & 255, (w >> 8) & 255, (w >> 16) & 255], -1).reshape(-1, 12).astype(np.uint8)
    else:
        q = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    out = np.concatenate([d.astype(np.float16).reshape(-1, 1).view(np.uint8), q], axis=1)
    return out.reshape(*x.shape[:-1], -1)


def lm_decode(rows: np.ndarray, t: str, n: int) -> np.ndarray:
    """lm3 / lm4 blocks back to float32 (..., n): d * level."""
    lv = _lm_levels(t)
    bits = 3 if len(lv) == 8 else 4
    b = np.ascontiguousarray(rows).reshape(-1, 2 + 4 * bits)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    if bits == 3:
        w = b[:, 2:].reshape(-1, 4, 3).astype(np.uint32)
        w = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16)
        codes = ((w[..., None] >> (3 * np.arange(8, dtype=np.uint32))) & 7).reshape(-1, 32)
    else:
        q = b[:, 2:]
        codes = np.stack([q & 15, q >> 4], -1).reshape(-1, 32)
    return (d * lv[codes]).astype(np.float32).reshape(*rows.shape[:-1], n)


def kv_encode(x: np.ndarray, t: str) -> np.ndarray:
    """K or V rows (T, H_kv, hd) float32 in cache type t's storage (DecoderState's: float32, float16, or each head's
    row as the type's blocks in bytes)."""
    if t == "f32":
        return x.astype(np.float32)
    if t in ("lm3", "lm4"):
        return lm_encode(x, t)
    return _gq.quantize(np.ascontiguousarray(x, np.float32), _KV[t])


def kv_decode(rows: np.ndarray, t: str, hd: int) -> np.ndarray:
    """Cache rows of type t back to float32 (n, H_kv, hd)."""
    if t == "f32":
        return rows
    if t in ("lm3", "lm4"):
        return lm_decode(rows, t, hd)
    return np.asarray(_gq.dequantize(rows, _KV[t]), np.float32).reshape(*rows.shape[:-1], hd)


def kv_query(q: np.ndarray, k_type: str) -> np.ndarray:
    """The query as llama.cpp's flash attention multiplies it with K of type k_type: converted to K's vec_dot type
    (fp16 for f16, q8_0 for q8_0 and q4_0) and back; unchanged for f32."""
    if k_type in ("f32", "lm3", "lm4"):  # no vec_dot type for Lloyd-Max codes: K is taken back to float
        return q
    vt = _Q.F16 if k_type == "f16" else _Q.Q8_0
    return np.asarray(_gq.dequantize(_gq.quantize(np.ascontiguousarray(q, np.float32), vt), vt),
                      np.float32).reshape(q.shape)


def causal_attention(q: np.ndarray, k_all: np.ndarray, v_all: np.ndarray, pos0: int) -> np.ndarray:
    """Softmax attention of T queries at positions pos0..pos0+T-1 over keys 0..pos0+T-1.

    q (T, H, hd); k_all, v_all (pos0+T, H_kv, hd). Query head h reads KV head h // (H / H_kv).
    Returns (T, H, hd). Scale 1/sqrt(hd); scores and softmax in float64.
    """
    T, H, hd = q.shape
    n_kv = k_all.shape[1]
    group = H // n_kv
    kv_of_head = np.arange(H) // group
    k = k_all[:, kv_of_head].astype(np.float64)  # (S, H, hd)
    v = v_all[:, kv_of_head].astype(np.float64)
    s = np.einsum("thd,shd->hts", q.astype(np.float64), k) / np.sqrt(hd)
    S = k_all.shape[0]
    mask = np.arange(S)[None, :] > (pos0 + np.arange(T))[:, None]
    s[:, mask] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v).astype(np.float32)


def causal_conv(u: np.ndarray, conv_state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv over time: c[t, ch] = sum_tau w[ch, tau] * win[t + tau, ch], where
    win = [conv_state; u] (oldest first) and w[:, K-1] multiplies the current token.

    u (T, C); conv_state (K-1, C); w (C, K). Returns c (T, C) and the new state win[-(K-1):].
    """
    K = w.shape[1]
    win = np.concatenate([conv_state, u], axis=0)  # (K-1+T, C)
    T = u.shape[0]
    c = np.zeros_like(u)
    for tau in range(K):
        c += win[tau : tau + T] * w[:, tau][None, :]
    return c, win[win.shape[0] - (K - 1):].copy()


def delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
               S: np.ndarray) -> np.ndarray:
    """Gated delta rule, token by token, all value heads at once (docs/gguf-qwen35.md §3 step 7).

    q, k (T, H_v, d_k) already L2-normed and mapped to value heads, q scaled by 1/sqrt(d_k);
    v (T, H_v, d_v); g, beta (T, H_v); S (H_v, d_k, d_v) updated in place. Returns o (T, H_v, d_v):
      S <- e^g S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q.
    """
    T = q.shape[0]
    o = np.empty_like(v)
    for t in range(T):
        S *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hk,hkv->hv", k[t], S)
        delta = beta[t][:, None] * (v[t] - kv)
        S += k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hk,hkv->hv", q[t], S)
    return o


def moe_route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, top-k, renormalise (denominator clamped as llama.cpp does).
    logits (T, E) -> (idx (T, k) int, weights (T, k) float32)."""
    lg = logits.astype(np.float64)
    p = np.exp(lg - lg.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, axis=-1)
    w /= np.maximum(w.sum(axis=-1, keepdims=True), 6.103515625e-5)
    return idx, w.astype(np.float32)

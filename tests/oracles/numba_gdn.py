"""Test oracle: the Gated DeltaNet layer after its projections (docs/gguf-qwen35.md §3 steps 2-8), in numba, token
by token; the plain-order reference of the CPU backend's C layer (`SimdLib.gdn_layer`).

Inputs are the projections of T tokens; the state (conv, S) is updated in place, in the DecoderState
layout: conv (K-1, C) float32, oldest first; S (H_v, d_k, d_v) float32. Matches
`ReferenceModel.gdn` between its projections: same operation order in float32, L2 norms in float64;
the gated RMSNorm is rounded as ggml's rms_norm (see numba_ops.rms_scale).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from hybridinfer.backends.cpu.simd_gdn import gdn_scratch_size

from .numba_ops import rms_scale

_jit = dict(cache=True, fastmath=False)


@njit(**_jit)
def _conv_silu(u, conv_w, conv, c, ch0, ch1):
    """Channels ch0..ch1-1 of T tokens in order: c[t] = SiLU(causal depthwise conv of [conv; u[t]]),
    then conv <- its last K-1 rows and u[t]."""
    K = conv_w.shape[1]
    for t in range(u.shape[0]):
        for ch in range(ch0, ch1):
            acc = np.float32(0.0)
            for tau in range(K - 1):
                acc += conv[tau, ch] * conv_w[ch, tau]
            acc += u[t, ch] * conv_w[ch, K - 1]
            c[t, ch] = acc / (np.float32(1.0) + np.float32(math.exp(-acc)))
        for tau in range(K - 2):
            for ch in range(ch0, ch1):
                conv[tau, ch] = conv[tau + 1, ch]
        if K > 1:
            for ch in range(ch0, ch1):
                conv[K - 2, ch] = u[t, ch]


@njit(**_jit)
def _l2_norm_head(c, i, n_k_heads, d_k, eps):
    """L2-normalise head i of the q|k part of c in place (float64 sums, as the reference); query heads
    (i < H_k) are then divided by sqrtf(d_k)."""
    s = 0.0
    for d in range(i * d_k, (i + 1) * d_k):
        s += np.float64(c[d]) * np.float64(c[d])
    den = math.sqrt(s + eps)
    for d in range(i * d_k, (i + 1) * d_k):
        c[d] = np.float32(np.float64(c[d]) / den)
    if i < n_k_heads:
        qdiv = np.float32(math.sqrt(d_k))
        for d in range(i * d_k, (i + 1) * d_k):
            c[d] = c[d] / qdiv


@njit(**_jit)
def _gdn_head(j, c, z_t, b_t, a_t, ssm_a, dt_bias, norm_w, S, n_k_heads, head_map_mod, eps, y_t, dbuf):
    """Value head j of one token: gates, delta rule on S[j], gated RMSNorm into y_t[j*d_v:]."""
    Hv, dk, dv = S.shape
    Hk = n_k_heads
    kh = j % Hk if head_map_mod else j // (Hv // Hk)
    q = c[kh * dk : (kh + 1) * dk]
    k = c[(Hk + kh) * dk : (Hk + kh + 1) * dk]
    v = c[2 * Hk * dk + j * dv : 2 * Hk * dk + (j + 1) * dv]
    x = a_t[j] + dt_bias[j]
    sp = x if x > np.float32(20.0) else np.float32(math.log1p(np.float32(math.exp(x))))
    alpha = np.float32(math.exp(ssm_a[j] * sp))
    beta = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-b_t[j])))
    dj = j * dv  # delta of head j lives in dbuf[dj:dj+dv]
    # pass 1: S <- alpha S; delta <- S^T k (direct indexing: views in loops cost refcount atomics)
    for e in range(dv):
        dbuf[dj + e] = 0.0
    delta = dbuf[dj : dj + dv]
    for i in range(dk):
        ki = k[i]
        for e in range(dv):
            s = S[j, i, e] * alpha
            S[j, i, e] = s
            delta[e] += ki * s
    for e in range(dv):
        delta[e] = beta * (v[e] - delta[e])
    # pass 2: S <- S + k delta^T; o <- S^T q (written to y_t)
    o = y_t[j * dv : (j + 1) * dv]
    for e in range(dv):
        o[e] = 0.0
    for i in range(dk):
        ki = k[i]
        qi = q[i]
        for e in range(dv):
            s = S[j, i, e] + ki * delta[e]
            S[j, i, e] = s
            o[e] += qi * s
    # gated RMSNorm: ((o * scale) * w) * silu(z)
    sc = rms_scale(o, eps)
    zj = z_t[j * dv : (j + 1) * dv]
    for e in range(dv):
        zz = zj[e]
        o[e] = ((o[e] * sc) * norm_w[e]) * (zz / (np.float32(1.0) + np.float32(math.exp(-zz))))


@njit(**_jit)
def gdn_layer(u, z, b, a, conv_w, ssm_a, dt_bias, norm_w, conv, S, n_k_heads, head_map_mod, eps, y,
              scratch):
    """GDN mixer for T tokens, state in place (docs/gguf-qwen35.md §3 steps 2-8); the recurrence runs token by token.

    u (T, C) pre-conv qkv projection; z (T, H_v*d_v); b, a (T, H_v) (beta and alpha projections);
    conv_w (C, K); ssm_a, dt_bias (H_v,); norm_w (d_v,); conv (K-1, C); S (H_v, d_k, d_v);
    n_k_heads H_k; head_map_mod: value head j reads key head j % H_k (qwen35 GGUF), else j // (H_v/H_k);
    eps (L2 and gated norms); y (T, H_v*d_v) <- gated-normed output (input of ssm_out);
    scratch float32 >= gdn_scratch_size(C, H_v, d_v) (more: see there). Per chunk of tokens the
    conv runs first, then each value head runs its steps, so that S[j] stays in cache during prefill;
    the results do not depend on the chunking. Single-threaded; the backend runs its C twin
    (`SimdLib.gdn_layer`, bit-identical) on the library's thread pool.
    """
    T, C = u.shape
    Hv, dk, dv = S.shape
    dbuf = scratch[: Hv * dv]
    Tc = max(1, (scratch.shape[0] - Hv * dv) // C)
    for t0 in range(0, T, Tc):
        t1 = min(T, t0 + Tc)
        c = scratch[Hv * dv : Hv * dv + (t1 - t0) * C].reshape((t1 - t0, C))
        _conv_silu(u[t0:t1], conv_w, conv, c, 0, C)
        for t in range(t1 - t0):
            for i in range(2 * n_k_heads):
                _l2_norm_head(c[t], i, n_k_heads, dk, eps)
        for j in range(Hv):
            for t in range(t1 - t0):
                _gdn_head(j, c[t], z[t0 + t], b[t0 + t], a[t0 + t], ssm_a, dt_bias, norm_w, S, n_k_heads,
                          head_map_mod, eps, y[t0 + t], dbuf)


def warmup() -> None:
    f = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    Hk, Hv, dk, dv, K = 1, 2, 4, 4, 4
    C = 2 * Hk * dk + Hv * dv
    gdn_layer(f(1, C), f(1, Hv * dv), f(1, Hv), f(1, Hv), f(C, K), f(Hv), f(Hv), f(dv), f(K - 1, C),
              f(Hv, dk, dv), Hk, True, 1e-6, f(1, Hv * dv), f(gdn_scratch_size(C, Hv, dv)))

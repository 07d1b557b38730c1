"""Test oracle: numba ops of everything between the quantized matrix products, the references of the CPU C ops.

Every op works in place on preallocated, C-contiguous float32 buffers, takes T tokens (T = 1 for
decode, up to a few hundred for chunked prefill) and allocates nothing: scratch buffers are passed in.
Optional inputs are empty arrays (`NO_GATE`, `NO_FREQS`). All functions are `@njit(cache=True,
fastmath=False)`: no reassociation and no FMA contraction, so results are reproducible and follow the
rounding written here (ggml's where the brief asks for it, see each docstring).

The GDN layer is in numba_gdn.py, sampling in hybridinfer/engine/sampling.py; `warmup()` compiles all three. The backend
runs attention, rope and swiglu in C with llama.cpp's float order (native/simd/kernels_attn.h), and the norms,
routing, gates and combine as their bit-identical C twins (native/simd/ops.c, tests/test_simd_ops.py), so that
a decode step runs as one native call; the numba versions here stay as the plain-order references.
Pass Python ints/floats for scalars and C-contiguous arrays: other types compile new specialisations.

Vectorization without reassociation: numba leaves LLVM's SLP vectorizer off, so only loops along the
last axis with independent lanes vectorize. Dot products are therefore never vectorized along their
own length: attention transposes K in blocks and accumulates scores for 64 keys at a time, each score
summed over d in plain order. The ops are single-threaded (the backend runs the GDN layer in C,
`SimdLib.gdn_layer`, on the library's thread pool; numba_gdn.gdn_layer is its reference twin).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

NO_GATE = np.zeros((0, 0), np.float32)  # attention without an output gate
NO_FREQS = np.zeros(0, np.float32)  # rope without frequency factors
ROUTE_DENOM_MIN = 6.103515625e-5  # llama.cpp clamps the top-k weight sum (2^-14)

_jit = dict(cache=True, fastmath=False)


# norms ---------------------------------------------------------------------------------------------
@njit(**_jit)
def rms_scale(x, eps):
    """ggml's 1/rms of a float32 vector: float32 squares summed in float64, mean narrowed to float32,
    then 1.0f / sqrtf(mean + eps) in float32 (ggml_compute_forward_rms_norm_f32)."""
    s = 0.0
    for i in range(x.shape[0]):
        v = x[i] * x[i]
        s += v
    mean = np.float32(s / x.shape[0])
    return np.float32(1.0) / np.float32(math.sqrt(mean + np.float32(eps)))


@njit(**_jit)
def rms_norm(x, w, eps, out):
    """out[t] = (x[t] * scale) * w, x and out (T, D) (may alias), w (D,); ggml rounding (rms_scale)."""
    for t in range(x.shape[0]):
        xr = x[t]
        sc = rms_scale(xr, eps)
        o = out[t]
        for i in range(xr.shape[0]):
            o[i] = (xr[i] * sc) * w[i]


@njit(**_jit)
def rms_norm_heads(x, w, eps, out):
    """Per-head RMSNorm for q/k norms: x and out (T, H, hd) (may alias), w (hd,); ggml rounding."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            xr = x[t, h]
            sc = rms_scale(xr, eps)
            o = out[t, h]
            for i in range(xr.shape[0]):
                o[i] = (xr[i] * sc) * w[i]


# rope ----------------------------------------------------------------------------------------------
@njit(**_jit)
def rope(x, pos0, n_rot, theta_base, neox, freq_factors):
    """Rotate the first n_rot dims of x (T, H, hd) in place; token t has position pos0 + t.

    Angles as ggml_rope_cache_init builds them: theta_scale = powf(base, -2.0f/n_rot); theta starts at
    (float)pos and is multiplied by theta_scale once per pair; cosf/sinf of theta / freq_factors[i]
    (when freq_factors is not empty). neox: pairs (i, i + n_rot/2) (Qwen); else (2i, 2i+1) (llama).
    """
    T, H, _ = x.shape
    half = n_rot // 2
    theta_scale = np.float32(math.pow(np.float32(theta_base), np.float32(-2.0) / np.float32(n_rot)))
    has_ff = freq_factors.shape[0] > 0
    for t in range(T):
        theta = np.float32(pos0 + t)
        for i in range(half):
            th = theta / freq_factors[i] if has_ff else theta
            c = np.float32(math.cos(th))
            s = np.float32(math.sin(th))
            if neox:
                i0, i1 = i, i + half
            else:
                i0, i1 = 2 * i, 2 * i + 1
            for h in range(H):
                x0 = x[t, h, i0]
                x1 = x[t, h, i1]
                x[t, h, i0] = x0 * c - x1 * s
                x[t, h, i1] = x0 * s + x1 * c
            theta = theta * theta_scale


# attention -----------------------------------------------------------------------------------------
@njit(**_jit)
def split_qgate(qg, q, gate):
    """Qwen's attn_q output (T, H*2*hd), per head [query(hd), gate(hd)] -> q (T, H, hd), gate (T, H*hd)."""
    T, H, hd = q.shape
    for t in range(T):
        for h in range(H):
            b = h * 2 * hd
            for d in range(hd):
                q[t, h, d] = qg[t, b + d]
                gate[t, h * hd + d] = qg[t, b + hd + d]


@njit(**_jit)
def kv_append(k, v, k_cache, v_cache, pos0):
    """Write k, v (T, H_kv, hd) to cache rows pos0..pos0+T-1 (caches (n_ctx, H_kv, hd))."""
    for t in range(k.shape[0]):
        k_cache[pos0 + t] = k[t]
        v_cache[pos0 + t] = v[t]


ATTN_BLOCK = 64  # keys per block: K rows are transposed block by block so that QK vectorizes


@njit(**_jit)
def _attn_part(q, t, k_cache, v_cache, kvh, G, s0, s1, scale, sc, kT, acc, ml):
    """Unnormalised attention of query t's G heads of KV head kvh over key rows s0..s1-1.

    sc: scratch (>= G*(s1-s0)) for the scores; kT: scratch (hd, ATTN_BLOCK) for a transposed block of
    K rows; acc (G, hd) <- sum_s e^(score_s - m) v_s; ml (G, 2) <- (m, l): max score, sum of the
    e^(score_s - m) (float32 terms, float64 sum). Each score is a float32 dot product summed over d in
    order (as a plain loop would), then times scale; each acc element is summed over s in order.
    Hot loops index arrays directly (views inside loops cost reference-count atomics) and run along
    the last axis, so that LLVM vectorizes them without reassociating anything.
    """
    hd = q.shape[2]
    B = kT.shape[1]
    n = s1 - s0
    h0 = kvh * G
    d8 = hd - hd % 8
    for b0 in range(0, n, B):
        nb = min(B, n - b0)
        # transpose the block in 8x8 tiles: kT[d, b] = K[s0+b0+b, kvh, d] (fixed trip counts inside)
        nb8, hd8 = nb - nb % 8, hd - hd % 8
        for bb in range(0, nb8, 8):
            for dd in range(0, hd8, 8):
                for b in range(8):
                    r = s0 + b0 + bb + b
                    for d in range(8):
                        kT[dd + d, bb + b] = k_cache[r, kvh, dd + d]
            for d in range(hd8, hd):
                for b in range(bb, bb + 8):
                    kT[d, b] = k_cache[s0 + b0 + b, kvh, d]
        for b in range(nb8, nb):
            for d in range(hd):
                kT[d, b] = k_cache[s0 + b0 + b, kvh, d]
        for j in range(G):
            srow = sc[j * n + b0 : j * n + b0 + nb]
            for b in range(nb):
                srow[b] = 0.0
            # eight d per pass, added in order: same rounding as one d at a time, an eighth of the stores
            qr = q[t, h0 + j]
            for d in range(0, d8, 8):
                q0, q1, q2, q3, q4, q5, q6, q7 = (qr[d], qr[d + 1], qr[d + 2], qr[d + 3], qr[d + 4], qr[d + 5],
                                                  qr[d + 6], qr[d + 7])
                for b in range(nb):
                    srow[b] = ((((((((srow[b] + q0 * kT[d, b]) + q1 * kT[d + 1, b]) + q2 * kT[d + 2, b])
                                   + q3 * kT[d + 3, b]) + q4 * kT[d + 4, b]) + q5 * kT[d + 5, b])
                                + q6 * kT[d + 6, b]) + q7 * kT[d + 7, b])
            for d in range(d8, hd):
                qd = q[t, h0 + j, d]
                for b in range(nb):
                    srow[b] = srow[b] + qd * kT[d, b]
            for b in range(nb):
                srow[b] = srow[b] * scale
    for j in range(G):
        srow = sc[j * n : (j + 1) * n]
        m = srow[0]
        for s in range(1, n):
            if srow[s] > m:
                m = srow[s]
        tot = 0.0
        for s in range(n):
            e = np.float32(math.exp(srow[s] - m))
            srow[s] = e
            tot += e
        ml[j, 0] = m
        ml[j, 1] = tot
        for d in range(hd):
            acc[j, d] = 0.0
    n8 = n - n % 8
    # eight keys per pass, added in order (same rounding as one at a time); V rows read once for G heads
    for s in range(0, n8, 8):
        r = s0 + s
        for j in range(G):
            o = j * n + s
            p0, p1, p2, p3 = sc[o], sc[o + 1], sc[o + 2], sc[o + 3]
            p4, p5, p6, p7 = sc[o + 4], sc[o + 5], sc[o + 6], sc[o + 7]
            for d in range(hd):
                acc[j, d] = ((((((((acc[j, d] + p0 * v_cache[r, kvh, d]) + p1 * v_cache[r + 1, kvh, d])
                                  + p2 * v_cache[r + 2, kvh, d]) + p3 * v_cache[r + 3, kvh, d])
                                + p4 * v_cache[r + 4, kvh, d]) + p5 * v_cache[r + 5, kvh, d])
                              + p6 * v_cache[r + 6, kvh, d]) + p7 * v_cache[r + 7, kvh, d])
    for s in range(n8, n):
        for j in range(G):
            p = sc[j * n + s]
            for d in range(hd):
                acc[j, d] = acc[j, d] + p * v_cache[s0 + s, kvh, d]


@njit(**_jit)
def _attn_finish(o, gate_h, has_gate):
    """Apply the sigmoid output gate 1/(1+expf(-g)) to o in place."""
    if has_gate:
        for d in range(o.shape[0]):
            o[d] = o[d] * (np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-gate_h[d]))))


@njit(**_jit)
def attn_gate(o, gate):
    """o (T, H*hd) *= sigmoid(gate) = 1/(1+expf(-g)) in place (Qwen's attention output gate)."""
    for t in range(o.shape[0]):
        _attn_finish(o[t], gate[t], True)


def _carve(buf, G, n_sc, hd):
    """Views of one attention scratch row: scores (G*n_sc), kT (hd, ATTN_BLOCK), acc (G, hd), ml (G, 2)."""
    o = G * n_sc
    kT = buf[o : o + hd * ATTN_BLOCK].reshape((hd, ATTN_BLOCK))
    o += hd * ATTN_BLOCK
    acc = buf[o : o + G * hd].reshape((G, hd))
    o += G * hd
    ml = buf[o : o + 2 * G].reshape((G, 2))
    return kT, acc, ml


_carve = njit(**_jit)(_carve)


def _row_size(G: int, n_sc: int, hd: int) -> int:
    return G * n_sc + hd * ATTN_BLOCK + G * hd + 2 * G


@njit(**_jit)
def attention(q, k_cache, v_cache, pos0, gate, out, scratch):
    """Causal softmax attention of T queries at positions pos0..pos0+T-1 over cache rows 0..pos0+T-1.

    q (T, H, hd); k_cache, v_cache (n_ctx, H_kv, hd) with rows < pos0+T filled (kv_append first);
    query head h reads KV head h // (H/H_kv); scale 1/sqrtf(hd); gate (T, H*hd) or NO_GATE: the output
    is multiplied by sigmoid(gate). out (T, H*hd). scratch: float32 (>= attention_scratch_size).
    """
    T, H, hd = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(hd)))
    has_gate = gate.shape[0] > 0
    kT, acc, ml = _carve(scratch, G, pos0 + T, hd)
    for t in range(T):
        n = pos0 + t + 1
        for kvh in range(Hkv):
            _attn_part(q, t, k_cache, v_cache, kvh, G, 0, n, scale, scratch, kT, acc, ml)
            for j in range(G):
                h = kvh * G + j
                o = out[t, h * hd : (h + 1) * hd]
                inv = np.float32(1.0 / ml[j, 1])
                a = acc[j]
                for d in range(hd):
                    o[d] = a[d] * inv
                _attn_finish(o, gate[t, h * hd : (h + 1) * hd] if has_gate else o, has_gate)


def attention_scratch_size(n_ctx: int, n_head: int, n_head_kv: int, head_dim: int) -> int:
    """float32 elements of `attention`'s scratch for a cache of n_ctx rows."""
    return _row_size(n_head // n_head_kv, n_ctx, head_dim)


# FFN / MoE helpers ---------------------------------------------------------------------------------
@njit(**_jit)
def swiglu(g, u, out):
    """out = silu(g) * u = (g / (1 + expf(-g))) * u, (T, F) each; out may alias g or u."""
    for t in range(g.shape[0]):
        for i in range(g.shape[1]):
            x = g[t, i]
            out[t, i] = (x / (np.float32(1.0) + np.float32(math.exp(-x)))) * u[t, i]


@njit(**_jit)
def add_inplace(x, y):
    """x += y, (T, D) each (the residual add)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += y[t, i]


@njit(**_jit)
def gated_add(out, s, x, w_shg):
    """Shared expert: out[t] += sigmoid(dot(w_shg, x[t])) * s[t]; the dot accumulates in float64 and
    is narrowed to float32 before the sigmoid. out, s, x (T, D); w_shg (D,)."""
    for t in range(out.shape[0]):
        acc = 0.0
        for i in range(x.shape[1]):
            acc += np.float64(x[t, i]) * np.float64(w_shg[i])
        g = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-np.float32(acc))))
        for i in range(out.shape[1]):
            out[t, i] += s[t, i] * g


@njit(**_jit)
def moe_combine(ys, w, out):
    """out[t] = sum_j w[t, j] * ys[t*k + j], summed in slot order as llama.cpp adds the expert views
    (the reference sums in expert-id order). ys (T*k, D); w (T, k); out (T, D)."""
    T, k = w.shape
    for t in range(T):
        o = out[t]
        y = ys[t * k]
        wt = w[t, 0]
        for i in range(o.shape[0]):
            o[i] = y[i] * wt
        for j in range(1, k):
            y = ys[t * k + j]
            wt = w[t, j]
            for i in range(o.shape[0]):
                o[i] += y[i] * wt


@njit(**_jit)
def add_rms_norm(h, y, w, eps, out):
    """h += y, then out = rms_norm(h) * w: the residual add and the next norm (the C twin: hi_rms_norm)."""
    add_inplace(h, y)
    rms_norm(h, w, eps, out)


@njit(**_jit)
def moe_combine_gated(ys, w, out, s, x, w_shg):
    """moe_combine, then gated_add of the shared expert s (the C twin: hi_moe_combine)."""
    moe_combine(ys, w, out)
    gated_add(out, s, x, w_shg)


@njit(**_jit)
def moe_route(logits, k, idx_out, w_out):
    """Router: P = softmax over all E experts (float64), top-k of P (ties -> lower index), weights
    P_e / max(sum of the k P, 6.103515625e-5) narrowed to float32, best first. logits (T, E) float32;
    idx_out (T, k) int32; w_out (T, k) float32. Keeps only the k best while scanning (no scratch)."""
    T, E = logits.shape
    for t in range(T):
        lg = logits[t]
        m = np.float64(lg[0])
        for e in range(1, E):
            if lg[e] > m:
                m = np.float64(lg[e])
        tot = 0.0
        for e in range(E):
            tot += math.exp(np.float64(lg[e]) - m)
        ids = idx_out[t]
        n = 0  # ids[0:n] sorted by P, best first; strict > keeps the lower index ahead on ties
        p_last = 0.0
        for e in range(E):
            pe = math.exp(np.float64(lg[e]) - m) / tot
            if n == k and pe <= p_last:
                continue
            pos = n if n < k else k - 1
            while pos > 0 and pe > math.exp(np.float64(lg[ids[pos - 1]]) - m) / tot:
                if pos < k:
                    ids[pos] = ids[pos - 1]
                pos -= 1
            ids[pos] = e
            if n < k:
                n += 1
            p_last = math.exp(np.float64(lg[ids[n - 1]]) - m) / tot
        den = 0.0
        for j in range(k):
            den += math.exp(np.float64(lg[ids[j]]) - m) / tot
        den = max(den, ROUTE_DENOM_MIN)
        for j in range(k):
            w_out[t, j] = np.float32((math.exp(np.float64(lg[ids[j]]) - m) / tot) / den)


# warm-up -------------------------------------------------------------------------------------------
def warmup() -> None:
    """Compile (or load from numba's cache) every op of numba_ops, numba_gdn and the sampler on tiny inputs,
    with the argument types the backend uses (C-contiguous float32 arrays, int32 indices)."""
    from hybridinfer.engine import sampling

    from . import numba_gdn

    f = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    x = f(1, 8)
    rms_norm(x, f(8), 1e-6, x)
    q = f(1, 4, 8)
    rms_norm_heads(q, f(8), 1e-6, q)
    rope(q, 0, 4, 10000.0, True, NO_FREQS)
    rope(q, 0, 4, 10000.0, False, f(2) + 1)
    gate = f(1, 32)
    split_qgate(f(1, 64), q, gate)
    kc, vc = f(4, 2, 8), f(4, 2, 8)
    kv_append(f(1, 2, 8), f(1, 2, 8), kc, vc, 0)
    out = f(1, 32)
    attention(q, kc, vc, 0, gate, out, f(attention_scratch_size(4, 4, 2, 8)))
    attention(q, kc, vc, 0, NO_GATE, out, f(attention_scratch_size(4, 4, 2, 8)))
    attn_gate(out, gate)
    swiglu(x, x, x)
    add_inplace(x, x)
    gated_add(x, x, x, f(8))
    moe_combine(f(2, 8), f(1, 2), x)
    moe_route(f(1, 4), 2, np.zeros((1, 2), np.int32), f(1, 2))
    numba_gdn.warmup()
    sampling.warmup()

"""numpy references of the native kernels that follow llama.cpp's own float order (ggml-cpu as built for an
AVX-512 or AVX2 host): the K-quant repacked / tiled shapes (native/simd/dot_kq_shapes.h), attention, SwiGLU
and RoPE (native/simd/kernels_attn.h, attn.c). Slow and explicit: every fused multiply-add is `fma32` (exact),
every horizontal sum is spelled out lane by lane. `W` is the SIMD width of the ggml build being mirrored: 16
(AVX-512), 8 (AVX2), 4 (SSE3: ggml_vec_dot_f32 in 8 accumulators of 4 lanes, no FMA) or 1 (no SIMD: float
products summed in double). The exp of an x86-64 build below AVX2 is SSE2's 4-lane ggml_v_expf without FMA even
when its dot product has no SIMD (the scalar unit: W 1 for dot products, 4 for exp).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

from hybridinfer.backends.actquant_k import Q4_K, Q6_K, fma32, unpack_q8_K, weight_terms

F32 = np.float32
_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _fn in ("expf", "cosf", "sinf"):
    getattr(_libm, _fn).restype, getattr(_libm, _fn).argtypes = ctypes.c_float, [ctypes.c_float]
_libm.powf.restype, _libm.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]


def libm(name: str, x) -> np.ndarray:
    """The C library's float function `name` (expf, cosf, sinf) elementwise, as compiled C code calls it."""
    f = getattr(_libm, name)
    x = np.asarray(x, F32)
    return np.array([f(float(v)) for v in x.reshape(-1)], F32).reshape(x.shape)


def _dsum(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Sequential float64 sum (a C loop's order; np.sum is pairwise)."""
    return np.take(np.cumsum(x.astype(np.float64), axis=axis), -1, axis=axis)


def _h(hexfloat: str) -> np.float32:
    return F32(float.fromhex(hexfloat))


def _f(x) -> np.ndarray:
    return np.asarray(x, F32)


# K-quant shapes ---------------------------------------------------------------------------------------
def _kq_ints(xq: np.ndarray, raw: np.ndarray, qtype: int, rows: int, cols: int):
    """(D (T, nb), d, dmin (rows, nb), isum, imin (T, rows, nb, 4) per 64-element quarter) as int64."""
    D, q8, bs = unpack_q8_K(xq, cols)
    A, d, dmin, aux = weight_terms(raw, qtype, rows, cols)
    T, nb = D.shape
    isum = np.einsum("rbgj,tbgj->trbg", A.reshape(rows, nb, 4, 64).astype(np.int64),
                     q8.reshape(T, nb, 4, 64).astype(np.int64))
    if qtype == Q6_K:
        off = aux.reshape(rows, nb, 4, 4).astype(np.int64)
        isum -= 32 * np.einsum("rbgs,tbgs->trbg", off, bs.reshape(T, nb, 4, 4).astype(np.int64))
        return D, d, dmin, isum, None
    B = (bs[..., 0::2].astype(np.int64) + bs[..., 1::2]).reshape(T, nb, 4, 2)
    imin = np.einsum("rbgs,tbgs->trbg", aux.reshape(rows, nb, 4, 2).astype(np.int64), B)
    return D, d, dmin, isum, imin


def kq_repack_matmul(xq: np.ndarray, raw: np.ndarray, rows: int, cols: int, gemm_tokens: int = 0) -> np.ndarray:
    """Q4_K rows as llama.cpp's repacked q4_K_8x8 kernels compute them: (T, rows) float32 for Q8_K activation
    rows xq; the first `gemm_tokens` tokens take the gemm's per-quarter steps, the others the gemv's."""
    D, d, dmin, isum, imin = _kq_ints(xq, raw, Q4_K, rows, cols)
    T = D.shape[0]
    out = np.empty((T, rows), F32)
    for t in range(T):
        acc, accm = np.zeros(rows, F32), np.zeros(rows, F32)
        for b in range(D.shape[1]):
            dd, dm = _f(d[:, b] * D[t, b]), _f(dmin[:, b] * D[t, b])
            if t < gemm_tokens:
                for g in range(4):
                    acc = fma32(_f(isum[t, :, b, g]), dd, acc)
                    accm = fma32(_f(imin[t, :, b, g]), dm, accm)
            else:
                acc = fma32(_f(isum[t, :, b].sum(-1)), dd, acc)
                accm = fma32(_f(imin[t, :, b].sum(-1)), dm, accm)
        out[t] = acc - accm
    return out


def kq_tiled_matmul(xq: np.ndarray, raw: np.ndarray, qtype: int, rows: int, cols: int) -> np.ndarray:
    """K-quant rows as llama.cpp's tiled kernels compute them (res = d * isum [- dmin * imin, fused];
    out = fma(res, D, out) block by block): (T, rows) float32."""
    D, d, dmin, isum, imin = _kq_ints(xq, raw, qtype, rows, cols)
    out = np.zeros((D.shape[0], rows), F32)
    for b in range(D.shape[1]):
        res = _f(d[None, :, b] * _f(isum[:, :, b].sum(-1)))
        if imin is not None:
            res = fma32(-dmin[None, :, b], _f(imin[:, :, b].sum(-1)), res)
        out = fma32(res, np.broadcast_to(D[:, b : b + 1], res.shape), out)
    return out


# horizontal sums and ggml's vector primitives ------------------------------------------------------------
def hsum_reduce512(v: np.ndarray) -> np.ndarray:
    """_mm512_reduce_add_ps (gcc) over the last axis of 16 lanes."""
    t3 = _f(v[..., 8:] + v[..., :8])
    t6 = _f(t3[..., 4:] + t3[..., :4])
    t8 = _f(t6[..., :2] + t6[..., 2:])
    return _f(t8[..., 0] + t8[..., 1])


def hsum_hadd256(v: np.ndarray) -> np.ndarray:
    """ggml's AVX2 reduce: (lo + hi), then hadd twice."""
    t0 = _f(v[..., :4] + v[..., 4:])
    return _f(_f(t0[..., 0] + t0[..., 1]) + _f(t0[..., 2] + t0[..., 3]))


def hsum_movehl256(v: np.ndarray) -> np.ndarray:
    """tinyBLAS's / the softmax's AVX2 horizontal sum: (hi + lo), + movehl, + movehdup."""
    x = _f(v[..., 4:] + v[..., :4])
    return _f(_f(x[..., 0] + x[..., 2]) + _f(x[..., 1] + x[..., 3]))


def dot_f32(x: np.ndarray, y: np.ndarray, W: int) -> np.ndarray:
    """ggml_vec_dot_f32 along the last axis (broadcasting the others)."""
    x, y = np.broadcast_arrays(_f(x), _f(y))
    n = x.shape[-1]
    if W == 1:
        return _f(_dsum(_f(x * y)))
    if W == 4:
        return _dot_sse(x, y)
    step = 4 * W
    np_ = n // step * step
    acc = np.zeros(x.shape[:-1] + (4, W), F32)
    for i in range(0, np_, step):
        acc = fma32(x[..., i : i + step].reshape(acc.shape), y[..., i : i + step].reshape(acc.shape), acc)
    s = _f(_f(acc[..., 0, :] + acc[..., 2, :]) + _f(acc[..., 1, :] + acc[..., 3, :]))
    out = hsum_reduce512(s) if W == 16 else hsum_hadd256(s)
    for i in range(np_, n):
        out = fma32(x[..., i], y[..., i], out)
    return out


def tinyblas_dot(x: np.ndarray, y: np.ndarray, W: int) -> np.ndarray:
    """llamafile's tinyBLAS row (F32/F16 products over two tokens or more, length a multiple of W): one
    accumulator of W lanes of fused multiply-adds, then its horizontal sum (AVX-512: _mm512_reduce_add_ps;
    AVX2: hi + lo, movehl, movehdup)."""
    x, y = np.broadcast_arrays(_f(x), _f(y))
    acc = np.zeros(x.shape[:-1] + (W,), F32)
    for i in range(0, x.shape[-1], W):
        acc = fma32(x[..., i : i + W], y[..., i : i + W], acc)
    return hsum_reduce512(acc) if W == 16 else hsum_movehl256(acc)


def _sse_reduce8(acc: np.ndarray) -> np.ndarray:
    """GGML_F32x4_REDUCE of 8 accumulators (axis -2) of 4 lanes: x[i] += x[i + 4], x[i] += x[i + 2],
    x[0] += x[1], then hadd twice: (l0 + l1) + (l2 + l3)."""
    a = _f(acc[..., :4, :] + acc[..., 4:, :])
    a = _f(a[..., :2, :] + a[..., 2:, :])
    a = _f(a[..., 0, :] + a[..., 1, :])
    return _f(_f(a[..., 0] + a[..., 1]) + _f(a[..., 2] + a[..., 3]))


def _dot_sse(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32 of an SSE3 build: STEP 32 in 8 accumulators of 4 lanes (a product, then a sum), the
    reduce, the tail in float."""
    n = x.shape[-1]
    np_ = n // 32 * 32
    acc = np.zeros(x.shape[:-1] + (8, 4), F32)
    for i in range(0, np_, 32):
        acc = _f(_f(x[..., i : i + 32].reshape(acc.shape) * y[..., i : i + 32].reshape(acc.shape)) + acc)
    out = _sse_reduce8(acc)
    for i in range(np_, n):
        out = _f(out + _f(x[..., i] * y[..., i]))
    return out


def v_expf(x: np.ndarray, W: int) -> np.ndarray:
    """ggml_v_expf of the AVX-512 (W 16), AVX2 (W 8) or SSE2 (W 4, no FMA) build; W 1: libm's expf (float32
    np.exp here)."""
    x = _f(x)
    if W == 1:
        return np.exp(x)
    if W == 4:  # the same steps as AVX2's with every fused multiply-add split into a product and a sum
        fma = lambda a, b, c: _f(_f(_f(a) * _f(b)) + _f(c))  # noqa: E731
    else:
        fma = fma32
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        r = _h("0x1.8p23")
        z = fma(x, _h("0x1.715476p+0"), r)
        n = _f(z - r)
        b = fma(-n, _h("0x1.7f7d1cp-20"), fma(-n, _h("0x1.62e4p-1"), x))
        u = _f(b * b)
        p = fma(fma(_h("0x1.0e4020p-7"), b, _h("0x1.573e2ep-5")), u, fma(_h("0x1.555e66p-3"), b, _h("0x1.fffdb6p-2")))
        if W == 16:
            j = fma32(p, u, fma32(_h("0x1.ffffecp-1"), b, F32(1.0)))
            res = np.ldexp(j, np.where(np.abs(n) > 192, 0, n).astype(np.int32)).astype(F32)
            return np.where(np.abs(n) > 192, np.where(n <= 0, F32(0), F32(np.inf)), res).astype(F32)
        j = fma(p, u, _f(_h("0x1.ffffecp-1") * b))
        e = z.view(np.int32) << 23
        k = (e + np.int32(0x3F800000)).view(F32)
        g = np.where(n <= 0, np.int32(-0x7E000000), np.int32(0))  # 0x82000000 as int32
        s1 = (g + np.int32(0x7F000000)).view(F32)
        s2 = (e - g).view(F32)
        mid = np.where(np.abs(n) > 126, _f(fma(s2, j, s2) * s1), fma(k, j, k))
        return np.where(np.abs(n) > 192, _f(s1 * s1), mid).astype(F32)


def softmax(w: np.ndarray, scale: float, W: int) -> np.ndarray:
    """ggml_soft_max_ext (no mask past the row) + ggml_vec_soft_max_f32 of a 1-D row: float32 probabilities."""
    w = _f(_f(w) * F32(scale))
    m = w.max()
    n = w.size
    if W == 1:
        e = libm("expf", _f(w - m))
        tot = float(_dsum(e))
    else:
        pad = -(-n // W) * W
        wp = np.full(pad, -np.inf, F32)
        wp[:n] = w
        e = v_expf(_f(wp - m), W).reshape(-1, W)
        if W == 4:  # shuffle (1, 0, 3, 2), movehl, add_ss: (e0 + e1) + (e2 + e3)
            parts = _f(_f(e[:, 0] + e[:, 1]) + _f(e[:, 2] + e[:, 3]))
        else:
            parts = hsum_reduce512(e) if W == 16 else hsum_movehl256(e)
        tot = 0.0
        for v in parts:
            tot += float(v)
        e = e.reshape(-1)[:n]
    return _f(e * F32(1.0 / tot))


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos0: int, W: int,
              W_exp: int | None = None) -> np.ndarray:
    """llama.cpp's attention (kernels_attn.h): q (T, H, hd), caches (n_ctx, H_kv, hd) -> (T, H*hd) float32;
    W the dot products' width, W_exp the softmax's (default W)."""
    T, H, hd = q.shape
    G = H // k_cache.shape[1]
    scale = F32(1.0) / np.sqrt(F32(hd))
    out = np.zeros((T, H, hd), F32)
    for t in range(T):
        n = pos0 + t + 1
        for h in range(H):
            kv = h // G
            p = softmax(dot_f32(k_cache[:n, kv], q[t, h], W), scale, W if W_exp is None else W_exp)
            v = _f(v_cache[:n, kv])  # (n, hd)
            if W == 1:
                out[t, h] = _f(_dsum(_f(p[:, None] * v), axis=0))
                continue
            if W == 4:  # vec_dot over s (no tinyBLAS below AVX): accumulator (s // 4) % 8, lane s % 4
                acc = np.zeros((hd, 8, 4), F32)
                for s in range(n):
                    acc[:, (s // 4) % 8, s % 4] = _f(_f(p[s] * v[s]) + acc[:, (s // 4) % 8, s % 4])
                out[t, h] = _sse_reduce8(acc)
                continue
            A = 1 if T >= 2 and hd % 4 == 0 else 4
            acc = np.zeros((A, W, hd), F32)
            for s in range(n):
                a, lane = (s // W) % A, s % W
                acc[a, lane] = fma32(p[s], v[s], acc[a, lane])
            if A == 4:
                lanes = _f(_f(acc[0] + acc[2]) + _f(acc[1] + acc[3])).T  # (hd, W)
                out[t, h] = hsum_reduce512(lanes) if W == 16 else hsum_hadd256(lanes)
            else:
                out[t, h] = hsum_reduce512(acc[0].T) if W == 16 else hsum_movehl256(acc[0].T)
    return out.reshape(T, H * hd)


def swiglu(g: np.ndarray, u: np.ndarray, W: int) -> np.ndarray:
    """ggml_vec_swiglu_f32 of rows (T, n): silu(g) * u, ggml_v_expf on whole vectors of W (the build's exp
    width), expf on the tail."""
    g, u = _f(g), _f(u)
    n = g.shape[-1]
    body = n // W * W if W > 1 else 0
    e = np.empty_like(g)
    e[..., :body] = v_expf(-g[..., :body], W)
    e[..., body:] = libm("expf", -g[..., body:])
    return _f(_f(g / _f(F32(1) + e)) * u)


def rope(x: np.ndarray, pos0: int, n_rot: int, theta_base: float, neox: bool, freq_factors: np.ndarray,
         fused: bool = True) -> np.ndarray:
    """ggml's rope as attn.c computes it (powf; cosf / sinf; the rotation contracted to fused multiply-adds in a
    build with FMA, two products and a sum without); x (T, H, hd) -> new array."""
    x = _f(x).copy()
    half = n_rot // 2
    theta_scale = F32(_libm.powf(float(F32(theta_base)), float(F32(-2.0) / F32(n_rot))))
    for t in range(x.shape[0]):
        theta = F32(pos0 + t)
        for i in range(half):
            th = _f(theta / freq_factors[i]) if freq_factors.size else theta
            c, s = libm("cosf", th), libm("sinf", th)
            i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
            x0, x1 = x[t, :, i0].copy(), x[t, :, i1].copy()
            if fused:
                x[t, :, i0] = fma32(x0, c, -_f(x1 * s))
                x[t, :, i1] = fma32(x0, s, _f(x1 * c))
            else:
                x[t, :, i0] = _f(_f(x0 * c) - _f(x1 * s))
                x[t, :, i1] = _f(_f(x0 * s) + _f(x1 * c))
            theta = F32(theta * theta_scale)
    return x

/* Causal softmax attention over an F32 K/V cache with llama.cpp's float operations (its CPU backend without
 * flash attention, ggml-cpu built for the same ISA level): the table's `attn`.
 * A part of kernels_body.h (which has the ISA macros), included by it once per ISA unit.
 *
 * llama.cpp's graph (src/llama-graph.cpp, build_attn_mha) per query head h, token t, over the n_kv cache cells
 * (padded to a multiple of 256 with empty cells, which add exact zeros below, so the first n = pos + 1 cells
 * and a pad to the SIMD width give the same bits):
 *   kq[s]  = ggml_vec_dot_f32(hd, k[s], q)          (MUL_MAT: the permuted q is not contiguous, or T = 1, so
 *                                                     never llamafile's sgemm)
 *   w[s]   = kq[s] * scale (+ 0, or -inf past the causal mask)
 *   p      = ggml_vec_soft_max_f32: e[s] = ggml_v_expf(w[s] - max) a vector at a time, the sum of each vector's
 *            horizontal sum in double; then p[s] = e[s] * (float)(1.0 / sum)
 *   out[i] = sum_s p[s] v[s][i]: for T >= 2 llamafile's tinyBLAS (one accumulator of W lanes over s, lane s % W,
 *            fused multiply-adds, then its hsum), for T = 1 ggml_vec_dot_f32 over n_kv (4 accumulators of W
 *            lanes: s in accumulator (s / W) % 4, then (a0 + a2) + (a1 + a3) and the horizontal sum); with
 *            rows1 (HI_GGML_DECODE_ROWS) the T = 1 order for every T, so a row does not depend on how many
 *            tokens share the call (the rest of a row's operations never do).
 * ggml_vec_dot_f32 of n values: W-lane accumulators a_j (j < 4) take the fused products of the 4W-element steps,
 * then (a0 + a2) + (a1 + a3), its horizontal sum, and the n % 4W tail added with fmaf (the build contracts it).
 * W = 16 and horizontal sums by _mm512_reduce_add_ps (AVX-512 unit); W = 8 with ggml's hadd tree for the dot
 * and softmax and tinyBLAS's (hi + lo, movehl, movehdup) for the output (AVX2 unit); W = 4 for the SSSE3 unit,
 * as ggml built for SSE4.2: vec_dot_f32 in 8 accumulators of 4 lanes without FMA for the dots and the output
 * (no tinyBLAS below AVX), SSE2's ggml_v_expf without FMA and a shuffle-based horizontal sum in the softmax;
 * the scalar unit as ggml built for baseline x86-64: dots summed in double, SSE2's ggml_v_expf.
 * The output is computed along i (the cache rows are position-major here; ggml's V is transposed), one
 * accumulator array per lane, so every output value takes the same operations in the same order.
 */
#ifndef HI_INLINE
#error "kernels_attn.h is a part of kernels_body.h; include that"
#endif

#if defined(HI_VNNI)
#define HI_AW 16
#elif defined(HI_AVX2)
#define HI_AW 8
#elif defined(HI_SSSE3)
#define HI_AW 4
#else
#define HI_AW 1
#endif

/* x86-64 builds of ggml without AVX2 still take SSE2 paths for exp: ggml_v_expf/ggml_v_silu of 4 lanes with
 * products and sums rounded apart (no FMA), in the softmax and SwiGLU; ggml_vec_dot_f32 takes 4-lane SIMD
 * only with SSE3 (the SSSE3 unit; the scalar unit sums in double) */
#if !defined(HI_AVX2) && defined(__SSE2__)
#define HI_SSE_EXP 1
#include <emmintrin.h>
#endif

/* ggml_vec_dot_f32 of this ISA's build */
HI_INLINE float hi_ggml_dot_f32(const float *x, const float *y, int64_t n) {
#if defined(HI_VNNI)
    const int64_t np = n & ~(int64_t)63;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < np; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(y + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 32), _mm512_loadu_ps(y + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 48), _mm512_loadu_ps(y + i + 48), s3);
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3)));
    for (int64_t i = np; i < n; i++) sum = fmaf(x[i], y[i], sum);
    return sum;
#elif defined(HI_AVX2)
    const int64_t np = n & ~(int64_t)31;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < np; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(y + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(y + i + 24), s3);
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    float sum = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
    for (int64_t i = np; i < n; i++) sum = fmaf(x[i], y[i], sum);
    return sum;
#elif defined(HI_SSSE3)
    /* 8 accumulators of 4 lanes (GGML_F32_STEP 32), a += x * y rounded twice; reduce x[i] += x[i + 4],
     * x[i] += x[i + 2], x[0] += x[1], then hadd twice; the tail in float */
    const int64_t np = n & ~(int64_t)31;
    __m128 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm_setzero_ps();
    for (int64_t i = 0; i < np; i += 32)
        for (int j = 0; j < 8; j++)
            a[j] = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(x + i + 4 * j), _mm_loadu_ps(y + i + 4 * j)), a[j]);
    for (int j = 0; j < 4; j++) a[j] = _mm_add_ps(a[j], a[j + 4]);
    for (int j = 0; j < 2; j++) a[j] = _mm_add_ps(a[j], a[j + 2]);
    a[0] = _mm_add_ps(a[0], a[1]);
    const __m128 t0 = _mm_hadd_ps(a[0], a[0]);
    float sum = _mm_cvtss_f32(_mm_hadd_ps(t0, t0));
    for (int64_t i = np; i < n; i++) sum = sum + x[i] * y[i];
    return sum;
#else
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * y[i]);
    return (float)sum;
#endif
}

#if defined(HI_VNNI)
/* ggml_v_expf, AVX-512 */
HI_INLINE __m512 hi_ggml_v_expf(__m512 x) {
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
    const __m512 n = _mm512_sub_ps(z, r);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __mmask16 d = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                        _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
        u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
    const __m512 res = _mm512_scalef_ps(j, n);
    if (_mm512_kortestz(d, d)) return res;
    const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                            _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
    return _mm512_mask_blend_ps(d, res, alt);
}
#elif defined(HI_AVX2)
/* ggml_v_expf, AVX2 + FMA */
HI_INLINE __m256 hi_ggml_v_expf(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256i c = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(126), _CMP_GT_OQ));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(c))) return _mm256_fmadd_ps(j, k, k);
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32((int)0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256i d = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(192), _CMP_GT_OQ));
    return _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
                        _mm256_andnot_ps(_mm256_castsi256_ps(d),
                                         _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                                      _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}
#endif

#if defined(HI_SSE_EXP)
/* ggml_v_expf, SSE2 without FMA (MADD128: a product, then a sum) */
#define HI_MADD4(x, y, z) _mm_add_ps(_mm_mul_ps(x, y), z)
#define HI_NMADD4(x, y, z) _mm_sub_ps(z, _mm_mul_ps(x, y))
HI_INLINE __m128 hi_ggml_v_expf4(__m128 x) {
    const __m128 r = _mm_set1_ps(0x1.8p23f);
    const __m128 z = HI_MADD4(x, _mm_set1_ps(0x1.715476p+0f), r);
    const __m128 n = _mm_sub_ps(z, r);
    const __m128 b = HI_NMADD4(n, _mm_set1_ps(0x1.7f7d1cp-20f), HI_NMADD4(n, _mm_set1_ps(0x1.62e4p-1f), x));
    const __m128i e = _mm_slli_epi32(_mm_castps_si128(z), 23);
    const __m128 k = _mm_castsi128_ps(_mm_add_epi32(e, _mm_castps_si128(_mm_set1_ps(1))));
    const __m128i c = _mm_castps_si128(_mm_cmpgt_ps(_mm_andnot_ps(_mm_set1_ps(-0.f), n), _mm_set1_ps(126)));
    const __m128 u = _mm_mul_ps(b, b);
    const __m128 j = HI_MADD4(HI_MADD4(HI_MADD4(_mm_set1_ps(0x1.0e4020p-7f), b, _mm_set1_ps(0x1.573e2ep-5f)), u,
                                       HI_MADD4(_mm_set1_ps(0x1.555e66p-3f), b, _mm_set1_ps(0x1.fffdb6p-2f))),
                              u, _mm_mul_ps(_mm_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm_movemask_epi8(c)) return HI_MADD4(j, k, k);
    const __m128i g = _mm_and_si128(_mm_castps_si128(_mm_cmple_ps(n, _mm_setzero_ps())), _mm_set1_epi32((int)0x82000000u));
    const __m128 s1 = _mm_castsi128_ps(_mm_add_epi32(g, _mm_set1_epi32(0x7f000000)));
    const __m128 s2 = _mm_castsi128_ps(_mm_sub_epi32(e, g));
    const __m128i d = _mm_castps_si128(_mm_cmpgt_ps(_mm_andnot_ps(_mm_set1_ps(-0.f), n), _mm_set1_ps(192)));
    return _mm_or_ps(_mm_and_ps(_mm_castsi128_ps(d), _mm_mul_ps(s1, s1)),
                     _mm_andnot_ps(_mm_castsi128_ps(d),
                                   _mm_or_ps(_mm_and_ps(_mm_castsi128_ps(c), _mm_mul_ps(HI_MADD4(s2, j, s2), s1)),
                                             _mm_andnot_ps(_mm_castsi128_ps(c), HI_MADD4(k, j, k)))));
}
#undef HI_MADD4
#undef HI_NMADD4
#endif

/* p[0..n) <- softmax(w * scale) over the first n entries of w (ggml_soft_max_ext + ggml_vec_soft_max_f32);
 * w has room for n rounded up to HI_AW (the pad is overwritten) */
HI_INLINE void hi_ggml_softmax(float *w, int64_t n, float scale) {
    float max = -INFINITY;
    for (int64_t s = 0; s < n; s++) {
        w[s] *= scale;
        max = w[s] > max ? w[s] : max;
    }
    double sum = 0.0;
#if defined(HI_VNNI) || defined(HI_AVX2)
    const int64_t npad = (n + HI_AW - 1) / HI_AW * HI_AW;
    for (int64_t s = n; s < npad; s++) w[s] = -INFINITY;
    for (int64_t s = 0; s < npad; s += HI_AW) {
#if defined(HI_VNNI)
        const __m512 val = hi_ggml_v_expf(_mm512_sub_ps(_mm512_loadu_ps(w + s), _mm512_set1_ps(max)));
        _mm512_storeu_ps(w + s, val);
        sum += (double)_mm512_reduce_add_ps(val);
#else
        const __m256 val = hi_ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(w + s), _mm256_set1_ps(max)));
        _mm256_storeu_ps(w + s, val);
        __m128 v2 = _mm_add_ps(_mm256_extractf128_ps(val, 1), _mm256_castps256_ps128(val));
        v2 = _mm_add_ps(v2, _mm_movehl_ps(v2, v2));
        v2 = _mm_add_ss(v2, _mm_movehdup_ps(v2));
        sum += (double)_mm_cvtss_f32(v2);
#endif
    }
#elif defined(HI_SSE_EXP)
    /* 4 lanes padded with -inf (exact zeros, as llama.cpp's masked cells); each vector's sum without AVX:
     * (v0 + v1) + (v2 + v3) by shuffle, movehl, add_ss */
    const int64_t npad = (n + 3) & ~(int64_t)3;
    for (int64_t s = n; s < npad; s++) w[s] = -INFINITY;
    for (int64_t s = 0; s < npad; s += 4) {
        __m128 val = hi_ggml_v_expf4(_mm_sub_ps(_mm_loadu_ps(w + s), _mm_set1_ps(max)));
        _mm_storeu_ps(w + s, val);
        __m128 tmp = _mm_shuffle_ps(val, val, _MM_SHUFFLE(2, 3, 0, 1));
        val = _mm_add_ps(val, tmp);
        tmp = _mm_movehl_ps(tmp, val);
        val = _mm_add_ss(val, tmp);
        sum += (double)_mm_cvtss_f32(val);
    }
#else
    for (int64_t s = 0; s < n; s++) {
        w[s] = expf(w[s] - max);
        sum += (double)w[s];
    }
#endif
    const float inv = (float)(1.0 / sum);
    for (int64_t s = 0; s < n; s++) w[s] *= inv;
}

/* the horizontal sum over W lane rows (row l at a + l * hd) for every i < hd, in place: vec_dot's tree (dot = 1)
 * or tinyBLAS's, applied element by element (each step is a plain float add, so vectorizing along i changes no
 * bit); the result is row 0 */
HI_INLINE void hi_attn_hsum_rows(float *a, int64_t hd, int dot) {
#define HI_ROWADD(d, s) for (int64_t i = 0; i < hd; i++) a[(d) * hd + i] = a[(d) * hd + i] + a[(s) * hd + i]
#if defined(HI_VNNI)
    (void)dot; /* _mm512_reduce_add_ps: lanes l + 8, then l + 4, then (0 + 2) + (1 + 3) */
    for (int l = 0; l < 8; l++) HI_ROWADD(l, l + 8);
    for (int l = 0; l < 4; l++) HI_ROWADD(l, l + 4);
    HI_ROWADD(0, 2);
    HI_ROWADD(1, 3);
    HI_ROWADD(0, 1);
#elif defined(HI_AVX2)
    for (int l = 0; l < 4; l++) HI_ROWADD(l, l + 4);
    if (dot) { /* hadd twice: (0 + 1) + (2 + 3) */
        HI_ROWADD(0, 1);
        HI_ROWADD(2, 3);
        HI_ROWADD(0, 2);
    } else { /* movehl, movehdup: (0 + 2) + (1 + 3) */
        HI_ROWADD(0, 2);
        HI_ROWADD(1, 3);
        HI_ROWADD(0, 1);
    }
#elif defined(HI_SSSE3)
    (void)dot; /* hadd twice: (0 + 1) + (2 + 3) */
    HI_ROWADD(0, 1);
    HI_ROWADD(2, 3);
    HI_ROWADD(0, 2);
#else
    (void)a;
    (void)hd;
    (void)dot;
#endif
#undef HI_ROWADD
}

/* out[0..hd) = sum_s p[s] v[s] for s < n (row s at v + s * v_row), in three parts so that several query rows can
 * take the cache's rows block by block (hi_attn_run): pv_begin, pv_add over s in [s0, s1) for consecutive ranges
 * from 0 (each s lands in the accumulator its absolute index picks, so the ranges change no bit), pv_end.
 * acc: 4 * HI_AW * hd floats of scratch (8 * 4 * hd for the SSSE3 unit, 2 * hd doubles for the scalar unit) */
HI_INLINE void hi_pv_begin(int64_t hd, int tinyblas, float *acc) {
#if defined(HI_VNNI) || defined(HI_AVX2)
    memset(acc, 0, sizeof(float) * (size_t)((tinyblas ? 1 : 4) * HI_AW * hd));
#elif defined(HI_SSSE3)
    (void)tinyblas;
    memset(acc, 0, sizeof(float) * (size_t)(8 * 4 * hd));
#else
    (void)tinyblas;
    double *d = (double *)acc;
    for (int64_t i = 0; i < hd; i++) d[i] = 0.0;
#endif
}

HI_INLINE void hi_pv_add(const float *p, const float *v, int64_t v_row, int64_t s0, int64_t s1, int64_t hd,
                         int tinyblas, float *acc) {
#if defined(HI_VNNI) || defined(HI_AVX2)
    const int A = tinyblas ? 1 : 4;
    for (int64_t s = s0; s < s1; s++) {
        float *a = acc + ((s / HI_AW) % A * HI_AW + s % HI_AW) * hd;
        const float *vs = v + s * v_row, ps = p[s];
        for (int64_t i = 0; i < hd; i++) a[i] = fmaf(ps, vs[i], a[i]);
    }
#elif defined(HI_SSSE3)
    (void)tinyblas;
    for (int64_t s = s0; s < s1; s++) {
        float *a = acc + ((s / 4) % 8 * 4 + s % 4) * hd;
        const float *vs = v + s * v_row, ps = p[s];
        for (int64_t i = 0; i < hd; i++) a[i] = ps * vs[i] + a[i];
    }
#else
    (void)tinyblas;
    double *d = (double *)acc;
    for (int64_t s = s0; s < s1; s++)
        for (int64_t i = 0; i < hd; i++) d[i] += (double)(p[s] * v[s * v_row + i]);
#endif
}

HI_INLINE void hi_pv_end(int64_t hd, int tinyblas, float *acc, float *out) {
#if defined(HI_VNNI) || defined(HI_AVX2)
    if (!tinyblas) { /* (a0 + a2) + (a1 + a3), lane by lane */
        const int64_t L = HI_AW * hd;
        for (int64_t i = 0; i < L; i++) acc[i] = (acc[i] + acc[2 * L + i]) + (acc[L + i] + acc[3 * L + i]);
    }
    hi_attn_hsum_rows(acc, hd, !tinyblas);
    memcpy(out, acc, sizeof(float) * (size_t)hd);
#elif defined(HI_SSSE3)
    /* ggml_vec_dot_f32 over s (no tinyBLAS below AVX): 8 accumulators of 4 lanes, products rounded apart */
    (void)tinyblas;
    const int64_t L = 4 * hd;
    for (int j = 0; j < 4; j++)
        for (int64_t i = 0; i < L; i++) acc[j * L + i] = acc[j * L + i] + acc[(j + 4) * L + i];
    for (int j = 0; j < 2; j++)
        for (int64_t i = 0; i < L; i++) acc[j * L + i] = acc[j * L + i] + acc[(j + 2) * L + i];
    for (int64_t i = 0; i < L; i++) acc[i] = acc[i] + acc[L + i];
    hi_attn_hsum_rows(acc, hd, 1);
    memcpy(out, acc, sizeof(float) * (size_t)hd);
#else
    (void)tinyblas;
    const double *d = (const double *)acc;
    for (int64_t i = 0; i < hd; i++) out[i] = (float)d[i];
#endif
}

/* cache rows a block of query rows takes at a time: a block of K (or V) rows stays in L1/L2 while each of the rows
 * that share its K/V head reads it */
#define HI_ATTN_SB 64

/* query rows [r0, r1) of job a (row r: token r / H, head r % H), scratch of a->slots * hi_attn_scratch_row floats.
 * Consecutive rows of one token whose heads share a K/V head (up to a->slots of them) are computed together: each
 * block of the cache's K rows, then of its V rows, is read once for all of them, from cache, instead of once per
 * row from memory. Every row's own operations and their order are those of the row alone. */
static void hi_attn_run(const hi_attn *a, int64_t r0, int64_t r1, float *scratch) {
    const int64_t H = a->H, hd = a->hd, G = a->H / a->Hkv, R = a->slots > 0 ? a->slots : 1;
    const int64_t npad = (a->pos0 + a->T + 63) & ~(int64_t)63, accn = 4 * 16 * hd;
    const int tinyblas = a->T >= 2 && !a->rows1 && hd % 4 == 0;
    float *w = scratch, *acc = scratch + R * npad;
    for (int64_t r = r0; r < r1;) {
        const int64_t t = r / H, kvh = (r % H) / G, n = a->pos0 + t + 1;
        int64_t m = 1; /* rows in this run: the same token and K/V head */
        while (m < R && r + m < r1 && (r + m) / H == t && ((r + m) % H) / G == kvh) m++;
        const float *k = a->k + kvh * hd, *v = a->v + kvh * hd;
        for (int64_t s0 = 0; s0 < n; s0 += HI_ATTN_SB) {
            const int64_t s1 = s0 + HI_ATTN_SB < n ? s0 + HI_ATTN_SB : n;
            for (int64_t i = 0; i < m; i++) {
                const float *q = a->q + t * a->q_row + ((r + i) % H) * hd;
                float *wi = w + i * npad;
                for (int64_t s = s0; s < s1; s++) wi[s] = hi_ggml_dot_f32(k + s * a->kv_row, q, hd);
            }
        }
        for (int64_t i = 0; i < m; i++) {
            hi_ggml_softmax(w + i * npad, n, a->scale);
            hi_pv_begin(hd, tinyblas, acc + i * accn);
        }
        for (int64_t s0 = 0; s0 < n; s0 += HI_ATTN_SB) {
            const int64_t s1 = s0 + HI_ATTN_SB < n ? s0 + HI_ATTN_SB : n;
            for (int64_t i = 0; i < m; i++) hi_pv_add(w + i * npad, v, a->kv_row, s0, s1, hd, tinyblas, acc + i * accn);
        }
        for (int64_t i = 0; i < m; i++)
            hi_pv_end(hd, tinyblas, acc + i * accn, a->out + t * a->out_row + ((r + i) % H) * hd);
        r += m;
    }
}

/* floats of scratch one worker needs for a cache of n_ctx rows */
static int64_t hi_attn_scratch_row(int64_t n_ctx, int64_t hd) {
    return ((n_ctx + 63) & ~(int64_t)63) + 4 * 16 * hd;
}

/* ================================================================================================ */
/* SwiGLU, ggml_vec_swiglu_f32 of this ISA's build: out = silu(g) * u with silu(x) = x / (1 + expf(-x)), expf
 * ggml_v_expf a vector at a time (libm's expf for the n % W tail and in builds without SIMD). Here because it
 * shares ggml_v_expf with the softmax. */
static void hi_swiglu_row(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
#if defined(HI_VNNI)
    for (; i + 15 < n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = hi_ggml_v_expf(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
#elif defined(HI_AVX2)
    for (; i + 7 < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = hi_ggml_v_expf(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#elif defined(HI_SSE_EXP)
    for (; i + 3 < n; i += 4) {
        const __m128 x = _mm_loadu_ps(g + i);
        const __m128 e = hi_ggml_v_expf4(_mm_sub_ps(_mm_setzero_ps(), x));
        const __m128 s = _mm_div_ps(x, _mm_add_ps(_mm_set1_ps(1.0f), e));
        _mm_storeu_ps(out + i, _mm_mul_ps(s, _mm_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
}

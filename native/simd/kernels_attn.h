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
/* Attention over a typed K/V cache (f32, f16, q8_0, q4_0 rows: -ctk / -ctv) in the order of llama.cpp's CPU flash
 * attention (ggml_compute_forward_flash_attn_ext_f16_one_chunk, the path it takes for quantized K at any T), per
 * query row (token t, head h) over the cache positions s = 0 .. pos0 + t in order:
 *   Qv     = q converted to K's vec_dot_type once: f32 as is, fp16 for f16 K, q8_0 blocks (quantize_row_q8_0 of this
 *            ISA's build) for q8_0 / q4_0 K
 *   x      = vec_dot(K[s], Qv) * scale (+ 0.0f, the mask)
 *   x > M:   M = x, ms = expf(M_old - M), VKQ *= ms, vs = 1     else: vs = expf(x - M)
 *   VKQ   += V[s] * vs (a fused multiply-add where the build has FMA: the AVX2 and AVX-512 units; f16 V: VKQ is
 *            kept in fp16, each value rounded after every update, as ggml_vec_mad_f16 / ggml_vec_scale_f16)
 *   S      = S * ms + vs (one fused multiply-add where ggml-cpu's build contracts it: the AVX2 and AVX-512 units)
 *   out    = VKQ * (1 / S)
 * Every step but vec_dot is element by element, so only the dots depend on the vector width: q8_0 / q4_0 x q8_0 are
 * the products' dots (ggml_vec_dot_q8_0_q8_0 / q4_0_q8_0, AVX2's float shape), f32 ggml_vec_dot_f32 of this build,
 * f16 ggml_vec_dot_f16 in AVX2's shape (4 x 8 lanes over 32-value steps, the tail in double). llama.cpp takes another
 * order for f16 K/V with many query rows (its tiled kernel) or a long one-row decode (split over the context). */

HI_INLINE float hi_fa_mad(float acc, float x, float w) {
#if defined(HI_AVX2)
    return fmaf(x, w, acc);
#else
    return acc + x * w;
#endif
}

/* ggml_vec_dot_f16 of two fp16 rows in AVX2's shape: lane j = i % 32 takes the products of elements i (fused), then
 * lanes (j, j + 8, j + 16, j + 24) as (a0 + a2) + (a1 + a3), then l and l + 4, then hadd twice */
HI_INLINE float hi_fa_dot_f16(const uint16_t *x, const uint16_t *y, int64_t n) {
    float a[32] = {0};
    const int64_t np = n & ~(int64_t)31;
#if defined(HI_AVX2)
    { /* the same lanes in vectors: F16C's conversions are the exact ones, each lane one fused multiply-add */
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < np; i += 32)
            for (int k = 0; k < 4; k++)
                acc[k] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i + 8 * k))),
                                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(y + i + 8 * k))), acc[k]);
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(a + 8 * k, acc[k]);
    }
#else
    for (int64_t i = 0; i < np; i += 32)
        for (int j = 0; j < 32; j++) a[j] = hi_fa_mad(a[j], hi_h2f(x[i + j]), hi_h2f(y[i + j]));
#endif
    float r[8], t[4];
    for (int l = 0; l < 8; l++) r[l] = (a[l] + a[16 + l]) + (a[8 + l] + a[24 + l]);
    for (int l = 0; l < 4; l++) t[l] = r[l] + r[l + 4];
    double sum = (double)((t[0] + t[1]) + (t[2] + t[3]));
    for (int64_t i = np; i < n; i++) sum += (double)(hi_h2f(x[i]) * hi_h2f(y[i]));
    return (float)sum;
}

/* ggml_vec_scale_f16 by ms (where ms != 1) then ggml_vec_mad_f16 of v by vs on an fp16 accumulator y of hd values:
 * each value rounded to fp16 after each step (F16C's conversions where the unit has them: the same bits) */
HI_INLINE void hi_fa_mad_f16(uint16_t *y, const uint16_t *v, int64_t hd, float ms, float vs) {
    int64_t e = 0;
#if defined(HI_AVX2)
    const __m256 m = _mm256_set1_ps(ms), w = _mm256_set1_ps(vs);
    for (; e + 8 <= hd; e += 8) {
        __m128i yh = _mm_loadu_si128((const __m128i *)(y + e));
        if (ms != 1.0f) yh = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_cvtph_ps(yh), m), _MM_FROUND_TO_NEAREST_INT);
        const __m256 vv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + e)));
        _mm_storeu_si128((__m128i *)(y + e),
                         _mm256_cvtps_ph(_mm256_fmadd_ps(vv, w, _mm256_cvtph_ps(yh)), _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; e < hd; e++) {
        uint16_t t = y[e];
        if (ms != 1.0f) t = hi_f2h(hi_h2f(t) * ms);
        y[e] = hi_f2h(hi_fa_mad(hi_h2f(t), hi_h2f(v[e]), vs));
    }
}

/* a q8_0 / q4_0 row of nb blocks against the query's q8_0 row prepared by hi_prep (the products' tile, one row) */
HI_INLINE float hi_fa_dot_legacy(const int qt, const uint8_t *w, const uint8_t *xq, const int32_t *corr,
                                 const float *dy, int64_t nb) {
    const int bs = hi_wbs(qt), need_corr = HI_CORR(qt) != 0;
    hi_fv acc = hi_fzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bs;
        const hi_iv nc = need_corr ? hi_load_corr(corr + 8 * b) : hi_izero();
        acc = hi_fmadd8(hi_h2f(hi_rd16(blk)) * dy[b], hi_lanes(qt, hi_load_w(qt, blk), hi_load_y(xq + b * 34 + 2), nc),
                        acc);
    }
    return hi_hsum8(acc);
}

/* one value row of type vt (hd values) -> float (ggml's to_float: q8_0 q * d, q4_0 (q - 8) * d, f16 exact) */
HI_INLINE void hi_fa_v_float(const int vt, const uint8_t *v, float *out, int64_t hd) {
    if (vt == HI_T_F32) {
        memcpy(out, v, sizeof(float) * (size_t)hd);
    } else if (vt == HI_T_F16) {
        int64_t i = 0;
#if defined(HI_AVX2)
        for (; i + 8 <= hd; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + 2 * i))));
#endif
        for (; i < hd; i++) out[i] = hi_h2f(hi_rd16(v + 2 * i));
    } else if (vt == HI_T_Q8_0) {
        for (int64_t b = 0; b < hd / 32; b++) {
            const uint8_t *blk = v + b * 34;
            const float d = hi_h2f(hi_rd16(blk));
            for (int j = 0; j < 32; j++) out[32 * b + j] = (float)(int8_t)blk[2 + j] * d;
        }
    } else if (hi_is_lm(vt)) {
        const int64_t bs = vt == HI_T_LM3 ? HI_LM3_BYTES : HI_LM4_BYTES;
        for (int64_t b = 0; b < hd / 32; b++) hi_lm_decode(vt, v + b * bs, out + 32 * b);
    } else { /* q4_0 */
        for (int64_t b = 0; b < hd / 32; b++) {
            const uint8_t *blk = v + b * 18;
            const float d = hi_h2f(hi_rd16(blk));
            for (int j = 0; j < 16; j++) {
                out[32 * b + j] = (float)((blk[2 + j] & 0x0F) - 8) * d;
                out[32 * b + j + 16] = (float)((blk[2 + j] >> 4) - 8) * d;
            }
        }
    }
}

/* floats of scratch a unit of m rows sharing a K/V head needs (hi_attn_fa_run) */
/* K row ks (k32: it taken back to float, for a Lloyd-Max type) . query q (qv, corr, dy: as hi_fa_query made them) */
HI_INLINE float hi_fa_dot(int kt, const uint8_t *ks, const float *k32, const float *q, const uint8_t *qv,
                          const int32_t *corr, const float *dy, int64_t hd) {
    if (kt == HI_T_F32) return hi_ggml_dot_f32((const float *)ks, q, hd);
    if (hi_is_lm(kt)) return hi_ggml_dot_f32(k32, q, hd);
    if (kt == HI_T_F16) return hi_fa_dot_f16((const uint16_t *)ks, (const uint16_t *)qv, hd);
    return hi_fa_dot_legacy(kt, ks, qv, corr, dy, hd / 32);
}

/* a query row converted once to K's vec_dot type: fp16 for f16 K, q8_0 blocks (with their dot's per-block data) for
 * q8_0 / q4_0 K; f32 and Lloyd-Max K read q itself */
HI_INLINE void hi_fa_query(int kt, const float *q, int64_t hd, uint8_t *qv, int32_t *corr, float *dy) {
    if (kt == HI_T_F16) {
        for (int64_t e = 0; e < hd; e++) ((uint16_t *)qv)[e] = hi_f2h(q[e]);
    } else if (kt == HI_T_Q8_0 || kt == HI_T_Q4_0) {
        hi_quantize(HI_ACT_Q8_0, q, hd, qv);
        hi_prep(kt, qv, hd / 32, corr, dy, NULL);
    }
}

#define HI_FA_TILE 64 /* positions a tile of hi_attn_fa_tiled (below) */

static int64_t hi_attn_fa_scratch(int64_t hd, int64_t m) {
    const int64_t one = m * (3 * hd + 8) + 2 * hd + 64; /* hi_attn_fa_run's layout, then hi_attn_fa_tiled's */
    const int64_t tiled = m * (3 * hd + 8 + HI_FA_TILE) + (HI_FA_TILE + 1) * hd + 64;
    return one > tiled ? one : tiled;
}

/* rows h0 .. h0 + m - 1 of token t (query heads sharing one K/V head) over cache positions [s0, s1): each row's
 * operations and their order are those of the row alone, so how rows are grouped changes no bit; every K row is
 * read once for the m rows and every V row converted once. part == NULL: the rows' outputs (VKQ / S); else each
 * row's (M, S, VKQ[hd]) at part + i * part_row, as llama.cpp's split decode writes its partials (VKQ in float). */
static void hi_attn_fa_run(const hi_attn *a, int64_t t, int64_t h0, int64_t m, int64_t s0, int64_t s1,
                           float *scratch, float *part, int64_t part_row) {
    const int64_t hd = a->hd, G = a->H / a->Hkv, nb = hd / 32, g = h0 / G, row = 3 * hd + 8;
    const int kt = a->k_type, vt = a->v_type;
    const int64_t kh = a->k_bytes / a->Hkv, vh = a->v_bytes / a->Hkv;
    float *v32 = scratch + m * row, *k32 = v32 + hd, M[HI_FA_MAXG], S[HI_FA_MAXG];
    /* per row: vkq [hd] | vkq16 [hd / 2] | qv [hd] (f32 q, fp16 q or q8_0 blocks) | dy [nb] | corr [hd / 4] */
#define HI_FA_VKQ(i) (scratch + (i) * row)
#define HI_FA_VKQ16(i) ((uint16_t *)(scratch + (i) * row + hd))
#define HI_FA_QV(i) ((uint8_t *)(scratch + (i) * row + hd + hd / 2))
#define HI_FA_DY(i) (scratch + (i) * row + 2 * hd + hd / 2)
#define HI_FA_CORR(i) ((int32_t *)(scratch + (i) * row + 2 * hd + hd / 2 + nb))
    for (int64_t i = 0; i < m; i++) {
        hi_fa_query(kt, a->q + t * a->q_row + (h0 + i) * hd, hd, HI_FA_QV(i), HI_FA_CORR(i), HI_FA_DY(i));
        S[i] = 0.0f;
        M[i] = -INFINITY;
        if (vt == HI_T_F16) memset(HI_FA_VKQ16(i), 0, sizeof(uint16_t) * (size_t)hd);
        else memset(HI_FA_VKQ(i), 0, sizeof(float) * (size_t)hd);
    }
    const uint8_t *kb = (const uint8_t *)a->k + g * kh, *vb = (const uint8_t *)a->v + g * vh;
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *ks = kb + s * a->k_bytes, *vs_row = vb + s * a->v_bytes;
        const float *vf = (const float *)vs_row;
        if (vt != HI_T_F32 && vt != HI_T_F16) {
            hi_fa_v_float(vt, vs_row, v32, hd);
            vf = v32;
        }
        if (hi_is_lm(kt)) hi_fa_v_float(kt, ks, k32, hd); /* no integer dot for Lloyd-Max codes: K in float */
        for (int64_t i = 0; i < m; i++) {
            float x = hi_fa_dot(kt, ks, k32, a->q + t * a->q_row + (h0 + i) * hd, HI_FA_QV(i), HI_FA_CORR(i),
                                HI_FA_DY(i), hd);
            x = x * a->scale;
            x += 0.0f;
            const float Mold = M[i];
            float ms = 1.0f, vs = 1.0f;
            if (x > M[i]) {
                M[i] = x;
                ms = expf(Mold - x);
            } else {
                vs = expf(x - M[i]);
            }
            if (vt == HI_T_F16) {
                hi_fa_mad_f16(HI_FA_VKQ16(i), (const uint16_t *)vs_row, hd, ms, vs);
            } else {
                float *y = HI_FA_VKQ(i);
                if (ms != 1.0f)
                    for (int64_t e = 0; e < hd; e++) y[e] *= ms;
                for (int64_t e = 0; e < hd; e++) y[e] = hi_fa_mad(y[e], vf[e], vs);
            }
            S[i] = hi_fa_mad(vs, S[i], ms); /* contracted where the build has FMA, as ggml-cpu compiles S*ms + vs */
        }
    }
    for (int64_t i = 0; i < m; i++) {
        float *y = HI_FA_VKQ(i);
        if (vt == HI_T_F16)
            for (int64_t e = 0; e < hd; e++) y[e] = hi_h2f(HI_FA_VKQ16(i)[e]);
        if (part) {
            float *p = part + i * part_row;
            p[0] = M[i];
            p[1] = S[i];
            memcpy(p + 2, y, sizeof(float) * (size_t)hd);
        } else {
            const float S_inv = S[i] == 0.0f ? 0.0f : 1.0f / S[i];
            float *o = a->out + t * a->out_row + (h0 + i) * hd;
            for (int64_t e = 0; e < hd; e++) o[e] = y[e] * S_inv;
        }
    }
#undef HI_FA_VKQ
#undef HI_FA_VKQ16
#undef HI_FA_QV
#undef HI_FA_DY
#undef HI_FA_CORR
}

/* ---- a chunk of a long row (attn.c splits rows over more than HI_FA_SPLIT positions; their bits follow llama.cpp's
 * split decode, not its one pass, already): tiles of HI_FA_TILE positions, every score of a tile first (each K row
 * converted or dotted once for the m rows), then per row one rescale by the tile's maximum, the tile's exps in
 * vectors, and VKQ += sum_s p[s] V[s] over the tile with the accumulators a vector register block at a time (V
 * converted to float once a tile for the m rows); VKQ in float for every V type. Writes each row's partial
 * (M, S, VKQ). The operations depend only on the unit's ISA, the tile and the rows' values. */

/* p[0..n) <- expf(p - M) (a vector at a time where the unit has ggml's vector exp); returns their sum in order */
HI_INLINE float hi_fa_exps(float *p, int64_t n, float M) {
    int64_t s = 0;
#if defined(HI_VNNI)
    for (; s + 16 <= n; s += 16)
        _mm512_storeu_ps(p + s, hi_ggml_v_expf(_mm512_sub_ps(_mm512_loadu_ps(p + s), _mm512_set1_ps(M))));
#elif defined(HI_AVX2)
    for (; s + 8 <= n; s += 8)
        _mm256_storeu_ps(p + s, hi_ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(p + s), _mm256_set1_ps(M))));
#elif defined(HI_SSE_EXP)
    for (; s + 4 <= n; s += 4) _mm_storeu_ps(p + s, hi_ggml_v_expf4(_mm_sub_ps(_mm_loadu_ps(p + s), _mm_set1_ps(M))));
#endif
    for (; s < n; s++) p[s] = expf(p[s] - M);
    float sum = 0.0f;
    for (s = 0; s < n; s++) sum += p[s];
    return sum;
}

/* acc[0..hd) = acc * ms + sum_j p[j] v[j] over a tile's n V rows (row j at v + j * hd), a block of accumulators held
 * in registers while the rows go by (hd a multiple of 32) */
HI_INLINE void hi_fa_tile_pv(float *acc, float ms, const float *p, const float *v, int64_t n, int64_t hd) {
#if defined(HI_VNNI)
    for (int64_t e0 = 0; e0 < hd; e0 += 64) {
        const __m512 m = _mm512_set1_ps(ms);
        __m512 r0 = _mm512_mul_ps(_mm512_loadu_ps(acc + e0), m), r1 = _mm512_mul_ps(_mm512_loadu_ps(acc + e0 + 16), m);
        __m512 r2, r3;
        const int wide = e0 + 64 <= hd;
        r2 = wide ? _mm512_mul_ps(_mm512_loadu_ps(acc + e0 + 32), m) : _mm512_setzero_ps();
        r3 = wide ? _mm512_mul_ps(_mm512_loadu_ps(acc + e0 + 48), m) : _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            const float *vj = v + j * hd + e0;
            r0 = _mm512_fmadd_ps(_mm512_loadu_ps(vj), pj, r0);
            r1 = _mm512_fmadd_ps(_mm512_loadu_ps(vj + 16), pj, r1);
            if (wide) {
                r2 = _mm512_fmadd_ps(_mm512_loadu_ps(vj + 32), pj, r2);
                r3 = _mm512_fmadd_ps(_mm512_loadu_ps(vj + 48), pj, r3);
            }
        }
        _mm512_storeu_ps(acc + e0, r0);
        _mm512_storeu_ps(acc + e0 + 16, r1);
        if (wide) {
            _mm512_storeu_ps(acc + e0 + 32, r2);
            _mm512_storeu_ps(acc + e0 + 48, r3);
        }
    }
#elif defined(HI_AVX2)
    for (int64_t e0 = 0; e0 < hd; e0 += 32) {
        const __m256 m = _mm256_set1_ps(ms);
        __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0), m), r1 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0 + 8), m);
        __m256 r2 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0 + 16), m), r3 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0 + 24), m);
        for (int64_t j = 0; j < n; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *vj = v + j * hd + e0;
            r0 = _mm256_fmadd_ps(_mm256_loadu_ps(vj), pj, r0);
            r1 = _mm256_fmadd_ps(_mm256_loadu_ps(vj + 8), pj, r1);
            r2 = _mm256_fmadd_ps(_mm256_loadu_ps(vj + 16), pj, r2);
            r3 = _mm256_fmadd_ps(_mm256_loadu_ps(vj + 24), pj, r3);
        }
        _mm256_storeu_ps(acc + e0, r0);
        _mm256_storeu_ps(acc + e0 + 8, r1);
        _mm256_storeu_ps(acc + e0 + 16, r2);
        _mm256_storeu_ps(acc + e0 + 24, r3);
    }
#else
    for (int64_t e0 = 0; e0 < hd; e0 += 32) {
        float r[32];
        for (int e = 0; e < 32; e++) r[e] = acc[e0 + e] * ms;
        for (int64_t j = 0; j < n; j++)
            for (int e = 0; e < 32; e++) r[e] = r[e] + v[j * hd + e0 + e] * p[j];
        for (int e = 0; e < 32; e++) acc[e0 + e] = r[e];
    }
#endif
}


static void hi_attn_fa_tiled(const hi_attn *a, int64_t t, int64_t h0, int64_t m, int64_t s0, int64_t s1,
                             float *scratch, float *part, int64_t part_row) {
    const int64_t hd = a->hd, G = a->H / a->Hkv, nb = hd / 32, g = h0 / G, row = 3 * hd + 8 + HI_FA_TILE;
    const int kt = a->k_type, vt = a->v_type;
    const int64_t kh = a->k_bytes / a->Hkv, vh = a->v_bytes / a->Hkv;
    float *vtile = scratch + m * row, *k32 = vtile + HI_FA_TILE * hd, M[HI_FA_MAXG], S[HI_FA_MAXG];
    /* per row: acc [hd] | qv [hd] | dy [nb] | corr [hd / 4] | scores [HI_FA_TILE] */
#define HI_T_ACC(i) (scratch + (i) * row)
#define HI_T_QV(i) ((uint8_t *)(scratch + (i) * row + hd))
#define HI_T_DY(i) (scratch + (i) * row + 2 * hd)
#define HI_T_CORR(i) ((int32_t *)(scratch + (i) * row + 2 * hd + nb))
#define HI_T_SC(i) (scratch + (i) * row + 2 * hd + nb + hd / 4 + 8)
    for (int64_t i = 0; i < m; i++) {
        hi_fa_query(kt, a->q + t * a->q_row + (h0 + i) * hd, hd, HI_T_QV(i), HI_T_CORR(i), HI_T_DY(i));
        M[i] = -INFINITY;
        S[i] = 0.0f;
        memset(HI_T_ACC(i), 0, sizeof(float) * (size_t)hd);
    }
    const uint8_t *kb = (const uint8_t *)a->k + g * kh, *vb = (const uint8_t *)a->v + g * vh;
    for (int64_t p0 = s0; p0 < s1; p0 += HI_FA_TILE) {
        const int64_t n = s1 - p0 < HI_FA_TILE ? s1 - p0 : HI_FA_TILE;
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *ks = kb + (p0 + j) * a->k_bytes;
            if (hi_is_lm(kt)) hi_fa_v_float(kt, ks, k32, hd);
            for (int64_t i = 0; i < m; i++)
                HI_T_SC(i)[j] = hi_fa_dot(kt, ks, k32, a->q + t * a->q_row + (h0 + i) * hd, HI_T_QV(i), HI_T_CORR(i),
                                          HI_T_DY(i), hd) * a->scale;
            hi_fa_v_float(vt, vb + (p0 + j) * a->v_bytes, vtile + j * hd, hd);
        }
        for (int64_t i = 0; i < m; i++) {
            float *sc = HI_T_SC(i), mt = -INFINITY;
            for (int64_t j = 0; j < n; j++) mt = sc[j] > mt ? sc[j] : mt;
            const float Mn = mt > M[i] ? mt : M[i], ms = expf(M[i] - Mn);
            S[i] = S[i] * ms + hi_fa_exps(sc, n, Mn);
            M[i] = Mn;
            hi_fa_tile_pv(HI_T_ACC(i), ms, sc, vtile, n, hd);
        }
    }
    for (int64_t i = 0; i < m; i++) {
        float *pr = part + i * part_row;
        pr[0] = M[i];
        pr[1] = S[i];
        memcpy(pr + 2, HI_T_ACC(i), sizeof(float) * (size_t)hd);
    }
#undef HI_T_ACC
#undef HI_T_QV
#undef HI_T_DY
#undef HI_T_CORR
#undef HI_T_SC
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

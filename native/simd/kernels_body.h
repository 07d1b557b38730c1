/* Kernel bodies, compiled once per ISA level by the thin units isa_scalar.c, isa_ssse3.c, isa_avx2.c and
 * isa_avx512vnni.c (each sets its target with `#pragma GCC target` before including this file; the
 * branches below follow the ISA macros that pragma defines).
 *
 * The maths (ggml's, as llama.cpp computes it on an x86 host with AVX2 or better):
 *
 * Activation quantizers, per 32-value block (Q8_0, Q8_1):
 *     amax = max |x_i|,  d = amax / 127,  id = (amax != 0) ? 127 / amax : 0   (float32, two divisions)
 *     q_i = round_half_even(x_i * id)          (the x86 build's _mm256_round_ps; NOT roundf)
 *     stored d = fp16(d) (round to nearest even); Q8_1 also s = fp16(d * sum_i q_i)  (d unrounded)
 * Q8_K, per 256-value block (ggml's quantize_row_q8_K_ref, used by every x86 build):
 *     j = first index with |x_j| = amax;  iscale = -127 / x_j;  q_i = min(127, round_half_even(iscale*x_i))
 *     d = 1 / iscale (float32, may be negative);  bsums[g] = sum of q over elements 16g..16g+15;
 *     amax = 0 gives d = 0, q = 0, bsums = 0.
 * F16 activations: fp16(x_i) (round to nearest even). F32 activations: x itself.
 *
 * Dot product of weight block (d_w, [m_w,] q_w) with activation block (d_a, [s_a,] q_a), 32 elements,
 * in 8 integer lanes of 4 consecutive elements each (element j: j < 16 the low nibble of qs[j], j >= 16
 * the high nibble of qs[j-16]; Q5 types add bit j of qh as bit 4):
 *     lane_k = sum_{j=4k}^{4k+3} w_j * q_a,j       exact int32, w_j = q-8 (Q4_0), q-16 (Q5_0), q (others)
 *     acc_k  = fma(d_w * d_a, (float)lane_k, acc_k)      (d_w * d_a one float product, exact)
 *     summs  = fma(m_w, s_a, summs)                       (Q4_1, Q5_1 only)
 *     row    = hsum8(acc) [+ summs],  hsum8(a) = ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))
 * which are exactly the float operations of ggml_vec_dot_*_q8_* on AVX2, so the AVX2, AVX-512 and scalar
 * (fmaf) paths equal ggml's results bit for bit. The SSSE3 path (hosts without FMA) does the same with a
 * separate multiply and add, so its floats may differ in the last bits; its integers are the same.
 * How the lanes are formed differs by ISA but never changes their value:
 *     SSSE3/AVX2: pmaddubsw(unsigned q, q_a) + pmaddwd(1) - c * (sum of the 4 q_a), c = 8 (Q4_0), 16 (Q5_0),
 *                 with the per-lane activation sums precomputed once per call (`prep`);
 *                 Q8_0 weights: pmaddubsw(|w|, sign(q_a, w)) as ggml (no int16 overflow: |pair| <= 32512);
 *     AVX-512 VNNI: vpdpbusd(-c * sums, unsigned q, q_a), Q8_0 with w + 128 and c = 128;
 *     scalar: plain int loops on signed values.
 * F32 / F16 weights: 4 x 8 float lanes over 32-element steps (lane (k, l) takes elements 32i + 8k + l),
 *     acc = fma(w, x, acc); reduce (a0+a2) + (a1+a3), then lanes l and l+4, then pairs (hadd twice);
 *     the n % 32 tail is added in double, products in float (ggml's ggml_vec_dot_f16 shape).
 * K-quants (Q4_K, Q5_K, Q6_K x Q8_K): hi_dot_q*_K_q8_K from dot_kquants.h (its first comment has the maths).
 *
 * A matrix product is this dot for every (weight row, activation row) pair; tiles of R rows x C tokens
 * share loads (and convert the R rows' fp16 scales together), a token block of HI_TB rows keeps the
 * activations in cache while the rows of a work chunk are swept, so each weight row is read from memory
 * once per block of tokens; the next tile's rows are software-prefetched as one linear stream.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "hi_internal.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define HI_VNNI 1
#endif
#if defined(__AVX2__)
#if !defined(__FMA__) || !defined(__F16C__)
#error "the AVX2 unit needs FMA and F16C"
#endif
#define HI_AVX2 1
#elif defined(__SSSE3__)
#define HI_SSSE3 1
#else
#define HI_SCALAR 1
#endif

#if defined(HI_AVX2) || defined(HI_SSSE3)
#include <immintrin.h>
#endif

#include "dot_kquants.h"

#define HI_INLINE static inline __attribute__((always_inline))
#define HI_UNROLL _Pragma("GCC unroll 8")

/* tile shapes: RV rows for one token (GEMV); RG rows x CG tokens for several tokens; HI_TB tokens a block */
#if defined(HI_VNNI)
#define HI_RV 4
#define HI_RG 4
#define HI_CG 4
#elif defined(HI_AVX2)
#define HI_RV 4
#define HI_RG 2
#define HI_CG 2
#elif defined(HI_SSSE3)
#define HI_RV 4
#define HI_RG 2
#define HI_CG 2
#else
#define HI_RV 1
#define HI_RG 1
#define HI_CG 1
#endif
#define HI_TB 32
#define HI_MAXR 4
#define HI_MAXC 4

/* ================================================================================================ */
/* fp16 */

#if defined(HI_AVX2)
HI_INLINE float hi_h2f(uint16_t h) { return _cvtsh_ss(h); }
HI_INLINE uint16_t hi_f2h(float f) { return (uint16_t)_cvtss_sh(f, 0); }
#else
HI_INLINE float hi_h2f(uint16_t h) { return hi_h2f_soft(h); }
HI_INLINE uint16_t hi_f2h(float f) { return hi_f2h_soft(f); }
#endif

HI_INLINE uint16_t hi_rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
HI_INLINE uint32_t hi_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* ================================================================================================ */
/* activation quantizers */

#if defined(HI_AVX2)

HI_INLINE float hi_hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

HI_INLINE int hi_hsum_i32_8(__m256i a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 4 x 8 int32 (already in int8 range) -> 32 int8 in order */
HI_INLINE __m256i hi_pack32(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    return _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void hi_quant_q8_01(const float *x, int64_t n, uint8_t *y, int with_s) {
    const int64_t nb = n / 32;
    const size_t bs = with_s ? sizeof(block_q8_1) : sizeof(block_q8_0);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += 32, y += bs) {
        __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        __m256 ma = _mm256_andnot_ps(sign, v0);
        ma = _mm256_max_ps(ma, _mm256_andnot_ps(sign, v1));
        ma = _mm256_max_ps(ma, _mm256_andnot_ps(sign, v2));
        ma = _mm256_max_ps(ma, _mm256_andnot_ps(sign, v3));
        const float amax = hi_hmax8(ma);
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        const __m256 mul = _mm256_set1_ps(id);
        /* cvtps_epi32 rounds by MXCSR: to nearest even, as _mm256_round_ps(_MM_ROUND_NEAREST) */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, mul));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, mul));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, mul));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, mul));
        const uint16_t dh = hi_f2h(d);
        memcpy(y, &dh, 2);
        if (with_s) {
            const int sum = hi_hsum_i32_8(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
            const uint16_t sh = hi_f2h(d * (float)sum);
            memcpy(y + 2, &sh, 2);
        }
        _mm256_storeu_si256((__m256i *)(y + bs - 32), hi_pack32(i0, i1, i2, i3));
    }
}

/* ggml's nearest_int on 8 floats (v + 1.5*2^23, low 23 bits - 2^22), then MIN(127, .) and the int8 store
 * (truncation to the low byte, as C's conversion does), sign-extended back to int32 */
HI_INLINE __m256i hi_q8k_round(__m256 v) {
    const __m256i b = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(12582912.f)));
    __m256i i = _mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x00400000));
    i = _mm256_min_epi32(i, _mm256_set1_epi32(127));
    return _mm256_srai_epi32(_mm256_slli_epi32(i, 24), 24);
}

static void hi_quant_q8_K(const float *x, int64_t n, uint8_t *yv) {
    block_q8_K *y = (block_q8_K *)yv;
    const int64_t nb = n / 256;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += 256) {
        __m256 ma = _mm256_setzero_ps();
        /* max(|x|, ma): a NaN |x| leaves ma, as ggml's strict `ax > amax` scan skips NaN */
        for (int j = 0; j < 256; j += 8) ma = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), ma);
        const float amax = hi_hmax8(ma);
        if (!(amax > 0.0f)) {
            memset(&y[i], 0, sizeof(block_q8_K));
            continue;
        }
        const __m256 vmax = _mm256_set1_ps(amax);
        int jm = 0;
        for (int j = 0; j < 256; j += 8) {
            const int mk = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), vmax, _CMP_EQ_OQ));
            if (mk) { jm = j + __builtin_ctz((unsigned)mk); break; }
        }
        const float iscale = -127.f / x[jm];
        const __m256 mul = _mm256_set1_ps(iscale);
        for (int j = 0; j < 256; j += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++) q[k] = hi_q8k_round(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), mul));
            _mm256_storeu_si256((__m256i *)(y[i].qs + j), hi_pack32(q[0], q[1], q[2], q[3]));
            y[i].bsums[j / 16] = (int16_t)hi_hsum_i32_8(_mm256_add_epi32(q[0], q[1]));
            y[i].bsums[j / 16 + 1] = (int16_t)hi_hsum_i32_8(_mm256_add_epi32(q[2], q[3]));
        }
        y[i].d = 1 / iscale;
    }
}

static void hi_quant_f16(const float *x, int64_t n, uint16_t *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), 0));
    for (; i < n; i++) y[i] = hi_f2h(x[i]);
}

#elif defined(HI_SSSE3)

HI_INLINE float hi_hmax4(__m128 m) {
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

HI_INLINE int hi_hsum_i32_4(__m128i s) {
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 4 x 4 int32 (in int8 range) -> 16 int8 in order */
HI_INLINE __m128i hi_pack16(__m128i a, __m128i b, __m128i c, __m128i d) {
    return _mm_packs_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d));
}

static void hi_quant_q8_01(const float *x, int64_t n, uint8_t *y, int with_s) {
    const int64_t nb = n / 32;
    const size_t bs = with_s ? sizeof(block_q8_1) : sizeof(block_q8_0);
    const __m128 sign = _mm_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += 32, y += bs) {
        __m128 v[8];
        __m128 ma = _mm_setzero_ps();
        for (int k = 0; k < 8; k++) {
            v[k] = _mm_loadu_ps(x + 4 * k);
            ma = _mm_max_ps(ma, _mm_andnot_ps(sign, v[k]));
        }
        const float amax = hi_hmax4(ma);
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        const __m128 mul = _mm_set1_ps(id);
        __m128i q[8];
        for (int k = 0; k < 8; k++) q[k] = _mm_cvtps_epi32(_mm_mul_ps(v[k], mul));
        const uint16_t dh = hi_f2h(d);
        memcpy(y, &dh, 2);
        if (with_s) {
            __m128i s = _mm_add_epi32(_mm_add_epi32(q[0], q[1]), _mm_add_epi32(q[2], q[3]));
            s = _mm_add_epi32(s, _mm_add_epi32(_mm_add_epi32(q[4], q[5]), _mm_add_epi32(q[6], q[7])));
            const uint16_t sh = hi_f2h(d * (float)hi_hsum_i32_4(s));
            memcpy(y + 2, &sh, 2);
        }
        _mm_storeu_si128((__m128i *)(y + bs - 32), hi_pack16(q[0], q[1], q[2], q[3]));
        _mm_storeu_si128((__m128i *)(y + bs - 16), hi_pack16(q[4], q[5], q[6], q[7]));
    }
}

/* see the AVX2 version */
HI_INLINE __m128i hi_q8k_round(__m128 v) {
    const __m128i b = _mm_castps_si128(_mm_add_ps(v, _mm_set1_ps(12582912.f)));
    __m128i i = _mm_sub_epi32(_mm_and_si128(b, _mm_set1_epi32(0x007fffff)), _mm_set1_epi32(0x00400000));
    const __m128i lim = _mm_set1_epi32(127), gt = _mm_cmpgt_epi32(i, lim); /* no pminsd before SSE4.1 */
    i = _mm_or_si128(_mm_andnot_si128(gt, i), _mm_and_si128(gt, lim));
    return _mm_srai_epi32(_mm_slli_epi32(i, 24), 24);
}

static void hi_quant_q8_K(const float *x, int64_t n, uint8_t *yv) {
    block_q8_K *y = (block_q8_K *)yv;
    const int64_t nb = n / 256;
    const __m128 sign = _mm_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += 256) {
        __m128 ma = _mm_setzero_ps();
        for (int j = 0; j < 256; j += 4) ma = _mm_max_ps(_mm_andnot_ps(sign, _mm_loadu_ps(x + j)), ma);
        const float amax = hi_hmax4(ma);
        if (!(amax > 0.0f)) {
            memset(&y[i], 0, sizeof(block_q8_K));
            continue;
        }
        const __m128 vmax = _mm_set1_ps(amax);
        int jm = 0;
        for (int j = 0; j < 256; j += 4) {
            const int mk = _mm_movemask_ps(_mm_cmpeq_ps(_mm_andnot_ps(sign, _mm_loadu_ps(x + j)), vmax));
            if (mk) { jm = j + __builtin_ctz((unsigned)mk); break; }
        }
        const float iscale = -127.f / x[jm];
        const __m128 mul = _mm_set1_ps(iscale);
        for (int j = 0; j < 256; j += 16) {
            __m128i q[4];
            for (int k = 0; k < 4; k++) q[k] = hi_q8k_round(_mm_mul_ps(_mm_loadu_ps(x + j + 4 * k), mul));
            _mm_storeu_si128((__m128i *)(y[i].qs + j), hi_pack16(q[0], q[1], q[2], q[3]));
            y[i].bsums[j / 16] = (int16_t)hi_hsum_i32_4(_mm_add_epi32(_mm_add_epi32(q[0], q[1]), _mm_add_epi32(q[2], q[3])));
        }
        y[i].d = 1 / iscale;
    }
}

static void hi_quant_f16(const float *x, int64_t n, uint16_t *y) {
    for (int64_t i = 0; i < n; i++) y[i] = hi_f2h(x[i]);
}

#else /* scalar */

/* cvtps2dq under the default MXCSR: round half to even; NaN and |v| >= 2^31 give INT32_MIN */
HI_INLINE int32_t hi_cvt_rne(float v) {
    if (!(v > -2147483648.f && v < 2147483648.f)) return INT32_MIN;
    if (fabsf(v) >= 4194304.f) return (int32_t)v; /* already an integer */
    return hi_nearest_int(v);
}

static void hi_quant_q8_01(const float *x, int64_t n, uint8_t *y, int with_s) {
    const int64_t nb = n / 32;
    const size_t bs = with_s ? sizeof(block_q8_1) : sizeof(block_q8_0);
    for (int64_t i = 0; i < nb; i++, x += 32, y += bs) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float a = fabsf(x[j]);
            amax = amax > a ? amax : a;
        }
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        int8_t *q = (int8_t *)(y + bs - 32);
        uint32_t sum = 0; /* the SIMD paths add the int32 values before saturation, wrapping */
        for (int j = 0; j < 32; j++) {
            const int32_t v = hi_cvt_rne(x[j] * id);
            sum += (uint32_t)v;
            q[j] = (int8_t)(v > 127 ? 127 : v < -128 ? -128 : v);
        }
        const uint16_t dh = hi_f2h(d);
        memcpy(y, &dh, 2);
        if (with_s) {
            const uint16_t sh = hi_f2h(d * (float)(int32_t)sum);
            memcpy(y + 2, &sh, 2);
        }
    }
}

/* ggml's quantize_row_q8_K_ref, except that an all-zero block gets bsums = 0 (ggml leaves them unwritten) */
static void hi_quant_q8_K(const float *x, int64_t n, uint8_t *yv) {
    block_q8_K *y = (block_q8_K *)yv;
    const int64_t nb = n / 256;
    for (int64_t i = 0; i < nb; i++, x += 256) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 256; j++) {
            const float a = fabsf(x[j]);
            if (a > amax) { amax = a; max = x[j]; }
        }
        if (!(amax > 0.0f)) {
            memset(&y[i], 0, sizeof(block_q8_K));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < 256; j++) {
            const int v = hi_nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += y[i].qs[16 * g + j];
            y[i].bsums[g] = (int16_t)s;
        }
        y[i].d = 1 / iscale;
    }
}

static void hi_quant_f16(const float *x, int64_t n, uint16_t *y) {
    for (int64_t i = 0; i < n; i++) y[i] = hi_f2h(x[i]);
}

#endif

static void hi_quantize(int kind, const float *x, int64_t n, void *y) {
    switch (kind) {
    case HI_ACT_Q8_0: hi_quant_q8_01(x, n, (uint8_t *)y, 0); break;
    case HI_ACT_Q8_1: hi_quant_q8_01(x, n, (uint8_t *)y, 1); break;
    case HI_ACT_Q8_K: hi_quant_q8_K(x, n, (uint8_t *)y); break;
    case HI_ACT_F16: hi_quant_f16(x, n, (uint16_t *)y); break;
    case HI_ACT_F32: memcpy(y, x, (size_t)n * sizeof(float)); break;
    default: break;
    }
}

/* ================================================================================================ */
/* per-call preparation of the activation rows (legacy types) */

/* the constant c of the lane correction -c * (sum of 4 activations) this ISA uses for weight type qt, 0 if
 * none: the unsigned-weight forms of Q4_0 and Q5_0 (SSSE3, AVX2, VNNI) and Q8_0 with w + 128 (VNNI) */
#if defined(HI_SCALAR)
#define HI_CORR(qt) 0
#elif defined(HI_VNNI)
#define HI_CORR(qt) ((qt) == HI_T_Q4_0 ? 8 : (qt) == HI_T_Q5_0 ? 16 : (qt) == HI_T_Q8_0 ? 128 : 0)
#else
#define HI_CORR(qt) ((qt) == HI_T_Q4_0 ? 8 : (qt) == HI_T_Q5_0 ? 16 : 0)
#endif

static void hi_prep(int qt, const uint8_t *xq, int64_t nb, int32_t *corr, float *dy, float *sy) {
    const int q81 = qt == HI_T_Q4_1 || qt == HI_T_Q5_1;
    const size_t ybs = q81 ? sizeof(block_q8_1) : sizeof(block_q8_0);
    const int c = HI_CORR(qt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = xq + b * ybs;
        dy[b] = hi_h2f(hi_rd16(blk));
        if (q81 && sy) sy[b] = hi_h2f(hi_rd16(blk + 2));
        if (c && corr) {
            const int8_t *q = (const int8_t *)(blk + ybs - 32);
            (void)q;
#if defined(HI_AVX2)
            const __m256i y = _mm256_loadu_si256((const __m256i *)q);
            const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), y), _mm256_set1_epi16(1));
            _mm256_storeu_si256((__m256i *)(corr + 8 * b), _mm256_mullo_epi32(s4, _mm256_set1_epi32(-c)));
#elif defined(HI_SSSE3)
            const __m128i one8 = _mm_set1_epi8(1), one16 = _mm_set1_epi16(1);
            for (int h = 0; h < 2; h++) {
                const __m128i y = _mm_loadu_si128((const __m128i *)(q + 16 * h));
                const __m128i s4 = _mm_madd_epi16(_mm_maddubs_epi16(one8, y), one16);
                /* -c * s4 with c a power of two (SSSE3 has no pmulld) */
                const __m128i sh = _mm_cvtsi32_si128(c == 8 ? 3 : c == 16 ? 4 : 7);
                _mm_storeu_si128((__m128i *)(corr + 8 * b + 4 * h), _mm_sub_epi32(_mm_setzero_si128(), _mm_sll_epi32(s4, sh)));
            }
#endif
        }
    }
}

/* ================================================================================================ */
/* 8-lane primitives of the legacy dot products */

#if defined(HI_AVX2)

typedef __m256i hi_wv; /* 32 weight bytes */
typedef __m256i hi_yv; /* 32 activation bytes */
typedef __m256i hi_iv; /* 8 int32 lanes */
typedef __m256 hi_fv;  /* 8 float lanes */

HI_INLINE __m256i hi_nib32(const uint8_t *qs) {
    /* the 16 bytes in both halves (a pure load), the upper half shifted by 4 bits */
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(t, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

/* bit j of the 32-bit word at qh -> 0x10 in byte j */
HI_INLINE __m256i hi_hbit32(const uint8_t *qh) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)hi_rd32(qh)), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

HI_INLINE hi_wv hi_load_w(const int qt, const uint8_t *blk) {
    switch (qt) {
    case HI_T_Q4_0: return hi_nib32(blk + 2);
    case HI_T_Q4_1: return hi_nib32(blk + 4);
    case HI_T_Q5_0: return _mm256_or_si256(hi_nib32(blk + 6), hi_hbit32(blk + 2));
    case HI_T_Q5_1: return _mm256_or_si256(hi_nib32(blk + 8), hi_hbit32(blk + 4));
    default: {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
#if defined(HI_VNNI)
        return _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)); /* w + 128, unsigned */
#else
        return w;
#endif
    }
    }
}

HI_INLINE hi_yv hi_load_y(const uint8_t *q) { return _mm256_loadu_si256((const __m256i *)q); }
HI_INLINE hi_iv hi_load_corr(const int32_t *c) { return _mm256_loadu_si256((const __m256i *)c); }
HI_INLINE hi_iv hi_izero(void) { return _mm256_setzero_si256(); }
HI_INLINE hi_fv hi_fzero(void) { return _mm256_setzero_ps(); }

HI_INLINE hi_iv hi_lanes(const int qt, hi_wv w, hi_yv y, hi_iv nc) {
#if defined(HI_VNNI)
    if (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, y);
    return _mm256_dpbusd_epi32(nc, w, y);
#else
    const __m256i one = _mm256_set1_epi16(1);
    if (qt == HI_T_Q8_0)
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w)), one);
    const __m256i l = _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), one);
    if (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) return l;
    return _mm256_add_epi32(l, nc);
#endif
}

HI_INLINE hi_fv hi_fmadd8(float d, hi_iv l, hi_fv acc) {
    return _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l), acc);
}

HI_INLINE float hi_hsum8(hi_fv x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* the scales of R <= 4 rows in one register: lanes 2i, 2i+1 = d, m of row i (the 32 bits at the block's
 * start, converted together); products with d_a and the min sums live in the same lanes */
typedef __m256 hi_sv;
HI_INLINE hi_sv hi_load_sv_m(const int R, const int has_min, const uint8_t *const *p) {
    (void)has_min;
    __m128i h = _mm_cvtsi32_si128((int)hi_rd32(p[0]));
    if (R > 1) h = _mm_insert_epi32(h, (int)hi_rd32(p[1]), 1);
    if (R > 2) h = _mm_insert_epi32(h, (int)hi_rd32(p[2]), 2);
    if (R > 3) h = _mm_insert_epi32(h, (int)hi_rd32(p[3]), 3);
    return _mm256_cvtph_ps(h);
}
HI_INLINE hi_sv hi_sv_zero(void) { return _mm256_setzero_ps(); }
HI_INLINE hi_sv hi_sv_mul(hi_sv a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
/* c + a*b in the m lanes (the d lanes compute unused values) */
HI_INLINE hi_sv hi_sv_fma_m(hi_sv a, float b, hi_sv c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
HI_INLINE float hi_sv_get_m(hi_sv a, const int i) {
    return _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_permutevar8x32_ps(a, _mm256_set1_epi32(2 * i + 1))));
}
HI_INLINE hi_fv hi_fmadd8_sv(hi_sv d, const int i, hi_iv l, hi_fv acc) {
    const __m256 dv = i == 0 ? _mm256_broadcastss_ps(_mm256_castps256_ps128(d))
                             : _mm256_permutevar8x32_ps(d, _mm256_set1_epi32(2 * i));
    return _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(l), acc);
}

#elif defined(HI_SSSE3)

typedef struct { __m128i lo, hi; } hi_wv;
typedef struct { __m128i lo, hi; } hi_yv;
typedef struct { __m128i lo, hi; } hi_iv;
typedef struct { __m128 lo, hi; } hi_fv;

HI_INLINE void hi_hbit32(const uint8_t *qh, __m128i *lo, __m128i *hi) {
    const __m128i x = _mm_set1_epi32((int)hi_rd32(qh));
    const __m128i mask = _mm_set1_epi64x(0x7fbfdfeff7fbfdfe), ones = _mm_set1_epi64x(-1), b4 = _mm_set1_epi8(0x10);
    const __m128i l = _mm_or_si128(_mm_shuffle_epi8(x, _mm_set_epi64x(0x0101010101010101, 0)), mask);
    const __m128i h = _mm_or_si128(_mm_shuffle_epi8(x, _mm_set_epi64x(0x0303030303030303, 0x0202020202020202)), mask);
    *lo = _mm_and_si128(_mm_cmpeq_epi8(l, ones), b4);
    *hi = _mm_and_si128(_mm_cmpeq_epi8(h, ones), b4);
}

HI_INLINE hi_wv hi_load_w(const int qt, const uint8_t *blk) {
    hi_wv w;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    if (qt == HI_T_Q8_0) {
        w.lo = _mm_loadu_si128((const __m128i *)(blk + 2));
        w.hi = _mm_loadu_si128((const __m128i *)(blk + 18));
        return w;
    }
    const int off = qt == HI_T_Q4_0 ? 2 : qt == HI_T_Q4_1 ? 4 : qt == HI_T_Q5_0 ? 6 : 8;
    const __m128i t = _mm_loadu_si128((const __m128i *)(blk + off));
    w.lo = _mm_and_si128(t, m4);
    w.hi = _mm_and_si128(_mm_srli_epi16(t, 4), m4);
    if (qt == HI_T_Q5_0 || qt == HI_T_Q5_1) {
        __m128i bl, bh;
        hi_hbit32(blk + off - 4, &bl, &bh);
        w.lo = _mm_or_si128(w.lo, bl);
        w.hi = _mm_or_si128(w.hi, bh);
    }
    return w;
}

HI_INLINE hi_yv hi_load_y(const uint8_t *q) {
    hi_yv y = {_mm_loadu_si128((const __m128i *)q), _mm_loadu_si128((const __m128i *)(q + 16))};
    return y;
}
HI_INLINE hi_iv hi_load_corr(const int32_t *c) {
    hi_iv v = {_mm_loadu_si128((const __m128i *)c), _mm_loadu_si128((const __m128i *)(c + 4))};
    return v;
}
HI_INLINE hi_iv hi_izero(void) { hi_iv v = {_mm_setzero_si128(), _mm_setzero_si128()}; return v; }
HI_INLINE hi_fv hi_fzero(void) { hi_fv v = {_mm_setzero_ps(), _mm_setzero_ps()}; return v; }

HI_INLINE hi_iv hi_lanes(const int qt, hi_wv w, hi_yv y, hi_iv nc) {
    const __m128i one = _mm_set1_epi16(1);
    hi_iv l;
    if (qt == HI_T_Q8_0) {
        l.lo = _mm_madd_epi16(_mm_maddubs_epi16(_mm_sign_epi8(w.lo, w.lo), _mm_sign_epi8(y.lo, w.lo)), one);
        l.hi = _mm_madd_epi16(_mm_maddubs_epi16(_mm_sign_epi8(w.hi, w.hi), _mm_sign_epi8(y.hi, w.hi)), one);
        return l;
    }
    l.lo = _mm_madd_epi16(_mm_maddubs_epi16(w.lo, y.lo), one);
    l.hi = _mm_madd_epi16(_mm_maddubs_epi16(w.hi, y.hi), one);
    if (qt == HI_T_Q4_0 || qt == HI_T_Q5_0) {
        l.lo = _mm_add_epi32(l.lo, nc.lo);
        l.hi = _mm_add_epi32(l.hi, nc.hi);
    }
    return l;
}

HI_INLINE hi_fv hi_fmadd8(float d, hi_iv l, hi_fv acc) {
    const __m128 dv = _mm_set1_ps(d);
    acc.lo = _mm_add_ps(_mm_mul_ps(dv, _mm_cvtepi32_ps(l.lo)), acc.lo);
    acc.hi = _mm_add_ps(_mm_mul_ps(dv, _mm_cvtepi32_ps(l.hi)), acc.hi);
    return acc;
}

HI_INLINE float hi_hsum8(hi_fv x) {
    __m128 r = _mm_add_ps(x.hi, x.lo);
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* exact fp16 -> fp32 of 4 values (the low 16 bits of each 32-bit lane), subnormals and inf/nan included */
HI_INLINE __m128 hi_h2f4(__m128i h) {
    const __m128i em = _mm_and_si128(h, _mm_set1_epi32(0x7fff));
    const __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
    const __m128i norm = _mm_add_epi32(_mm_slli_epi32(em, 13), _mm_set1_epi32((127 - 15) << 23));
    const __m128i infnan = _mm_or_si128(_mm_slli_epi32(em, 13), _mm_set1_epi32(0x7f800000));
    const __m128i sub = _mm_castps_si128(_mm_mul_ps(_mm_cvtepi32_ps(em), _mm_set1_ps(0x1p-24f)));
    const __m128i is_sub = _mm_cmplt_epi32(em, _mm_set1_epi32(0x0400));
    const __m128i is_inf = _mm_cmpgt_epi32(em, _mm_set1_epi32(0x7bff));
    __m128i r = _mm_or_si128(_mm_and_si128(is_inf, infnan), _mm_andnot_si128(is_inf, norm));
    r = _mm_or_si128(_mm_and_si128(is_sub, sub), _mm_andnot_si128(is_sub, r));
    return _mm_castsi128_ps(_mm_or_si128(r, sign));
}

/* the scales of R <= 4 rows: d (and m) of the rows as one vector each, 4 halves converted together */
typedef struct { __m128 d, m; } hi_sv;
HI_INLINE __m128 hi_load_h4(const int R, const uint8_t *const *p, const int off) {
    __m128i h = _mm_cvtsi32_si128(hi_rd16(p[0] + off));
    if (R > 1) h = _mm_insert_epi16(h, hi_rd16(p[1] + off), 2);
    if (R > 2) h = _mm_insert_epi16(h, hi_rd16(p[2] + off), 4);
    if (R > 3) h = _mm_insert_epi16(h, hi_rd16(p[3] + off), 6);
    return hi_h2f4(h);
}
HI_INLINE hi_sv hi_load_sv_m(const int R, const int has_min, const uint8_t *const *p) {
    hi_sv s;
    s.d = hi_load_h4(R, p, 0);
    s.m = has_min ? hi_load_h4(R, p, 2) : _mm_setzero_ps();
    return s;
}
HI_INLINE hi_sv hi_sv_zero(void) { hi_sv s = {_mm_setzero_ps(), _mm_setzero_ps()}; return s; }
HI_INLINE hi_sv hi_sv_mul(hi_sv a, float b) { a.d = _mm_mul_ps(a.d, _mm_set1_ps(b)); return a; }
HI_INLINE hi_sv hi_sv_fma_m(hi_sv a, float b, hi_sv c) { c.m = _mm_add_ps(_mm_mul_ps(a.m, _mm_set1_ps(b)), c.m); return c; }
HI_INLINE float hi_sv_get_m(hi_sv a, const int i) {
    const __m128 v = a.m;
    return _mm_cvtss_f32(i == 0 ? v : i == 1 ? _mm_shuffle_ps(v, v, 0x55) : i == 2 ? _mm_movehl_ps(v, v) : _mm_shuffle_ps(v, v, 0xff));
}
HI_INLINE hi_fv hi_fmadd8_sv(hi_sv s, const int i, hi_iv l, hi_fv acc) {
    const __m128 d = s.d;
    const __m128 dv = i == 0 ? _mm_shuffle_ps(d, d, 0x00) : i == 1 ? _mm_shuffle_ps(d, d, 0x55)
                    : i == 2 ? _mm_shuffle_ps(d, d, 0xaa) : _mm_shuffle_ps(d, d, 0xff);
    acc.lo = _mm_add_ps(_mm_mul_ps(dv, _mm_cvtepi32_ps(l.lo)), acc.lo);
    acc.hi = _mm_add_ps(_mm_mul_ps(dv, _mm_cvtepi32_ps(l.hi)), acc.hi);
    return acc;
}

#else /* scalar */

typedef struct { int8_t v[32]; } hi_wv; /* signed weights (offsets applied) */
typedef const int8_t *hi_yv;
typedef struct { int32_t v[8]; } hi_iv;
typedef struct { float v[8]; } hi_fv;

HI_INLINE hi_wv hi_load_w(const int qt, const uint8_t *blk) {
    hi_wv w;
    if (qt == HI_T_Q8_0) {
        memcpy(w.v, blk + 2, 32);
        return w;
    }
    const int off = qt == HI_T_Q4_0 ? 2 : qt == HI_T_Q4_1 ? 4 : qt == HI_T_Q5_0 ? 6 : 8;
    const int sub = qt == HI_T_Q4_0 ? 8 : qt == HI_T_Q5_0 ? 16 : 0;
    const uint32_t qh = (qt == HI_T_Q5_0 || qt == HI_T_Q5_1) ? hi_rd32(blk + off - 4) : 0;
    for (int j = 0; j < 16; j++) {
        const int lo = (blk[off + j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
        const int hi = (blk[off + j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        w.v[j] = (int8_t)(lo - sub);
        w.v[j + 16] = (int8_t)(hi - sub);
    }
    return w;
}

HI_INLINE hi_yv hi_load_y(const uint8_t *q) { return (const int8_t *)q; }
HI_INLINE hi_iv hi_load_corr(const int32_t *c) { hi_iv v; memcpy(v.v, c, 32); return v; }
HI_INLINE hi_iv hi_izero(void) { hi_iv v; memset(&v, 0, sizeof v); return v; }
HI_INLINE hi_fv hi_fzero(void) { hi_fv v; for (int k = 0; k < 8; k++) v.v[k] = 0.0f; return v; }

HI_INLINE hi_iv hi_lanes(const int qt, hi_wv w, hi_yv y, hi_iv nc) {
    (void)qt; (void)nc;
    hi_iv l;
    for (int k = 0; k < 8; k++) {
        int s = 0;
        for (int j = 4 * k; j < 4 * k + 4; j++) s += (int)w.v[j] * (int)y[j];
        l.v[k] = s;
    }
    return l;
}

HI_INLINE hi_fv hi_fmadd8(float d, hi_iv l, hi_fv acc) {
    for (int k = 0; k < 8; k++) acc.v[k] = fmaf(d, (float)l.v[k], acc.v[k]);
    return acc;
}

HI_INLINE float hi_hsum8(hi_fv x) {
    const float r0 = x.v[4] + x.v[0], r1 = x.v[5] + x.v[1], r2 = x.v[6] + x.v[2], r3 = x.v[7] + x.v[3];
    return (r0 + r2) + (r1 + r3);
}

typedef struct { float d[4], m[4]; } hi_sv;
HI_INLINE hi_sv hi_load_sv_m(const int R, const int has_min, const uint8_t *const *p) {
    hi_sv s;
    memset(&s, 0, sizeof s);
    for (int i = 0; i < R; i++) {
        s.d[i] = hi_h2f(hi_rd16(p[i]));
        s.m[i] = has_min ? hi_h2f(hi_rd16(p[i] + 2)) : 0.0f;
    }
    return s;
}
HI_INLINE hi_sv hi_sv_zero(void) { hi_sv s; memset(&s, 0, sizeof s); return s; }
HI_INLINE hi_sv hi_sv_mul(hi_sv a, float b) { for (int i = 0; i < 4; i++) a.d[i] *= b; return a; }
HI_INLINE hi_sv hi_sv_fma_m(hi_sv a, float b, hi_sv c) { for (int i = 0; i < 4; i++) c.m[i] = fmaf(a.m[i], b, c.m[i]); return c; }
HI_INLINE float hi_sv_get_m(hi_sv a, const int i) { return a.m[i]; }
HI_INLINE hi_fv hi_fmadd8_sv(hi_sv s, const int i, hi_iv l, hi_fv acc) { return hi_fmadd8(s.d[i], l, acc); }

#endif

/* ================================================================================================ */
/* tiles */

HI_INLINE int hi_wbs(const int qt) {
    return qt == HI_T_Q4_0 ? 18 : qt == HI_T_Q4_1 ? 20 : qt == HI_T_Q5_0 ? 22 : qt == HI_T_Q5_1 ? 24 : 34;
}

/* R weight rows from r x C activation rows from t, legacy 32-element types */
HI_INLINE void hi_tile_legacy(const int qt, const int R, const int C, const hi_mm *m, int64_t r, int64_t t) {
    const int bs = hi_wbs(qt);
    const int has_min = qt == HI_T_Q4_1 || qt == HI_T_Q5_1;
    const int ybs = has_min ? 36 : 34;
    const int need_corr = HI_CORR(qt) != 0;
    const int64_t nb = m->cols / 32;
    const uint8_t *wr[HI_MAXR];
    const uint8_t *xr[HI_MAXC];
    const int32_t *cr[HI_MAXC];
    const float *dyr[HI_MAXC];
    const float *syr[HI_MAXC];
    hi_fv acc[HI_MAXR][HI_MAXC];
    hi_sv summs[HI_MAXC]; /* lane i: row r + i */
    HI_UNROLL for (int i = 0; i < R; i++) wr[i] = m->w + (size_t)(r + i) * m->w_row;
    HI_UNROLL for (int c = 0; c < C; c++) {
        xr[c] = m->x + (size_t)(t + c) * m->x_row + (ybs - 32);
        cr[c] = need_corr ? m->corr + (size_t)(t + c) * nb * 8 : NULL;
        dyr[c] = m->dy + (size_t)(t + c) * nb;
        syr[c] = has_min ? m->sy + (size_t)(t + c) * nb : NULL;
        summs[c] = hi_sv_zero();
    }
    HI_UNROLL for (int i = 0; i < R; i++) {
        HI_UNROLL for (int c = 0; c < C; c++) acc[i][c] = hi_fzero();
    }
    /* the rows of a tile are one contiguous region, and the next tiles follow it: while this tile's blocks
     * are read as R interleaved streams (too short for the hardware prefetcher), fetch what lies one tile
     * (at least 2 KiB) ahead as one linear stream at the same pace; successive tiles continue that stream */
    const size_t tile = (size_t)R * m->w_row;
    const uint8_t *pf = wr[0] + (tile > 2048 ? tile : 2048), *pf_end = pf;
    const size_t pf_step = (size_t)R * bs;
    for (int64_t b = 0; b < nb; b++) {
        for (pf_end += pf_step; pf < pf_end; pf += 64) __builtin_prefetch(pf, 0, 3);
        const uint8_t *blk[HI_MAXR];
        HI_UNROLL for (int i = 0; i < R; i++) blk[i] = wr[i] + b * bs;
        const hi_sv dm = hi_load_sv_m(R, has_min, blk); /* d (and m) of the R rows */
        hi_yv y[HI_MAXC];
        hi_iv nc[HI_MAXC];
        hi_sv dd[HI_MAXC];
        HI_UNROLL for (int c = 0; c < C; c++) {
            y[c] = hi_load_y(xr[c] + b * ybs);
            nc[c] = need_corr ? hi_load_corr(cr[c] + 8 * b) : hi_izero();
            dd[c] = hi_sv_mul(dm, dyr[c][b]); /* d_w * d_a, one float product per row */
            if (has_min) summs[c] = hi_sv_fma_m(dm, syr[c][b], summs[c]);
        }
        HI_UNROLL for (int i = 0; i < R; i++) {
            const hi_wv w = hi_load_w(qt, blk[i]);
            HI_UNROLL for (int c = 0; c < C; c++) acc[i][c] = hi_fmadd8_sv(dd[c], i, hi_lanes(qt, w, y[c], nc[c]), acc[i][c]);
        }
    }
    HI_UNROLL for (int i = 0; i < R; i++) {
        HI_UNROLL for (int c = 0; c < C; c++) {
            float s = hi_hsum8(acc[i][c]);
            if (has_min) s = s + hi_sv_get_m(summs[c], i);
            m->out[(size_t)(t + c) * m->out_row + (size_t)(r + i)] = s;
        }
    }
}

/* ---- F32 / F16 weights ------------------------------------------------------------------------- */

#if defined(HI_AVX2)
typedef __m256 hi_f8;
HI_INLINE hi_f8 hi_f8_load(const int f16, const void *p, int64_t i) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}
HI_INLINE hi_f8 hi_f8_zero(void) { return _mm256_setzero_ps(); }
HI_INLINE hi_f8 hi_f8_fma(hi_f8 a, hi_f8 b, hi_f8 c) { return _mm256_fmadd_ps(a, b, c); }
HI_INLINE hi_f8 hi_f8_add(hi_f8 a, hi_f8 b) { return _mm256_add_ps(a, b); }
HI_INLINE float hi_f8_reduce(hi_f8 x) {
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
}
#elif defined(HI_SSSE3)
typedef struct { __m128 lo, hi; } hi_f8;
HI_INLINE hi_f8 hi_f8_load(const int f16, const void *p, int64_t i) {
    hi_f8 v;
    if (f16) {
        const uint16_t *h = (const uint16_t *)p + i;
        v.lo = _mm_setr_ps(hi_h2f(h[0]), hi_h2f(h[1]), hi_h2f(h[2]), hi_h2f(h[3]));
        v.hi = _mm_setr_ps(hi_h2f(h[4]), hi_h2f(h[5]), hi_h2f(h[6]), hi_h2f(h[7]));
    } else {
        v.lo = _mm_loadu_ps((const float *)p + i);
        v.hi = _mm_loadu_ps((const float *)p + i + 4);
    }
    return v;
}
HI_INLINE hi_f8 hi_f8_zero(void) { hi_f8 v = {_mm_setzero_ps(), _mm_setzero_ps()}; return v; }
HI_INLINE hi_f8 hi_f8_fma(hi_f8 a, hi_f8 b, hi_f8 c) {
    c.lo = _mm_add_ps(_mm_mul_ps(a.lo, b.lo), c.lo);
    c.hi = _mm_add_ps(_mm_mul_ps(a.hi, b.hi), c.hi);
    return c;
}
HI_INLINE hi_f8 hi_f8_add(hi_f8 a, hi_f8 b) { a.lo = _mm_add_ps(a.lo, b.lo); a.hi = _mm_add_ps(a.hi, b.hi); return a; }
HI_INLINE float hi_f8_reduce(hi_f8 x) {
    const __m128 t0 = _mm_add_ps(x.lo, x.hi);
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
}
#else
typedef struct { float v[8]; } hi_f8;
HI_INLINE hi_f8 hi_f8_load(const int f16, const void *p, int64_t i) {
    hi_f8 v;
    for (int k = 0; k < 8; k++) v.v[k] = f16 ? hi_h2f(((const uint16_t *)p)[i + k]) : ((const float *)p)[i + k];
    return v;
}
HI_INLINE hi_f8 hi_f8_zero(void) { hi_f8 v; for (int k = 0; k < 8; k++) v.v[k] = 0.0f; return v; }
HI_INLINE hi_f8 hi_f8_fma(hi_f8 a, hi_f8 b, hi_f8 c) { for (int k = 0; k < 8; k++) c.v[k] = fmaf(a.v[k], b.v[k], c.v[k]); return c; }
HI_INLINE hi_f8 hi_f8_add(hi_f8 a, hi_f8 b) { for (int k = 0; k < 8; k++) a.v[k] += b.v[k]; return a; }
HI_INLINE float hi_f8_reduce(hi_f8 x) {
    const float t0 = x.v[0] + x.v[4], t1 = x.v[1] + x.v[5], t2 = x.v[2] + x.v[6], t3 = x.v[3] + x.v[7];
    return (t0 + t1) + (t2 + t3);
}
#endif

HI_INLINE float hi_ldf(const int f16, const void *p, int64_t i) {
    return f16 ? hi_h2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

HI_INLINE void hi_tile_float(const int f16, const hi_mm *m, int64_t r, int64_t t) {
    const void *w = m->w + (size_t)r * m->w_row;
    const void *x = m->x + (size_t)t * m->x_row;
    const int64_t n = m->cols, n32 = n & ~(int64_t)31;
    hi_f8 a0 = hi_f8_zero(), a1 = hi_f8_zero(), a2 = hi_f8_zero(), a3 = hi_f8_zero();
    for (int64_t i = 0; i < n32; i += 32) {
        a0 = hi_f8_fma(hi_f8_load(f16, w, i), hi_f8_load(f16, x, i), a0);
        a1 = hi_f8_fma(hi_f8_load(f16, w, i + 8), hi_f8_load(f16, x, i + 8), a1);
        a2 = hi_f8_fma(hi_f8_load(f16, w, i + 16), hi_f8_load(f16, x, i + 16), a2);
        a3 = hi_f8_fma(hi_f8_load(f16, w, i + 24), hi_f8_load(f16, x, i + 24), a3);
    }
    a0 = hi_f8_add(a0, a2);
    a1 = hi_f8_add(a1, a3);
    a0 = hi_f8_add(a0, a1);
    double s = (double)hi_f8_reduce(a0);
    for (int64_t i = n32; i < n; i++) s += (double)(hi_ldf(f16, w, i) * hi_ldf(f16, x, i));
    m->out[(size_t)t * m->out_row + (size_t)r] = (float)s;
}

/* ---- K-quants ---------------------------------------------------------------------------------- */

HI_INLINE void hi_tile_kquant(const int qt, const hi_mm *m, int64_t r, int64_t t) {
    const void *w = m->w + (size_t)r * m->w_row;
    const void *x = m->x + (size_t)t * m->x_row;
    const int n = (int)m->cols;
    float v;
    if (qt == HI_T_Q4_K) v = hi_dot_q4_K_q8_K(n, w, x);
    else if (qt == HI_T_Q5_K) v = hi_dot_q5_K_q8_K(n, w, x);
    else v = hi_dot_q6_K_q8_K(n, w, x);
    m->out[(size_t)t * m->out_row + (size_t)r] = v;
}

/* ---- driver ------------------------------------------------------------------------------------ */

HI_INLINE void hi_tile(const int qt, const int R, const int C, const hi_mm *m, int64_t r, int64_t t) {
    if (qt == HI_T_F32 || qt == HI_T_F16 || qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K) {
        HI_UNROLL for (int i = 0; i < R; i++) {
            HI_UNROLL for (int c = 0; c < C; c++) {
                if (qt == HI_T_F32 || qt == HI_T_F16) hi_tile_float(qt == HI_T_F16, m, r + i, t + c);
                else hi_tile_kquant(qt, m, r + i, t + c);
            }
        }
    } else {
        hi_tile_legacy(qt, R, C, m, r, t);
    }
}

HI_INLINE void hi_drive(const int qt, const hi_mm *m, int64_t r0, int64_t r1) {
    /* the float and K-quant tiles gain nothing from wide tiles: use 1 x 1 for them */
    const int legacy = !(qt == HI_T_F32 || qt == HI_T_F16 || qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K);
    for (int64_t tb = 0; tb < m->T; tb += HI_TB) {
        const int64_t te = tb + HI_TB < m->T ? tb + HI_TB : m->T;
        int64_t r = r0;
        if (!legacy) {
            for (; r < r1; r++)
                for (int64_t t = tb; t < te; t++) hi_tile(qt, 1, 1, m, r, t);
        } else if (te - tb == 1) {
            for (; r + HI_RV <= r1; r += HI_RV) hi_tile(qt, HI_RV, 1, m, r, tb);
            for (; r < r1; r++) hi_tile(qt, 1, 1, m, r, tb);
        } else {
            for (; r + HI_RG <= r1; r += HI_RG) {
                int64_t t = tb;
                for (; t + HI_CG <= te; t += HI_CG) hi_tile(qt, HI_RG, HI_CG, m, r, t);
                for (; t < te; t++) hi_tile(qt, HI_RG, 1, m, r, t);
            }
            for (; r < r1; r++) {
                int64_t t = tb;
                for (; t + HI_CG <= te; t += HI_CG) hi_tile(qt, 1, HI_CG, m, r, t);
                for (; t < te; t++) hi_tile(qt, 1, 1, m, r, t);
            }
        }
    }
}

#define HI_DEF_MM(NAME, QT) \
    static __attribute__((noinline)) void NAME(const hi_mm *m, int64_t r0, int64_t r1) { hi_drive(QT, m, r0, r1); }
HI_DEF_MM(hi_mm_f32, HI_T_F32)
HI_DEF_MM(hi_mm_f16, HI_T_F16)
HI_DEF_MM(hi_mm_q4_0, HI_T_Q4_0)
HI_DEF_MM(hi_mm_q4_1, HI_T_Q4_1)
HI_DEF_MM(hi_mm_q5_0, HI_T_Q5_0)
HI_DEF_MM(hi_mm_q5_1, HI_T_Q5_1)
HI_DEF_MM(hi_mm_q8_0, HI_T_Q8_0)
HI_DEF_MM(hi_mm_q4_K, HI_T_Q4_K)
HI_DEF_MM(hi_mm_q5_K, HI_T_Q5_K)
HI_DEF_MM(hi_mm_q6_K, HI_T_Q6_K)

static void hi_mm_run(const hi_mm *m, int64_t r0, int64_t r1) {
    switch (m->qtype) {
    case HI_T_F32: hi_mm_f32(m, r0, r1); break;
    case HI_T_F16: hi_mm_f16(m, r0, r1); break;
    case HI_T_Q4_0: hi_mm_q4_0(m, r0, r1); break;
    case HI_T_Q4_1: hi_mm_q4_1(m, r0, r1); break;
    case HI_T_Q5_0: hi_mm_q5_0(m, r0, r1); break;
    case HI_T_Q5_1: hi_mm_q5_1(m, r0, r1); break;
    case HI_T_Q8_0: hi_mm_q8_0(m, r0, r1); break;
    case HI_T_Q4_K: hi_mm_q4_K(m, r0, r1); break;
    case HI_T_Q5_K: hi_mm_q5_K(m, r0, r1); break;
    case HI_T_Q6_K: hi_mm_q6_K(m, r0, r1); break;
    default: break;
    }
}

/* ================================================================================================ */
/* memory read bandwidth: sum of 64-bit words, several independent accumulators */

static uint64_t hi_read_sum(const void *p, size_t n) {
#if defined(HI_VNNI)
    const __m512i *v = (const __m512i *)p;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n / 64; i += 4) {
        a0 = _mm512_add_epi64(a0, _mm512_load_si512(v + i));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512(v + i + 1));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512(v + i + 2));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512(v + i + 3));
    }
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
#elif defined(HI_AVX2)
    const __m256i *v = (const __m256i *)p;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n / 32; i += 8) {
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(_mm256_load_si256(v + i), _mm256_load_si256(v + i + 1)));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(_mm256_load_si256(v + i + 2), _mm256_load_si256(v + i + 3)));
        a2 = _mm256_add_epi64(a2, _mm256_add_epi64(_mm256_load_si256(v + i + 4), _mm256_load_si256(v + i + 5)));
        a3 = _mm256_add_epi64(a3, _mm256_add_epi64(_mm256_load_si256(v + i + 6), _mm256_load_si256(v + i + 7)));
    }
    const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t o[4];
    _mm256_storeu_si256((__m256i *)o, s);
    return o[0] + o[1] + o[2] + o[3];
#elif defined(HI_SSSE3)
    const __m128i *v = (const __m128i *)p;
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n / 16; i += 8) {
        a0 = _mm_add_epi64(a0, _mm_add_epi64(_mm_load_si128(v + i), _mm_load_si128(v + i + 1)));
        a1 = _mm_add_epi64(a1, _mm_add_epi64(_mm_load_si128(v + i + 2), _mm_load_si128(v + i + 3)));
        a2 = _mm_add_epi64(a2, _mm_add_epi64(_mm_load_si128(v + i + 4), _mm_load_si128(v + i + 5)));
        a3 = _mm_add_epi64(a3, _mm_add_epi64(_mm_load_si128(v + i + 6), _mm_load_si128(v + i + 7)));
    }
    const __m128i s = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
    uint64_t o[2];
    _mm_storeu_si128((__m128i *)o, s);
    return o[0] + o[1];
#else
    const uint64_t *v = (const uint64_t *)p;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (size_t i = 0; i < n / 8; i += 4) {
        a0 += v[i];
        a1 += v[i + 1];
        a2 += v[i + 2];
        a3 += v[i + 3];
    }
    return a0 + a1 + a2 + a3;
#endif
}

/* ================================================================================================ */

const hi_kernels HI_TABLE = {
    .isa = HI_ISA_ID,
    .name = HI_ISA_NAME,
    .quantize = hi_quantize,
    .prep = hi_prep,
    .needs_corr = {
        [HI_T_Q4_0] = HI_CORR(HI_T_Q4_0) != 0, [HI_T_Q5_0] = HI_CORR(HI_T_Q5_0) != 0,
        [HI_T_Q8_0] = HI_CORR(HI_T_Q8_0) != 0,
    },
    .mm = hi_mm_run,
    .read_sum = hi_read_sum,
};

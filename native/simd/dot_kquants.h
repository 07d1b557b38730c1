/* K-quant dot products (Q4_K, Q5_K, Q6_K weights x Q8_K activations), as llama.cpp computes them.
 *
 * The maths. A row of n weights is n/256 super-blocks; weight block i pairs with activation block i,
 * x ~= D * q8 (D float, q8 int8, bsums[j] = sum of q8 over elements 16j .. 16j+15).
 *
 *   Q4_K: w[32s+l] = d*sc[s]*q[32s+l] - dmin*m[s]   (q 0..15; sc, m six-bit; s = 0..7 sub-blocks of 32)
 *         dot_i = (D*d) * sum_s sc[s] * sum_l q[32s+l]*q8[32s+l]  -  (D*dmin) * sum_s m[s] * B[s],
 *         B[s] = bsums[2s] + bsums[2s+1]
 *   Q5_K: as Q4_K with q 0..31 (the fifth bit from qh)
 *   Q6_K: w[16s+l] = d*sc[s]*(q[16s+l] - 32)        (q 0..63; sc int8; s = 0..15 sub-blocks of 16)
 *         dot_i = (D*d) * (sum_s sc[s] * sum_l q[16s+l]*q8[16s+l]  -  32 * sum_s sc[s]*bsums[s])
 *   row = sum_i dot_i
 *
 * Integer sums are exact (int32; every 16-bit intermediate is bounded below 2^15). The floats follow ggml's
 * AVX2 kernels (what llama.cpp runs on x86 hosts with AVX2 or better), so every path keeps their shape:
 *   - the block's integer sum is kept in 8 int32 lanes: lane k (0..7) holds, over the block's eight groups of
 *     32 elements, sc * (sum of the 4 products q*q8 at positions 4k..4k+3 of the group), sc the scale of the
 *     sub-block of those 4 elements. Q6_K's q enters unsigned (0..63) and each lane then subtracts
 *         32 * (sc[2k]*bsums[2k] + sc[2k+1]*bsums[2k+1])
 *     Each lane is converted to float (round to nearest; exact below 2^24) and accumulated on its own:
 *         acc[k] = fma(D*d, (float)lane[k], acc[k])           (D*d rounded to float first)
 *   - the min term of Q4_K: 4 lanes, lane k = m[2k]*B[2k] + m[2k+1]*B[2k+1],
 *         accm[k] = fma(-D*dmin, (float)lane k, accm[k]);
 *     of Q5_K: one sum, summs = fma(-D*dmin, (float)(sum_s m[s]*B[s]), summs)
 *   - the result: hsum8(acc) [+ hsum4(accm) for Q4_K | + summs for Q5_K], with
 *         hsum8(a) = ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)),  hsum4(a) = (a0+a2) + (a1+a3).
 * The AVX-512 VNNI, AVX2 and scalar paths do exactly these operations, fused multiply-adds included (the
 * scalar one through hi_kq_fmaf, exact also where fmaf is no instruction), so their result is ggml's AVX2
 * result bit for bit. The SSSE3 path is for hosts without FMA: it forms the same integer lanes and does the
 * same float operations with a separate multiply and add, so its floats can differ in the last bits. Define
 * HI_KQ_SSSE3_FMA to get the fused rounding there too (emulated in double precision: bit-identical, about
 * half the speed); a unit built with -mfma uses the instruction.
 *
 * The path is chosen by the ISA macros of the including compilation unit:
 *   __AVX512VNNI__ && __AVX512VL__ && __AVX512BW__ : vpdpbusd (and vpdpwssd for the scales)
 *   __AVX2__                                       : pmaddubsw + pmaddwd on 32 bytes (-mavx2 -mfma)
 *   __SSSE3__                                      : pmaddubsw + pmaddwd on 16 bytes; no FMA, no SSE4.1
 *   otherwise                                      : portable scalar
 * The scalar versions (hi_dot_q*_K_q8_K_scalar) are defined in every unit. n is the number of elements of
 * the row (a multiple of 256); vx the row's weight blocks, vy its block_q8_K activation blocks. Not for
 * -ffast-math: the float operations and their order are the definition.
 *
 * This file has the helpers and the scalar versions; the SIMD dot products are in dot_q4_K.h, dot_q5_K.h and
 * dot_q6_K.h, and llama.cpp's repacked and tiled shapes of the same products in dot_kq_shapes.h, included at
 * its end (include only this file).
 */
#ifndef HI_DOT_KQUANTS_H
#define HI_DOT_KQUANTS_H

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"

#if defined(__FAST_MATH__)
#error "dot_kquants.h: the float operations are part of the result; do not compile with -ffast-math"
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define HI_KQ_VNNI 1
#else
#define HI_KQ_VNNI 0
#endif

#if HI_KQ_VNNI || defined(__AVX2__) || defined(__SSSE3__)
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------------------------------------ */
/* helpers shared by all paths                                                                        */

/* IEEE half -> float, exact for every value, branch-free, no F16C needed and independent of the FTZ/DAZ
 * modes: normal halves (and inf/nan) move into float's exponent range by a multiply by 2^-112 of a normal
 * float; subnormal halves m * 2^-24 come out of (0.5 + m * 2^-24) - 0.5 */
static inline float hi_kq_f16(hi_half h) {
    const uint32_t two_w = (uint32_t)h << 17; /* the half without its sign, at the top */
    uint32_t nb = (two_w >> 4) + (0xe0u << 23), db = (two_w >> 17) | (126u << 23);
    float norm, den;
    memcpy(&norm, &nb, 4);
    memcpy(&den, &db, 4);
    norm *= 0x1.0p-112f;
    den -= 0.5f;
    memcpy(&nb, &norm, 4);
    memcpy(&db, &den, 4);
    const uint32_t bits = ((uint32_t)(h & 0x8000u) << 16) | (two_w < (1u << 27) ? db : nb);
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* the 8 six-bit scales (out[0..7]) and mins (out[8..15]) of a Q4_K / Q5_K block, as bytes */
static inline void hi_kq_scales_mins(const uint8_t *restrict s12, uint8_t *restrict out) {
    uint32_t u[4];
    memcpy(u, s12, 12);
    const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4); /* m[4..7]  */
    const uint32_t m03 = u[1] & k1;                          /* m[0..3]  */
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);          /* sc[4..7] */
    u[2] = m03;
    u[0] &= k1;                                              /* sc[0..3] */
    memcpy(out, u, 16);
}

/* ggml's hsum_float_8 and its 4-lane tail, in scalar form */
static inline float hi_kq_hsum8(const float *a) {
    const float r0 = a[4] + a[0], r1 = a[5] + a[1], r2 = a[6] + a[2], r3 = a[7] + a[3];
    return (r0 + r2) + (r1 + r3);
}

static inline float hi_kq_hsum4(const float *a) {
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* float fma(a, b, c) with one rounding. Where fmaf is not an instruction (x86-64 without FMA or AVX-512,
 * where it would be a library call), emulated: a*b is exact in double, the double sum's error is recovered (TwoSum)
 * and the sum moved to round-to-odd, after which rounding to float is correct. */
static inline float hi_kq_fmaf(float a, float b, float c) {
#if defined(FP_FAST_FMAF) || defined(__FMA__) || defined(__AVX512F__) || !defined(FLT_EVAL_METHOD) || \
    FLT_EVAL_METHOD != 0
    return fmaf(a, b, c);
#else
    const double p = (double)a * (double)b, cd = (double)c;
    const double s = p + cd;
    const double bv = s - p;
    const double e = (p - (s - bv)) + (cd - bv);
    if (e == 0) return (float)s;
    uint64_t u;
    memcpy(&u, &s, 8);
    u -= (uint64_t)((e < 0) != (s < 0)); /* toward zero when the exact sum is smaller in magnitude */
    u |= 1;
    double r;
    memcpy(&r, &u, 8);
    return (float)r;
#endif
}

/* ------------------------------------------------------------------------------------------------ */
/* portable scalar versions: the definition of the integer lanes                                     */

/* lane[k] += sum over the 8 groups g of 32 elements of sc16[2g + k/4] * sum_{t<4} q[32g+4k+t] * q8[32g+4k+t],
 * sc16[j] the scale of elements 16j .. 16j+15 (q unsigned, 0..63) */
static inline void hi_kq_lanes_scalar(const uint8_t *restrict q, const int8_t *restrict q8, const int *restrict sc16,
                                      int32_t *restrict lane) {
    for (int g = 0; g < 8; ++g) {
        int16_t p[32];
        for (int l = 0; l < 32; ++l) p[l] = (int16_t)(q[32 * g + l] * q8[32 * g + l]); /* |.| <= 63 * 128 */
        for (int k = 0; k < 8; ++k)
            lane[k] += sc16[2 * g + (k >> 2)] * (p[4 * k] + p[4 * k + 1] + p[4 * k + 2] + p[4 * k + 3]);
    }
}

/* the quants of a Q4_K / Q5_K block in element order: sub-block s = nibble s&1 of qs[32(s/2) + l] (+ 16 * bit s
 * of qh[l]) */
static inline void hi_kq_unpack_k4(const uint8_t *restrict qs, const uint8_t *restrict qh, uint8_t *restrict q) {
    for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
            q[64 * j + l] = qs[32 * j + l] & 15;
            q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
    if (qh)
        for (int s = 0; s < 8; ++s)
            for (int l = 0; l < 32; ++l) q[32 * s + l] |= ((qh[l] >> s) & 1) << 4;
}

static inline float hi_kq_dot_k4_scalar(int nb, const uint8_t *vx, size_t bsize, int has_qh, const block_q8_K *restrict y) {
    float acc[8] = {0}, accm[4] = {0}, summs = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const uint8_t *b = vx + (size_t)i * bsize; /* d, dmin, scales[12], (qh[32],) qs[128] */
        hi_half hd, hm;
        memcpy(&hd, b, 2);
        memcpy(&hm, b + 2, 2);
        const float d = y[i].d * hi_kq_f16(hd);
        const float dmin = -y[i].d * hi_kq_f16(hm);
        uint8_t sm[16], q[256];
        hi_kq_scales_mins(b + 4, sm);
        int B[8], sc16[16], msum = 0;
        for (int s = 0; s < 8; ++s) {
            B[s] = y[i].bsums[2 * s] + y[i].bsums[2 * s + 1];
            sc16[2 * s] = sc16[2 * s + 1] = sm[s];
        }
        if (has_qh) {
            for (int s = 0; s < 8; ++s) msum += sm[8 + s] * B[s];
            summs = hi_kq_fmaf(dmin, (float)msum, summs);
        } else {
            for (int k = 0; k < 4; ++k)
                accm[k] = hi_kq_fmaf(dmin, (float)(sm[8 + 2 * k] * B[2 * k] + sm[9 + 2 * k] * B[2 * k + 1]), accm[k]);
        }
        hi_kq_unpack_k4(b + (has_qh ? 48 : 16), has_qh ? b + 16 : 0, q);
        int32_t lane[8] = {0};
        hi_kq_lanes_scalar(q, y[i].qs, sc16, lane);
        for (int k = 0; k < 8; ++k) acc[k] = hi_kq_fmaf(d, (float)lane[k], acc[k]);
    }
    return has_qh ? hi_kq_hsum8(acc) + summs : hi_kq_hsum8(acc) + hi_kq_hsum4(accm);
}

static inline float hi_dot_q4_K_q8_K_scalar(int n, const void *restrict vx, const void *restrict vy) {
    return hi_kq_dot_k4_scalar(n / HI_QK_K, (const uint8_t *)vx, sizeof(block_q4_K), 0, (const block_q8_K *)vy);
}

static inline float hi_dot_q5_K_q8_K_scalar(int n, const void *restrict vx, const void *restrict vy) {
    return hi_kq_dot_k4_scalar(n / HI_QK_K, (const uint8_t *)vx, sizeof(block_q5_K), 1, (const block_q8_K *)vy);
}

static inline float hi_dot_q6_K_q8_K_scalar(int n, const void *restrict vx, const void *restrict vy) {
    const block_q6_K *restrict x = (const block_q6_K *)vx;
    const block_q8_K *restrict y = (const block_q8_K *)vy;
    const int nb = n / HI_QK_K;
    float acc[8] = {0};
    for (int i = 0; i < nb; ++i) {
        const float d = y[i].d * hi_kq_f16(x[i].d);
        uint8_t q[256];
        for (int h = 0; h < 2; ++h) /* element 128h + 32r + l: nibble r/2 of ql[64h + 32(r&1) + l], bits 2r of qh[32h + l] */
            for (int r = 0; r < 4; ++r)
                for (int l = 0; l < 32; ++l)
                    q[128 * h + 32 * r + l] = (uint8_t)(((x[i].ql[64 * h + 32 * (r & 1) + l] >> (4 * (r >> 1))) & 15) |
                                                        (((x[i].qh[32 * h + l] >> (2 * r)) & 3) << 4));
        int sc16[16];
        int32_t lane[8];
        for (int j = 0; j < 16; ++j) sc16[j] = x[i].scales[j];
        for (int k = 0; k < 8; ++k) /* the -32 offset, through the activation sums */
            lane[k] = -32 * (sc16[2 * k] * y[i].bsums[2 * k] + sc16[2 * k + 1] * y[i].bsums[2 * k + 1]);
        hi_kq_lanes_scalar(q, y[i].qs, sc16, lane);
        for (int k = 0; k < 8; ++k) acc[k] = hi_kq_fmaf(d, (float)lane[k], acc[k]);
    }
    return hi_kq_hsum8(acc);
}

/* ------------------------------------------------------------------------------------------------ */
/* x86 SIMD helpers                                                                                  */

#if defined(__SSSE3__) || defined(__AVX2__)
/* (a0+a2) + (a1+a3) of a float vector: the tail of ggml's hsum_float_8 */
static inline float hi_kq_hsum4_ps(__m128 r) {
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_shuffle_ps(r, r, 0x55));
    return _mm_cvtss_f32(r);
}

static inline int hi_kq_hsum4_epi32(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1));
    return _mm_cvtsi128_si32(v);
}

/* fp16 -> float of 4 halves (zero-extended in 32-bit lanes) with SSE2 integer ops: hi_kq_f16's method */
static inline __m128 hi_kq_f16x4_sse2(__m128i h) {
    const __m128i two_w = _mm_slli_epi32(h, 17);
    const __m128 norm = _mm_mul_ps(_mm_castsi128_ps(_mm_add_epi32(_mm_srli_epi32(two_w, 4), _mm_set1_epi32(0xe0 << 23))),
                                   _mm_set1_ps(0x1.0p-112f));
    const __m128 den = _mm_sub_ps(_mm_castsi128_ps(_mm_or_si128(_mm_srli_epi32(two_w, 17), _mm_set1_epi32(126 << 23))),
                                  _mm_set1_ps(0.5f));
    const __m128i is_den = _mm_cmpeq_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7c00)), _mm_setzero_si128());
    const __m128i mag = _mm_or_si128(_mm_and_si128(is_den, _mm_castps_si128(den)), _mm_andnot_si128(is_den, _mm_castps_si128(norm)));
    return _mm_castsi128_ps(_mm_or_si128(mag, _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16)));
}

/* y.d * d of a Q6_K block (F16C as in hi_kq_d_dmin; the integer conversion otherwise) */
static inline float hi_kq_d1(hi_half h, float yd) {
#if defined(__F16C__)
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))) * yd;
#elif defined(__AVX2__) && defined(__GNUC__)
    __m128 f;
    __asm__("vcvtph2ps %1, %0" : "=x"(f) : "x"(_mm_cvtsi32_si128(h)));
    return _mm_cvtss_f32(f) * yd;
#else
    return hi_kq_f16(h) * yd;
#endif
}

/* lanes 0, 1: y.d * d and -y.d * dmin of a Q4_K / Q5_K block (d, dmin: the two halves at `dd`). Every CPU
 * with AVX2 has F16C; where the unit's flags do not say so (-mavx2 -mfma), the instruction is written out. */
static inline __m128 hi_kq_d_dmin(const hi_half *dd, float yd) {
    uint32_t u;
    memcpy(&u, dd, 4);
#if defined(__F16C__)
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)u));
#elif defined(__AVX2__) && defined(__GNUC__)
    __m128 f;
    __asm__("vcvtph2ps %1, %0" : "=x"(f) : "x"(_mm_cvtsi32_si128((int)u)));
#else
    const __m128 f = hi_kq_f16x4_sse2(_mm_unpacklo_epi16(_mm_cvtsi32_si128((int)u), _mm_setzero_si128()));
#endif
    return _mm_xor_ps(_mm_mul_ps(f, _mm_set1_ps(yd)), _mm_castsi128_ps(_mm_setr_epi32(0, (int)0x80000000u, 0, 0)));
}

/* the 8 six-bit scales (bytes 0..7) and mins (bytes 8..15) of a Q4_K / Q5_K block, by byte shuffles (the 16
 * bytes loaded from the 12 scale bytes end in the quants of the same block) */
static inline __m128i hi_kq_scales_mins_v(const uint8_t *s12) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s12);
    const __m128i acbc = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i xaxb = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i lo = _mm_and_si128(acbc, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(acbc, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(xaxb, 2), _mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48));
    return _mm_or_si128(_mm_or_si128(lo, hi), top);
}
#endif

#if defined(__SSSE3__) && !defined(__AVX2__)
/* the SSSE3 path's multiply-adds. Hosts with SSSE3 and no AVX2 have no FMA: by default a multiply and an
 * add (two roundings); with HI_KQ_SSSE3_FMA, ggml's fused rounding emulated in double precision. */
#if defined(__FMA__)
#define HI_KQ_SSE_FMA(a, b, c) _mm_fmadd_ps(a, b, c)
#define HI_KQ_SSE_FMA1(a, b, c) hi_kq_fmaf(a, b, c)
#elif defined(HI_KQ_SSSE3_FMA)
/* a*b + c for doubles holding floats: the product is exact; the sum is rounded to double with its error
 * (TwoSum) and moved to round-to-odd, after which the conversion to float rounds once, correctly */
static inline __m128d hi_kq_fma_rto_pd(__m128d a, __m128d b, __m128d c) {
    const __m128d p = _mm_mul_pd(a, b);
    const __m128d s = _mm_add_pd(p, c);
    const __m128d bv = _mm_sub_pd(s, p);
    const __m128d e = _mm_add_pd(_mm_sub_pd(p, _mm_sub_pd(s, bv)), _mm_sub_pd(c, bv));
    const __m128i inexact = _mm_castpd_si128(_mm_cmpneq_pd(e, _mm_setzero_pd()));
    const __m128i opposite = _mm_srli_epi64(_mm_castpd_si128(_mm_xor_pd(e, s)), 63);
    __m128i bits = _mm_sub_epi64(_mm_castpd_si128(s), _mm_and_si128(inexact, opposite));
    bits = _mm_or_si128(bits, _mm_and_si128(inexact, _mm_set_epi32(0, 1, 0, 1)));
    return _mm_castsi128_pd(bits);
}

static inline __m128 hi_kq_fma4_exact(__m128 a, __m128 b, __m128 c) {
    const __m128 lo = _mm_cvtpd_ps(hi_kq_fma_rto_pd(_mm_cvtps_pd(a), _mm_cvtps_pd(b), _mm_cvtps_pd(c)));
    const __m128 hi = _mm_cvtpd_ps(hi_kq_fma_rto_pd(_mm_cvtps_pd(_mm_movehl_ps(a, a)), _mm_cvtps_pd(_mm_movehl_ps(b, b)),
                                                    _mm_cvtps_pd(_mm_movehl_ps(c, c))));
    return _mm_movelh_ps(lo, hi);
}

static inline float hi_kq_fma1_exact(float a, float b, float c) {
    return _mm_cvtss_f32(_mm_cvtpd_ps(hi_kq_fma_rto_pd(_mm_set_sd(a), _mm_set_sd(b), _mm_set_sd(c))));
}
#define HI_KQ_SSE_FMA(a, b, c) hi_kq_fma4_exact(a, b, c)
#define HI_KQ_SSE_FMA1(a, b, c) hi_kq_fma1_exact(a, b, c)
#else
#define HI_KQ_SSE_FMA(a, b, c) _mm_add_ps(_mm_mul_ps(a, b), c)
static inline float hi_kq_muladd1(float a, float b, float c) {
    const float p = a * b;
    return p + c;
}
#define HI_KQ_SSE_FMA1(a, b, c) hi_kq_muladd1(a, b, c)
#endif
#endif

#if defined(__AVX2__)
/* fused multiply-add on 8 and 4 floats: FMA3, or its EVEX form where only AVX-512 is enabled */
#if defined(__FMA__)
#define HI_KQ_FMA8(a, b, c) _mm256_fmadd_ps(a, b, c)
#define HI_KQ_FMA4(a, b, c) _mm_fmadd_ps(a, b, c)
#elif defined(__AVX512F__) && defined(__AVX512VL__)
#define HI_KQ_FMA8(a, b, c) _mm256_mask3_fmadd_ps(a, b, c, (__mmask8)0xff)
#define HI_KQ_FMA4(a, b, c) _mm_mask3_fmadd_ps(a, b, c, (__mmask8)0x0f)
#else /* AVX2 without FMA (not a real CPU): not fused, last-bit differences possible */
#define HI_KQ_FMA8(a, b, c) _mm256_add_ps(_mm256_mul_ps(a, b), c)
#define HI_KQ_FMA4(a, b, c) _mm_add_ps(_mm_mul_ps(a, b), c)
#endif

/* ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)): ggml's hsum_float_8 */
static inline float hi_kq_hsum8_ps(__m256 a) {
    return hi_kq_hsum4_ps(_mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a)));
}

/* Q4_K / Q5_K: the min term's 4 lanes m[2k]*B[2k] + m[2k+1]*B[2k+1], B[s] = bsums[2s] + bsums[2s+1] */
static inline __m128i hi_kq_min_lanes(__m128i mins16, const int16_t *bsums) {
    const __m128i b = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bsums),
                                     _mm_loadu_si128((const __m128i *)(bsums + 8)));
    return _mm_madd_epi16(mins16, b);
}

/* Q6_K: 32 * (sc[2k]*bsums[2k] + sc[2k+1]*bsums[2k+1]), 8 lanes */
static inline __m256i hi_kq_q6_offset_lanes(const int8_t *scales, const int16_t *bsums) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales));
    return _mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bsums), sc16), 5);
}
#endif

/* the SIMD dot products, one file per weight type */
#include "dot_q4_K.h"
#include "dot_q5_K.h"
#include "dot_q6_K.h"
#include "dot_kq_shapes.h"

#endif /* HI_DOT_KQUANTS_H */

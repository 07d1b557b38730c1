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
 * Integer sums are exact (int32; every 16-bit intermediate is bounded below 2^15), so only the float steps
 * define the result, and they are those of the llama.cpp build for the unit's ISA level.
 *
 * AVX-512 VNNI and AVX2 units: ggml's AVX2 kernels (what llama.cpp runs on x86 hosts with AVX2 or better):
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
 *
 * SSSE3 and scalar units: ggml's generic kernels (ggml_vec_dot_q*_K_q8_K_generic), which llama.cpp runs when
 * built without AVX (its SSE4.2 and baseline x86-64 builds), compiled with no FMA:
 *   - 8 int32 lanes per block, lane l = sum over the block's elements e with e % 8 == l of sc(e) * a[e] * q8[e]
 *     (Q6_K: a = q - 32, signed), sc(e) the scale of e's sub-block;
 *   - sums[l] += (d*D) * (float)lane[l]: a float product, then a float sum (d*D rounded to float first);
 *   - Q4_K, Q5_K: sumf -= (dmin*D) * (float)(sum_s m[s]*B[s]), per block (sumf starts at 0);
 *   - the result: sumf += sums[l] for l = 0..7 in turn.
 * The AVX paths and these do their float operations exactly (fused multiply-adds as fma, the generic products
 * and sums as separate roundings), so each unit's result is that llama.cpp build's bit for bit. A product and
 * the sum it feeds are kept apart (hi_kq_nofuse), so a unit compiled with FMA enabled still does not fuse
 * them.
 *
 * The path is chosen by the ISA macros of the including compilation unit:
 *   __AVX512VNNI__ && __AVX512VL__ && __AVX512BW__ : vpdpbusd (and vpdpwssd for the scales)
 *   __AVX2__                                       : pmaddubsw + pmaddwd on 32 bytes (-mavx2 -mfma)
 *   __SSSE3__                                      : pmaddubsw + pmaddwd on 16 bytes, no SSE4.1; the engine calls
 *       hi_dot_q*_K_z on activations prepared once per product (hi_kq_prep_z: zipped, with their sums), on rows
 *       zipped at load (hi_repack_rows) or zipped as they are read; hi_dot_q*_K_q8_K prepares per call
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

/* keeps v in a register between a product and the sum it feeds: no contraction into a fused multiply-add,
 * whatever -ffp-contract says (ggml's generic kernels are built without FMA) */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define hi_kq_nofuse(v) __asm__("" : "+x"(v))
#elif defined(__GNUC__) && defined(__aarch64__)
#define hi_kq_nofuse(v) __asm__("" : "+w"(v))
#else
#define hi_kq_nofuse(v) ((void)0)
#endif

/* ggml's generic float steps: sums[l] += d * (float)lane[l], the product rounded on its own */
static inline void hi_kq_gen_acc(float *restrict sums, float d, const int32_t *restrict lane) {
    for (int l = 0; l < 8; ++l) {
        float p = d * (float)lane[l];
        hi_kq_nofuse(p);
        sums[l] += p;
    }
}

/* sumf - dmin * (float)imin, the product rounded on its own */
static inline float hi_kq_gen_sub(float sumf, float dmin, int32_t imin) {
    float p = dmin * (float)imin;
    hi_kq_nofuse(p);
    return sumf - p;
}

/* the generic kernels' end: sumf += sums[l] for l = 0..7, in that order */
static inline float hi_kq_gen_end(float sumf, const float *sums) {
    for (int l = 0; l < 8; ++l) sumf += sums[l];
    return sumf;
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
/* portable scalar versions: ggml's generic kernels                                                   */

/* lane[l] += sum over the block's 32 octets o of sc8[o] * sum_{e = 8o + l} a[e] * q8[e] */
static inline void hi_kq_gen_lanes(const int8_t *restrict a, const int8_t *restrict q8, const int *restrict sc8,
                                   int32_t *restrict lane) {
    for (int o = 0; o < 32; ++o)
        for (int l = 0; l < 8; ++l) lane[l] += sc8[o] * (a[8 * o + l] * q8[8 * o + l]);
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
    float sums[8] = {0}, sumf = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const uint8_t *b = vx + (size_t)i * bsize; /* d, dmin, scales[12], (qh[32],) qs[128] */
        hi_half hd, hm;
        memcpy(&hd, b, 2);
        memcpy(&hm, b + 2, 2);
        uint8_t sm[16], q[256];
        hi_kq_scales_mins(b + 4, sm);
        int32_t imin = 0;
        int sc8[32];
        for (int j = 0; j < 16; ++j) imin += y[i].bsums[j] * sm[8 + j / 2];
        for (int o = 0; o < 32; ++o) sc8[o] = sm[o / 4];
        hi_kq_unpack_k4(b + (has_qh ? 48 : 16), has_qh ? b + 16 : 0, q);
        int32_t lane[8] = {0};
        hi_kq_gen_lanes((const int8_t *)q, y[i].qs, sc8, lane);
        hi_kq_gen_acc(sums, hi_kq_f16(hd) * y[i].d, lane);
        sumf = hi_kq_gen_sub(sumf, hi_kq_f16(hm) * y[i].d, imin);
    }
    return hi_kq_gen_end(sumf, sums);
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
    float sums[8] = {0};
    for (int i = 0; i < nb; ++i) {
        int8_t a[256];
        for (int h = 0; h < 2; ++h) /* element 128h + 32r + l: nibble r/2 of ql[64h + 32(r&1) + l], bits 2r of qh[32h + l] */
            for (int r = 0; r < 4; ++r)
                for (int l = 0; l < 32; ++l)
                    a[128 * h + 32 * r + l] = (int8_t)((((x[i].ql[64 * h + 32 * (r & 1) + l] >> (4 * (r >> 1))) & 15) |
                                                        (((x[i].qh[32 * h + l] >> (2 * r)) & 3) << 4)) - 32);
        int sc8[32];
        for (int o = 0; o < 32; ++o) sc8[o] = x[i].scales[o / 2];
        int32_t lane[8] = {0};
        hi_kq_gen_lanes(a, y[i].qs, sc8, lane);
        hi_kq_gen_acc(sums, hi_kq_f16(x[i].d) * y[i].d, lane);
    }
    return hi_kq_gen_end(0.0f, sums);
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
/* byte order that puts the two octets of 16 bytes side by side, element l of each next to the other: pmaddubsw
 * then sums the products of lane l over both octets */
#define HI_KQ_ZIP_OCTETS _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15)

/* Q6_K's pair order: of 32 bytes (a: the first 16 elements of a 32-element group, sub-block 0; b: the next 16,
 * sub-block 1), v0 gets lanes 0..3 and v1 lanes 4..7, each lane as two byte pairs, (sub-block 0's elements l,
 * l + 8), then (sub-block 1's l, l + 8). pmaddubsw then gives the lane sums of both sub-blocks interleaved, as
 * _mm_unpack{lo,hi}_epi16 of the two sub-blocks' zipped lane sums would: pmaddwd applies the two scales at once. */
static inline void hi_kq_q6_pair(__m128i a, __m128i b, __m128i *v0, __m128i *v1) {
    *v0 = _mm_or_si128(_mm_shuffle_epi8(a, _mm_setr_epi8(0, 8, -1, -1, 1, 9, -1, -1, 2, 10, -1, -1, 3, 11, -1, -1)),
                       _mm_shuffle_epi8(b, _mm_setr_epi8(-1, -1, 0, 8, -1, -1, 1, 9, -1, -1, 2, 10, -1, -1, 3, 11)));
    *v1 = _mm_or_si128(_mm_shuffle_epi8(a, _mm_setr_epi8(4, 12, -1, -1, 5, 13, -1, -1, 6, 14, -1, -1, 7, 15, -1, -1)),
                       _mm_shuffle_epi8(b, _mm_setr_epi8(-1, -1, 4, 12, -1, -1, 5, 13, -1, -1, 6, 14, -1, -1, 7, 15)));
}

/* Q4_K's pair order, for the 64 elements of a step (two sub-blocks of 32: c0, c1 the first one's halves, c2, c3
 * the second's): the four vectors that pmaddubsw meets against the step's weights (hi_kq_k4_block), each lane as
 * byte pairs of the first sub-block then of the second, so that the two sub-blocks' lane sums come side by side:
 * out[0], out[2]: elements l, l + 8 of c0 / c2 (out[0]: lanes 0..3, out[2]: 4..7); out[1], out[3]: of c1 / c3 */
static inline void hi_kq_q4_pair(__m128i c0, __m128i c1, __m128i c2, __m128i c3, __m128i out[4]) {
    hi_kq_q6_pair(c0, c2, &out[0], &out[2]);
    hi_kq_q6_pair(c1, c3, &out[1], &out[3]);
}

/* a Q4_K step's 32 quant bytes (b0, b1: element l's nibble in byte l % 32, low for l < 32 (the first sub-block),
 * high for the second) in Q4_K's pair order: the low nibbles of the new b0 / b1 are out[0] / out[2] of
 * hi_kq_q4_pair over the step's elements, their high nibbles out[1] / out[3] */
static inline void hi_kq_q4_weights(__m128i b0, __m128i b1, __m128i *n0, __m128i *n1) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i v[4];
    hi_kq_q4_pair(_mm_and_si128(b0, m4), _mm_and_si128(b1, m4), _mm_and_si128(_mm_srli_epi16(b0, 4), m4),
                  _mm_and_si128(_mm_srli_epi16(b1, 4), m4), v);
    *n0 = _mm_or_si128(v[0], _mm_slli_epi16(v[1], 4));
    *n1 = _mm_or_si128(v[2], _mm_slli_epi16(v[3], 4));
}

/* A Q8_K activation block prepared once per product for the SSSE3 dots (hi_kq_prep_z), so that no row repeats
 * the work: its quants zipped (every 16 bytes by HI_KQ_ZIP_OCTETS) for Q5_K and Q4_K rows read as stored in the
 * file, in Q4_K's pair order for repacked Q4_K rows and in Q6_K's, the sub-block sums of the Q4_K / Q5_K min
 * term, and Q6_K's -32 offsets in pmaddubsw's lanes. Same integers and floats as from the block itself. */
typedef struct {
    float d;
    int16_t B[8];    /* bsums[2s] + bsums[2s+1]: the sum of q8 over sub-block s of 32 */
    int8_t pad[12];
    int8_t qs[256];  /* q8, 16 bytes at a time zipped */
    int8_t q4[256];  /* q8, 64 bytes at a time in Q4_K's pair order (hi_kq_q4_pair) */
    int8_t q6[256];  /* q8, 32 bytes at a time in Q6_K's pair order (hi_kq_q6_pair) */
    int16_t o6[128]; /* 32 * (a pair's two q8 in q6): what pmaddubsw(32, q6) gives, lane for lane */
} hi_q8Kz;
_Static_assert(sizeof(hi_q8Kz) == 1056, "hi_q8Kz");

static inline void hi_kq_prep_z(const block_q8_K *restrict y, int nb, hi_q8Kz *restrict z) {
    const __m128i zip = HI_KQ_ZIP_OCTETS, m32 = _mm_set1_epi8(32);
    for (int i = 0; i < nb; ++i) {
        z[i].d = y[i].d;
        memset(z[i].pad, 0, sizeof(z[i].pad));
        _mm_storeu_si128((__m128i *)z[i].B, _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)y[i].bsums),
                                                           _mm_loadu_si128((const __m128i *)(y[i].bsums + 8))));
        for (int j = 0; j < 4; ++j) { /* 64 quants, loaded once: zipped 16 at a time, in both pair orders */
            __m128i c[4], v[4];
            for (int h = 0; h < 4; ++h) {
                c[h] = _mm_loadu_si128((const __m128i *)(y[i].qs + 64 * j + 16 * h));
                _mm_storeu_si128((__m128i *)(z[i].qs + 64 * j + 16 * h), _mm_shuffle_epi8(c[h], zip));
            }
            hi_kq_q4_pair(c[0], c[1], c[2], c[3], v);
            for (int h = 0; h < 4; ++h) _mm_storeu_si128((__m128i *)(z[i].q4 + 64 * j + 16 * h), v[h]);
            hi_kq_q6_pair(c[0], c[1], &v[0], &v[1]);
            hi_kq_q6_pair(c[2], c[3], &v[2], &v[3]);
            for (int h = 0; h < 4; ++h) {
                _mm_storeu_si128((__m128i *)(z[i].q6 + 64 * j + 16 * h), v[h]);
                _mm_storeu_si128((__m128i *)(z[i].o6 + 32 * j + 8 * h), _mm_maddubs_epi16(m32, v[h]));
            }
        }
    }
}

/* fp16 -> float for the SSSE3 dots: a table of every half (256 KiB, filled when the unit is loaded), as
 * llama.cpp's builds without F16C convert; two loads beat the branch-free conversion by 10% of a Q4_K dot */
static float hi_kq_f16_tab[1 << 16];
__attribute__((constructor)) static void hi_kq_f16_tab_init(void) {
    for (uint32_t h = 0; h < (1u << 16); ++h) hi_kq_f16_tab[h] = hi_kq_f16((hi_half)h);
}

/* ggml's generic float steps on the block's lanes (l = 0..3 in lo, 4..7 in hi): sums[l] += d * (float)lane[l]
 * (vd: d in every lane) */
static inline void hi_kq_gen_acc_ps(__m128 *s0, __m128 *s1, __m128 vd, __m128i lo, __m128i hi) {
    __m128 p0 = _mm_mul_ps(vd, _mm_cvtepi32_ps(lo)), p1 = _mm_mul_ps(vd, _mm_cvtepi32_ps(hi));
    hi_kq_nofuse(p0);
    hi_kq_nofuse(p1);
    *s0 = _mm_add_ps(*s0, p0);
    *s1 = _mm_add_ps(*s1, p1);
}

static inline float hi_kq_gen_end_ps(float sumf, __m128 s0, __m128 s1) {
    float sums[8];
    _mm_storeu_ps(sums, s0);
    _mm_storeu_ps(sums + 4, s1);
    return hi_kq_gen_end(sumf, sums);
}

/* Q4_K / Q5_K, the generic kernels' per-block float steps from the block's 8 lanes (lo, hi), its scales and mins
 * sm (hi_kq_scales_mins_v) and its fp16 d, dmin: sums[l] += (d*D) * lane[l] here; sumf -= (dmin*D) * sum_s
 * m[s]*B[s] is left to hi_kq_k4_min2 (or hi_kq_gen_sub), given the returned 4 lanes of m[s]*B[s] and *dmin */
static inline __m128i hi_kq_k4_block_acc(const hi_half *dd, const hi_q8Kz *y, __m128i sm, __m128i lo, __m128i hi,
                                         __m128 *s0, __m128 *s1, float *dmin) {
    const float d = hi_kq_f16_tab[dd[0]] * y->d;
    *dmin = hi_kq_f16_tab[dd[1]] * y->d;
    hi_kq_gen_acc_ps(s0, s1, _mm_set1_ps(d), lo, hi);
    return _mm_madd_epi16(_mm_unpackhi_epi8(sm, _mm_setzero_si128()), _mm_loadu_si128((const __m128i *)y->B));
}

/* the min terms of two consecutive blocks, in their order: (sumf - dm0 * i0) - dm1 * i1, i the sums of the lanes
 * v0, v1; the two horizontal sums and int -> float conversions shared (8 vector ops a block against 12) */
static inline float hi_kq_k4_min2(float sumf, __m128i v0, __m128i v1, float dm0, float dm1) {
    const __m128i u = _mm_add_epi32(_mm_unpacklo_epi64(v0, v1), _mm_unpackhi_epi64(v0, v1));
    const __m128 f = _mm_cvtepi32_ps(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1))); /* i0, i0, i1, i1 */
    float p0 = dm0 * _mm_cvtss_f32(f), p1 = dm1 * _mm_cvtss_f32(_mm_movehl_ps(f, f));
    hi_kq_nofuse(p0);
    hi_kq_nofuse(p1);
    return (sumf - p0) - p1;
}

/* Q4_K / Q5_K: the 8 lanes of one 64-element step from the zipped quants of its two sub-blocks (w[0], w[1]:
 * elements 0..31, w[2], w[3]: 32..63, each as two zipped 16-byte halves), the zipped q8 of the step and the two
 * sub-blocks' scales scl (int16 pair): lanes 0..3 into lo, 4..7 into hi */
static inline __attribute__((always_inline)) void hi_kq_k4_step_sse(const __m128i *w, const int8_t *q8z, __m128i scl,
                                                                   __m128i *lo, __m128i *hi) {
    __m128i p[2];
    for (int s = 0; s < 2; ++s) /* sub-block s of the step: 4 octets, sums of lane l in int16 (|.| <= 4*31*128) */
        p[s] = _mm_add_epi16(_mm_maddubs_epi16(w[2 * s], _mm_loadu_si128((const __m128i *)(q8z + 32 * s))),
                             _mm_maddubs_epi16(w[2 * s + 1], _mm_loadu_si128((const __m128i *)(q8z + 32 * s + 16))));
    /* (lane l of sub-block 0, lane l of sub-block 1) pairs against (sc0, sc1) */
    *lo = _mm_add_epi32(*lo, _mm_madd_epi16(_mm_unpacklo_epi16(p[0], p[1]), scl));
    *hi = _mm_add_epi32(*hi, _mm_madd_epi16(_mm_unpackhi_epi16(p[0], p[1]), scl));
}

/* the 16 bytes at p, zipped unless the row is stored zipped already (wz) */
static inline __m128i hi_kq_load_z(const uint8_t *p, const int wz) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return wz ? v : _mm_shuffle_epi8(v, HI_KQ_ZIP_OCTETS);
}

/* K-quant weight blocks (nb of type qtype at p) repacked in place for these kernels, as they would rearrange every
 * row they read (wz): each Q4_K block's qs in Q4_K's pair order 32 bytes at a time (hi_kq_q4_weights), each Q5_K
 * block's qh and qs zipped 16 at a time (hi_kq_load_z), each Q6_K block's ql and qh as pair-order 6-bit quants,
 * three vectors per four (hi_kq_q6_repack_block, dot_q6_K.h) */
static inline void hi_kq_q6_repack_block(uint8_t *p);
static inline void hi_kq_zip_blocks(int qtype, uint8_t *p, int64_t nb) {
    const size_t bs = qtype == 12 ? sizeof(block_q4_K) : qtype == 13 ? sizeof(block_q5_K) : sizeof(block_q6_K);
    for (int64_t i = 0; i < nb; ++i, p += bs) {
        if (qtype == 14) {
            hi_kq_q6_repack_block(p);
        } else if (qtype == 13) {
            for (size_t k = 16; k < 16 + 160; k += 16) _mm_storeu_si128((__m128i *)(p + k), hi_kq_load_z(p + k, 0));
        } else {
            for (size_t k = 16; k < 16 + 128; k += 32) {
                __m128i v[2];
                hi_kq_q4_weights(_mm_loadu_si128((const __m128i *)(p + k)), _mm_loadu_si128((const __m128i *)(p + k + 16)),
                                 &v[0], &v[1]);
                _mm_storeu_si128((__m128i *)(p + k), v[0]);
                _mm_storeu_si128((__m128i *)(p + k + 16), v[1]);
            }
        }
    }
}

/* the row layouts hi_kq_dot_k4 reads: Q4_K repacked in pair order (hi_kq_q4_weights), Q4_K as the file stores it
 * (zipped as it is read), Q5_K (zipped as it is read unless repacked zipped: wz) */
enum { HI_K4_Q4P, HI_K4_Q4, HI_K4_Q5 };

/* one block's integer lanes and float sums (hi_kq_k4_block_acc) of ggml's generic Q4_K / Q5_K kernel, layout kind.
 * Q4_K in pair order: per step one pmaddubsw pair gives lanes 0..3 of both sub-blocks side by side (another 4..7),
 * and pmaddwd against the two scales adds them into the int32 lanes as ggml's loop does. Zipped: octets zipped so
 * that pmaddubsw sums lane l (element % 8) of two octets, per sub-block, then unpacked into pairs for pmaddwd (8
 * more vector ops a block: rearranging rows read from the file into pair order would cost 12 shuffles a step,
 * zipping costs 2); Q5_K's fifth bits come from qh, zipped like the quants. Same integers either way. */
static inline __attribute__((always_inline)) __m128i hi_kq_k4_block(const uint8_t *restrict b, const hi_q8Kz *restrict y,
                                                                    const int kind, const int wz, __m128 *s0,
                                                                    __m128 *s1, float *dmin) {
    const __m128i m4 = _mm_set1_epi8(0x0f), m16 = _mm_set1_epi8(0x10);
    const uint8_t *qs = b + (kind == HI_K4_Q5 ? 48 : 16);
    hi_half dd[2];
    memcpy(dd, b, 4);
    const __m128i sm = hi_kq_scales_mins_v(b + 4);
    const __m128i sc16 = _mm_unpacklo_epi8(sm, _mm_setzero_si128()); /* dword j: (sc[2j], sc[2j+1]) */
    __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
    if (kind == HI_K4_Q4P) {
        const int8_t *q4 = y->q4;
        /* lanes (0..3 for h = 0, 4..7 for h = 1) of both sub-blocks of step j, from the 16 weight bytes w */
#define HI_KQ_Q4_DOT(w, j, h)                                                                              \
        _mm_add_epi16(_mm_maddubs_epi16(_mm_and_si128(w, m4), _mm_loadu_si128((const __m128i *)(q4 + 64 * (j) + 32 * (h)))), \
                      _mm_maddubs_epi16(_mm_and_si128(_mm_srli_epi16(w, 4), m4),                           \
                                        _mm_loadu_si128((const __m128i *)(q4 + 64 * (j) + 32 * (h) + 16))))
#define HI_KQ_Q4_STEP(j)                                                                                   \
        {                                                                                                  \
            const __m128i b0 = _mm_loadu_si128((const __m128i *)(qs + 32 * (j)));                          \
            const __m128i b1 = _mm_loadu_si128((const __m128i *)(qs + 32 * (j) + 16));                     \
            const __m128i scl = _mm_shuffle_epi32(sc16, (j) * 0x55);                                       \
            lo = _mm_add_epi32(lo, _mm_madd_epi16(HI_KQ_Q4_DOT(b0, j, 0), scl));                           \
            hi = _mm_add_epi32(hi, _mm_madd_epi16(HI_KQ_Q4_DOT(b1, j, 1), scl));                           \
        }
        HI_KQ_Q4_STEP(0)
        HI_KQ_Q4_STEP(1)
        HI_KQ_Q4_STEP(2)
        HI_KQ_Q4_STEP(3)
#undef HI_KQ_Q4_STEP
#undef HI_KQ_Q4_DOT
    } else {
        const int has_qh = kind == HI_K4_Q5;
        const __m128i qh0 = has_qh ? hi_kq_load_z(b + 16, wz) : _mm_setzero_si128();
        const __m128i qh1 = has_qh ? hi_kq_load_z(b + 32, wz) : _mm_setzero_si128();
        /* bit s of each qh byte to bit 4: shift the 16-bit words by 4 - s, keep bit 4 of each byte */
#define HI_KQ_BIT4(v, s) _mm_and_si128((s) <= 4 ? _mm_slli_epi16(v, 4 - (s)) : _mm_srli_epi16(v, (s) - 4), m16)
#define HI_KQ_K4_STEP(j)                                                                                   \
        {                                                                                                  \
            const __m128i b0 = hi_kq_load_z(qs + 32 * (j), wz), b1 = hi_kq_load_z(qs + 32 * (j) + 16, wz); \
            __m128i w[4] = {_mm_and_si128(b0, m4), _mm_and_si128(b1, m4), _mm_and_si128(_mm_srli_epi16(b0, 4), m4), \
                            _mm_and_si128(_mm_srli_epi16(b1, 4), m4)};                                      \
            if (has_qh) {                                                                                  \
                w[0] = _mm_or_si128(w[0], HI_KQ_BIT4(qh0, 2 * (j)));                                       \
                w[1] = _mm_or_si128(w[1], HI_KQ_BIT4(qh1, 2 * (j)));                                       \
                w[2] = _mm_or_si128(w[2], HI_KQ_BIT4(qh0, 2 * (j) + 1));                                   \
                w[3] = _mm_or_si128(w[3], HI_KQ_BIT4(qh1, 2 * (j) + 1));                                   \
            }                                                                                              \
            hi_kq_k4_step_sse(w, y->qs + 64 * (j), _mm_shuffle_epi32(sc16, (j) * 0x55), &lo, &hi);        \
        }
        HI_KQ_K4_STEP(0)
        HI_KQ_K4_STEP(1)
        HI_KQ_K4_STEP(2)
        HI_KQ_K4_STEP(3)
#undef HI_KQ_K4_STEP
#undef HI_KQ_BIT4
    }
    return hi_kq_k4_block_acc(dd, y, sm, lo, hi, s0, s1, dmin);
}

/* ggml's generic Q4_K / Q5_K kernel on a prepared activation row (hi_kq_prep_z): nb blocks of layout kind (wz:
 * Q5_K's stored zipped), their min terms two blocks at a time */
static inline __attribute__((always_inline)) float hi_kq_dot_k4(int nb, const uint8_t *restrict vx,
                                                                const hi_q8Kz *restrict y, const int kind, const int wz) {
    const size_t bs = kind == HI_K4_Q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    __m128 sums0 = _mm_setzero_ps(), sums1 = _mm_setzero_ps();
    float sumf = 0.0f, dm0, dm1;
    int i = 0;
    for (; i + 1 < nb; i += 2) {
        const __m128i v0 = hi_kq_k4_block(vx + (size_t)i * bs, &y[i], kind, wz, &sums0, &sums1, &dm0);
        const __m128i v1 = hi_kq_k4_block(vx + (size_t)(i + 1) * bs, &y[i + 1], kind, wz, &sums0, &sums1, &dm1);
        sumf = hi_kq_k4_min2(sumf, v0, v1, dm0, dm1);
    }
    if (i < nb) {
        const __m128i v0 = hi_kq_k4_block(vx + (size_t)i * bs, &y[i], kind, wz, &sums0, &sums1, &dm0);
        sumf = hi_kq_gen_sub(sumf, dm0, hi_kq_hsum4_epi32(v0));
    }
    return hi_kq_gen_end_ps(sumf, sums0, sums1);
}

/* Q4_K rows repacked in pair order (wz) or as stored in the file */
static inline float hi_dot_q4_K_z(int n, const void *restrict vx, const hi_q8Kz *restrict y, const int wz) {
    return wz ? hi_kq_dot_k4(n / HI_QK_K, (const uint8_t *)vx, y, HI_K4_Q4P, 1)
              : hi_kq_dot_k4(n / HI_QK_K, (const uint8_t *)vx, y, HI_K4_Q4, 0);
}

/* Q5_K rows repacked zipped (wz) or as stored in the file */
static inline float hi_dot_q5_K_z(int n, const void *restrict vx, const hi_q8Kz *restrict y, const int wz) {
    return wz ? hi_kq_dot_k4(n / HI_QK_K, (const uint8_t *)vx, y, HI_K4_Q5, 1)
              : hi_kq_dot_k4(n / HI_QK_K, (const uint8_t *)vx, y, HI_K4_Q5, 0);
}

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

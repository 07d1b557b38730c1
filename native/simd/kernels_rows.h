/* One weight row against a group of tokens in GGML_DECODE_ROWS (hi_mm.rows1): every (row, token) result
 * bit-identical to that token's one-token product, each weight block unpacked once for the whole group.
 * A part of kernels_tiles.h (kernels_body.h has the ISA macros), included by it once per ISA unit.
 *
 * The maths. A one-token dot (dot_kquants.h, dot_kq_shapes.h, hi_tile_float, the generic legacy loops) is, block by
 * block, exact integer sums followed by float steps on that token's own accumulators:
 *   Q4_K / Q5_K, vec_dot shape (AVX units):
 *       lane[k] = sum_s sc[s] * sum_{e in 4k..4k+3} q[32s+e] * q8[32s+e]           (k < 8; s the 8 sub-blocks)
 *       acc[k]  = fma(d*D, (float)lane[k], acc[k])
 *       Q4_K: minl[k] = m[2k]*B[2k] + m[2k+1]*B[2k+1] (k < 4), accm[k] = fma(-(dmin*D), (float)minl[k], accm[k]);
 *             row = hsum8(acc) + hsum4(accm)
 *       Q5_K: summs = fma(-(dmin*D), (float)sum_s m[s]*B[s], summs);  row = hsum8(acc) + summs
 *   Q4_K, repacked gemv shape:  acc = fma((float)isum, d*D, acc), accm = fma((float)imin, dmin*D, accm), row = acc - accm
 *       (isum = sum_k lane[k], imin = sum_s m[s]*B[s])
 *   Q6_K, vec_dot shape: lane[k] as above over the 16 sub-blocks of 16 with q unsigned, minus
 *       32*(sc[2k]*bsums[2k] + sc[2k+1]*bsums[2k+1]);  acc[k] = fma(d*D, (float)lane[k], acc[k]);  row = hsum8(acc)
 *   F32 / F16: the vec_dot accumulators a0..a3 of fma(w, x, a) over steps of 4 vectors, then hi_tile_float's end
 *   legacy below AVX: ggml's generic loop, sumf += (its product of isum, dx, dy), or the SSSE3 Q4_0 / Q8_0 kernels
 * (D, bsums, B: the token's Q8_K block; d, dmin, sc, m, q: the weight block's). Only the integers are shared work:
 * they are exact whatever instructions or order form them, so they come here from one unpacked copy of the block
 * (nibbles split, fifth and sixth bits merged, scales and mins decoded and spread once) against each token's
 * activations, some of them as 512-bit sums of two 256-bit halves, or totals by a transposing tree. The float
 * steps are the one-token kernel's, per token, in its order: the same roundings of the same products (d*D, dmin*D
 * formed as there), lane-wise vector fmas where it has scalar or vector ones (an fma is one rounding either way),
 * and its horizontal sums at the end. So which tokens share a group, and how many, changes no bit.
 */
#ifndef HI_INLINE
#error "kernels_rows.h is a part of kernels_tiles.h; include kernels_body.h"
#endif

#include <stdlib.h>

/* ================================================================================================ */
/* K-quants on the AVX units: the group's tokens prepared once per chunk of rows */

#if defined(HI_AVX2)
/* tokens a group: one octet (the VNNI kernels are written for several; two, 64 KiB of activations at 4096 elements a
 * row, no longer stay in L1 while the rows pass, which costs more than unpacking each block twice) */
#define HI_KG 8
#define HI_KO (HI_KG / 8)

/* A group of tokens as the K-quant kernels read them: their Q8_K rows, and per block i and octet o of tokens
 *   Dz[i][o][16]: D of the octet's tokens 0, 2, 4, 6, 1, 3, 5, 7 (the VNNI tree's order), then 0..7;
 *   Bz[i][o][32]: int16 pairs (B[2p], B[2p+1]) (B[s] = bsums[2s] + bsums[2s+1]), dword 8p + l for token l,
 * zero for tokens past cnt (whose rows are the first token's) */
typedef struct {
    const block_q8_K *y[HI_KG];
    const int8_t *q8[HI_KG]; /* the rows' quants, 256 bytes a block, 64-byte aligned (a 64-byte load of the rows
                              * themselves, 292-byte blocks, nearly always spans two cache lines: twice the cost) */
    int cnt;
    const float *Dz;
    const int32_t *Bz;
} hi_kgrp;

/* bytes of a group's preparation per block (buf: 64-byte aligned) */
HI_INLINE size_t hi_kgrp_bytes(const int cnt) { return (size_t)cnt * HI_QK_K + HI_KO * (16 * 4 + 32 * 4); }

HI_INLINE void hi_kgrp_prep(hi_kgrp *g, const hi_mm *m, int64_t t, const int cnt, int64_t nb, uint8_t *buf) {
    float *Dz = (float *)(buf + (size_t)cnt * nb * HI_QK_K);
    int32_t *Bz = (int32_t *)((uint8_t *)Dz + (size_t)nb * HI_KO * 16 * 4);
    for (int k = 0; k < HI_KG; k++) {
        g->y[k] = (const block_q8_K *)(m->x + (size_t)(t + (k < cnt ? k : 0)) * m->x_row);
        g->q8[k] = (const int8_t *)buf + (size_t)(k < cnt ? k : 0) * nb * HI_QK_K;
    }
    g->cnt = cnt;
    g->Dz = Dz;
    g->Bz = Bz;
    for (int k = 0; k < cnt; k++) {
        int8_t *q = (int8_t *)g->q8[k];
        for (int64_t i = 0; i < nb; i++) {
            HI_UNROLL for (int c = 0; c < HI_QK_K; c += 32)
                _mm256_store_si256((__m256i *)(q + i * HI_QK_K + c), _mm256_loadu_si256((const __m256i *)(g->y[k][i].qs + c)));
        }
    }
    const int ord[8] = {0, 2, 4, 6, 1, 3, 5, 7};
    for (int64_t i = 0; i < nb; i++) {
        for (int o = 0; o < HI_KO; o++) {
            float *d = Dz + (i * HI_KO + o) * 16;
            int32_t *b = Bz + (i * HI_KO + o) * 32;
            float D[8];
            __m128i v[8]; /* token l: dword p = (B[2p], B[2p+1]) */
            HI_UNROLL for (int l = 0; l < 8; l++) {
                const int k = 8 * o + l;
                D[l] = k < cnt ? g->y[k][i].d : 0.0f;
                v[l] = k < cnt ? _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)g->y[k][i].bsums),
                                                _mm_loadu_si128((const __m128i *)(g->y[k][i].bsums + 8)))
                               : _mm_setzero_si128();
            }
            HI_UNROLL for (int l = 0; l < 8; l++) {
                d[l] = D[ord[l]];
                d[8 + l] = D[l];
            }
            HI_UNROLL for (int h = 0; h < 2; h++) { /* tokens 4h..4h+3: a 4 x 4 transpose */
                const __m128i t0 = _mm_unpacklo_epi32(v[4 * h], v[4 * h + 1]), t1 = _mm_unpackhi_epi32(v[4 * h], v[4 * h + 1]);
                const __m128i t2 = _mm_unpacklo_epi32(v[4 * h + 2], v[4 * h + 3]), t3 = _mm_unpackhi_epi32(v[4 * h + 2], v[4 * h + 3]);
                _mm_storeu_si128((__m128i *)(b + 4 * h), _mm_unpacklo_epi64(t0, t2));
                _mm_storeu_si128((__m128i *)(b + 8 + 4 * h), _mm_unpackhi_epi64(t0, t2));
                _mm_storeu_si128((__m128i *)(b + 16 + 4 * h), _mm_unpacklo_epi64(t1, t3));
                _mm_storeu_si128((__m128i *)(b + 24 + 4 * h), _mm_unpackhi_epi64(t1, t3));
            }
        }
    }
}
#endif

#if defined(HI_VNNI)
/* [a.lo + a.hi | b.lo + b.hi]: two tokens' 8 lanes from their 16-lane sums */
HI_INLINE __m512i hi_r_pair(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xee));
}

/* the upper 8 floats (AVX512F: no DQ) */
HI_INLINE __m256 hi_r_hi8(__m512 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }

/* lanes 0..7 v[i], lanes 8..15 v[j] */
HI_INLINE __m512 hi_r_spread2(__m256 v, const int i, const int j) {
    const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(i), _mm256_set1_epi32(j), 1);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v));
}

/* an octet's 16-lane integer sums S[0..7] and the imin halves I (lane l: token l's first part, lane 8 + l its
 * second) as [totals of S of tokens 0, 2, 4, 6 | of 1, 3, 5, 7 | imin of tokens 0..3 | of 4..7] */
HI_INLINE __m512i hi_r_tree8(const __m512i *S, __m512i I) {
    const __m512i R01 = hi_r_pair(S[0], S[1]), R23 = hi_r_pair(S[2], S[3]);
    const __m512i R45 = hi_r_pair(S[4], S[5]), R67 = hi_r_pair(S[6], S[7]);
    /* per 128-bit lane: two partial sums of each of the two inputs */
    const __m512i A = _mm512_add_epi32(_mm512_unpacklo_epi64(R01, R23), _mm512_unpackhi_epi64(R01, R23));
    const __m512i B = _mm512_add_epi32(_mm512_unpacklo_epi64(R45, R67), _mm512_unpackhi_epi64(R45, R67));
    /* per 128-bit lane: [R01, R23, R45, R67]; lanes 0 and 1 hold tokens 0, 2, 4, 6, lanes 2 and 3 tokens 1, 3, 5, 7 */
    const __m512 fa = _mm512_castsi512_ps(A), fb = _mm512_castsi512_ps(B);
    const __m512i E = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0x88)),
                                       _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0xdd)));
    return _mm512_add_epi32(_mm512_shuffle_i64x2(E, I, 0x48), _mm512_shuffle_i64x2(E, I, 0xed));
}

/* Q4_K (q5 = 0; rp: the repacked gemv's shape, else vec_dot's) and Q5_K (vec_dot's): weight row w of nb blocks
 * against group kg, into *os. Per block: quarter j of the weights as 64 bytes (sub-block 2j in the lower half, 2j+1
 * in the upper) with the scales spread to match, vpdpbusd + vpdpwssd per token; the min sums of 8 tokens at once
 * from Bz against the block's mins. */
HI_INLINE void hi_rows_k4(const int q5, const int rp, const int gm, const int64_t nb, const uint8_t *restrict w,
                          const hi_kgrp *kg, float *const *os) {
    const int cnt = kg->cnt;
    const size_t bs = q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const __m512i m4 = _mm512_set1_epi8(0x0f), m16 = _mm512_set1_epi8(0x10), zero = _mm512_setzero_si512();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m512 acc[HI_KG / 2];      /* vec_dot: tokens 2p, 2p+1 in halves */
    __m512 accm[HI_KO][2];      /* vec_dot, Q4_K: minl[0] | minl[1], minl[2] | minl[3] of the octet's tokens */
    __m512 accr[HI_KO];         /* gemv: hi_r_tree8's lanes */
    __m256 summs[HI_KO];        /* Q5_K */
    HI_UNROLL for (int p = 0; p < HI_KG / 2; p++) acc[p] = _mm512_setzero_ps();
    HI_UNROLL for (int o = 0; o < HI_KO; o++) {
        accm[o][0] = accm[o][1] = accr[o] = _mm512_setzero_ps();
        summs[o] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + (size_t)i * bs, *qs = b + (q5 ? 48 : 16);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)hi_rd32(b))); /* d, dmin */
        const __m256 vd = _mm256_broadcastss_ps(dm), vm = _mm256_broadcastss_ps(_mm_shuffle_ps(dm, dm, 0x55));
        const __m128i sm = hi_kq_scales_mins_v(b + 4); /* bytes sc0..7, m0..7 */
        const __m512i sc32 = _mm512_cvtepu8_epi32(sm);
        /* dwords 4..7 of w16: the int16 pairs (m[2p], m[2p+1]) */
        const __m512i w16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));
        const __m512i MP0 = _mm512_permutexvar_epi32(_mm512_inserti64x4(_mm512_set1_epi32(4), _mm256_set1_epi32(5), 1), w16);
        const __m512i MP1 = _mm512_permutexvar_epi32(_mm512_inserti64x4(_mm512_set1_epi32(6), _mm256_set1_epi32(7), 1), w16);
        const __m512i qh = q5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16))) : zero;
        __m512i W[4], SC[4];
        HI_UNROLL for (int j = 0; j < 4; j++) {
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
            __m512i v = _mm512_and_si512(_mm512_mask_srli_epi16(q, (__mmask32)0xffff0000u, q, 4), m4);
            if (q5) { /* bit 2j (lower half) / 2j + 1 (upper) of each qh byte to bit 4: rotate the dwords */
                const __m512i rot = _mm512_inserti64x4(_mm512_set1_epi32((4 - 2 * j) & 31), _mm256_set1_epi32((3 - 2 * j) & 31), 1);
                v = _mm512_ternarylogic_epi32(v, _mm512_rolv_epi32(qh, rot), m16, 0xf8); /* v | (rot & m16) */
            }
            W[j] = v;
            SC[j] = _mm512_permutexvar_epi32(_mm512_inserti64x4(_mm512_set1_epi32(2 * j), _mm256_set1_epi32(2 * j + 1), 1), sc32);
        }
        HI_UNROLL for (int o = 0; o < HI_KO; o++) {
            if (8 * o >= cnt) break;
            const float *Dz = kg->Dz + (i * HI_KO + o) * 16;
            const int32_t *Bz = kg->Bz + (i * HI_KO + o) * 32;
            __m512i S[8];
            HI_UNROLL for (int l = 0; l < 8; l++) {
                S[l] = zero;
                if (l >= gm || 8 * o + l >= cnt) continue;
                const int8_t *q8 = kg->q8[8 * o + l] + i * HI_QK_K;
                HI_UNROLL for (int j = 0; j < 4; j++)
                    S[l] = _mm512_dpwssd_epi32(S[l], _mm512_dpbusd_epi32(zero, W[j], _mm512_loadu_si512((const void *)(q8 + 64 * j))), SC[j]);
            }
            /* lanes l / 8 + l: minl[0] / minl[1] of token l, then minl[2] / minl[3] */
            const __m512i IA = _mm512_madd_epi16(_mm512_loadu_si512((const void *)Bz), MP0);
            const __m512i IB = _mm512_madd_epi16(_mm512_loadu_si512((const void *)(Bz + 16)), MP1);
            if (rp) {
                const __m512 dd = _mm512_mul_ps(_mm512_loadu_ps(Dz), _mm512_castpd_ps(_mm512_insertf64x4(
                                                    _mm512_castpd256_pd512(_mm256_castps_pd(vd)), _mm256_castps_pd(vm), 1)));
                const __m512 f = _mm512_cvtepi32_ps(hi_r_tree8(S, _mm512_add_epi32(IA, IB)));
                accr[o] = _mm512_fmadd_ps(f, dd, accr[o]);
                continue;
            }
            const __m256 D8 = _mm256_loadu_ps(Dz + 8);
            const __m256 dd = _mm256_mul_ps(vd, D8), ndm = _mm256_xor_ps(_mm256_mul_ps(vm, D8), sign); /* d*D, -(dmin*D) */
            HI_UNROLL for (int p = 0; p < 4; p++) {
                if (2 * p >= gm || 8 * o + 2 * p >= cnt) break;
                acc[4 * o + p] = _mm512_fmadd_ps(hi_r_spread2(dd, 2 * p, 2 * p + 1), _mm512_cvtepi32_ps(hi_r_pair(S[2 * p], S[2 * p + 1])),
                                                 acc[4 * o + p]);
            }
            if (q5) {
                const __m512i I = _mm512_add_epi32(IA, IB);
                const __m256i imin = _mm256_add_epi32(_mm512_castsi512_si256(I), _mm512_extracti64x4_epi64(I, 1));
                summs[o] = _mm256_fmadd_ps(ndm, _mm256_cvtepi32_ps(imin), summs[o]);
            } else {
                const __m512 n2 = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(ndm)), _mm256_castps_pd(ndm), 1));
                accm[o][0] = _mm512_fmadd_ps(n2, _mm512_cvtepi32_ps(IA), accm[o][0]);
                accm[o][1] = _mm512_fmadd_ps(n2, _mm512_cvtepi32_ps(IB), accm[o][1]);
            }
        }
    }
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= cnt) break;
        const int o = g / 8, l = g % 8;
        float v;
        if (rp) {
            float a[16];
            _mm512_storeu_ps(a, accr[o]);
            v = a[l % 2 ? 4 + l / 2 : l / 2] - a[8 + l];
        } else {
            const __m512 a = acc[g / 2];
            v = hi_kq_hsum8_ps(g % 2 ? hi_r_hi8(a) : _mm512_castps512_ps256(a));
            if (q5) {
                float s[8];
                _mm256_storeu_ps(s, summs[o]);
                v = v + s[l];
            } else {
                float ma[16], mb[16];
                _mm512_storeu_ps(ma, accm[o][0]);
                _mm512_storeu_ps(mb, accm[o][1]);
                v = v + hi_kq_hsum4_ps(_mm_setr_ps(ma[l], ma[8 + l], mb[l], mb[8 + l]));
            }
        }
        *os[g] = v;
    }
}

/* Q6_K (vec_dot's shape), as hi_dot_q6_K_q8_K's VNNI path builds its 512-bit weights and scales, once per block */
HI_INLINE void hi_rows_q6(const int gm, const int64_t nb, const uint8_t *restrict w, const hi_kgrp *kg, float *const *os) {
    const int cnt = kg->cnt;
    const block_q6_K *x = (const block_q6_K *)w;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m48 = _mm512_set1_epi8(0x30), zero = _mm512_setzero_si512();
    const __m512i shA = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shB = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i idx0 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[HI_KG / 2];
    HI_UNROLL for (int p = 0; p < HI_KG / 2; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m256 vd = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(x[i].d)));
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        /* -32 * sc per int16 (|.| <= 4096): madd with a token's bsums gives minus its offsets, the start of its sums */
        const __m256i nsc = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5));
        const __m512i sc32 = _mm512_cvtepu16_epi32(_mm256_cvtepi8_epi16(sc8));
        __m512i WA[2], WB[2], SC[4];
        HI_UNROLL for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(x[i].ql + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * h)));
            WA[h] = _mm512_ternarylogic_epi32(ql, m4, _mm512_and_si512(_mm512_sllv_epi16(qh, shA), m48), 0xea);
            WB[h] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), m4, _mm512_and_si512(_mm512_srlv_epi16(qh, shB), m48), 0xea);
        }
        HI_UNROLL for (int k = 0; k < 4; k++) SC[k] = _mm512_permutexvar_epi32(_mm512_add_epi32(idx0, _mm512_set1_epi32(4 * k)), sc32);
        HI_UNROLL for (int o = 0; o < HI_KO; o++) {
            if (8 * o >= cnt) break;
            const __m256 dd = _mm256_mul_ps(vd, _mm256_loadu_ps(kg->Dz + (i * HI_KO + o) * 16 + 8));
            HI_UNROLL for (int p = 0; p < 4; p++) {
                const int g0 = 8 * o + 2 * p;
                if (2 * p >= gm || g0 >= cnt) break;
                __m512i S[2];
                HI_UNROLL for (int u = 0; u < 2; u++) {
                    S[u] = zero;
                    if (2 * p + u >= gm || g0 + u >= cnt) continue;
                    S[u] = _mm512_zextsi256_si512(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)kg->y[g0 + u][i].bsums), nsc));
                    const int8_t *q8 = kg->q8[g0 + u] + i * HI_QK_K;
                    HI_UNROLL for (int h = 0; h < 2; h++) {
                        S[u] = _mm512_dpwssd_epi32(S[u], _mm512_dpbusd_epi32(zero, WA[h], _mm512_loadu_si512((const void *)(q8 + 128 * h))), SC[2 * h]);
                        S[u] = _mm512_dpwssd_epi32(S[u], _mm512_dpbusd_epi32(zero, WB[h], _mm512_loadu_si512((const void *)(q8 + 128 * h + 64))), SC[2 * h + 1]);
                    }
                }
                acc[4 * o + p] = _mm512_fmadd_ps(hi_r_spread2(dd, 2 * p, 2 * p + 1), _mm512_cvtepi32_ps(hi_r_pair(S[0], S[1])),
                                                 acc[4 * o + p]);
            }
        }
    }
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= cnt) break;
        const __m512 a = acc[g / 2];
        *os[g] = hi_kq_hsum8_ps(g % 2 ? hi_r_hi8(a) : _mm512_castps512_ps256(a));
    }
}

/* ================================================================================================ */
/* K-quants, AVX2: 256-bit sums as the one-token kernels form them, the weights' halves and scales once per step */

#elif defined(HI_AVX2)

/* lanes 0..3: the totals of a0..a3, lanes 4..7 those of b0..b3 (8 lanes each) */
HI_INLINE __m256i hi_r_totals8(const __m256i *a, const __m256i *b) {
    __m256i v[2];
    HI_UNROLL for (int k = 0; k < 2; k++) {
        const __m256i *s = k ? b : a;
        const __m256i p = _mm256_add_epi32(_mm256_unpacklo_epi32(s[0], s[1]), _mm256_unpackhi_epi32(s[0], s[1]));
        const __m256i q = _mm256_add_epi32(_mm256_unpacklo_epi32(s[2], s[3]), _mm256_unpackhi_epi32(s[2], s[3]));
        v[k] = _mm256_add_epi32(_mm256_unpacklo_epi64(p, q), _mm256_unpackhi_epi64(p, q));
    }
    return _mm256_add_epi32(_mm256_permute2x128_si256(v[0], v[1], 0x20), _mm256_permute2x128_si256(v[0], v[1], 0x31));
}

/* lane l of v in every lane */
HI_INLINE __m256 hi_r_bcast(__m256 v, const int l) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(l)); }

/* Q4_K (rp: the repacked gemv's shape, else vec_dot's) and Q5_K (vec_dot's), as hi_rows_k4 of the VNNI unit with
 * 256-bit pmaddubsw + pmaddwd sums, the min sums of the 8 tokens at once from Bz */
HI_INLINE void hi_rows_k4(const int q5, const int rp, const int gm, const int64_t nb, const uint8_t *restrict w,
                          const hi_kgrp *kg, float *const *os) {
    const int cnt = kg->cnt;
    const size_t bs = q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const __m256i m4 = _mm256_set1_epi8(0x0f), m16 = _mm256_set1_epi8(0x10);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 acc[HI_KG], accm[4], accr = _mm256_setzero_ps(), accrm = _mm256_setzero_ps(), summs = _mm256_setzero_ps();
    HI_UNROLL for (int g = 0; g < HI_KG; g++) acc[g] = _mm256_setzero_ps();
    HI_UNROLL for (int k = 0; k < 4; k++) accm[k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + (size_t)i * bs, *qs = b + (q5 ? 48 : 16);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)hi_rd32(b)));
        const __m256 vd = _mm256_broadcastss_ps(dm), vm = _mm256_broadcastss_ps(_mm_shuffle_ps(dm, dm, 0x55));
        const __m128i sm = hi_kq_scales_mins_v(b + 4);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_unpacklo_epi8(sm, _mm_setzero_si128()));
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : m4;
        __m256i S[HI_KG];
        HI_UNROLL for (int g = 0; g < HI_KG; g++) S[g] = _mm256_setzero_si256();
        HI_UNROLL for (int j = 0; j < 4; j++) {
            const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 1) << 8 | 4 * j)));
            const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 3) << 8 | (4 * j + 2))));
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            if (q5) {
#define HI_R_BIT4(v, s) _mm256_and_si256((s) <= 4 ? _mm256_slli_epi16(v, 4 - (s)) : _mm256_srli_epi16(v, (s) - 4), m16)
                lo = _mm256_or_si256(lo, HI_R_BIT4(qh, 2 * j));
                hi = _mm256_or_si256(hi, HI_R_BIT4(qh, 2 * j + 1));
#undef HI_R_BIT4
            }
            HI_UNROLL for (int g = 0; g < HI_KG; g++) {
                if (g >= gm || g >= cnt) break;
                const int8_t *q8 = kg->q8[g] + i * HI_QK_K + 64 * j;
                const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q8));
                const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 32)));
                S[g] = _mm256_add_epi32(S[g], _mm256_add_epi32(_mm256_madd_epi16(sl, pl), _mm256_madd_epi16(sh, ph)));
            }
        }
        /* lane l of I[p]: m[2p] * B[2p] + m[2p+1] * B[2p+1] of token l (minl[p]) */
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_srli_si128(sm, 8)); /* m0..7 as int16: dword p = (m[2p], m[2p+1]) */
        const float *Dz = kg->Dz + i * 16;
        const int32_t *Bz = kg->Bz + i * 32;
        __m256i I[4];
        HI_UNROLL for (int p = 0; p < 4; p++)
            I[p] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(Bz + 8 * p)),
                                     _mm256_permutevar8x32_epi32(mins16, _mm256_set1_epi32(p)));
        const __m256 D8 = _mm256_loadu_ps(Dz + 8);
        if (rp) {
            const __m256i imin = _mm256_add_epi32(_mm256_add_epi32(I[0], I[1]), _mm256_add_epi32(I[2], I[3]));
            accr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_r_totals8(S, S + 4)), _mm256_mul_ps(vd, D8), accr);
            accrm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(vm, D8), accrm);
            continue;
        }
        const __m256 dd = _mm256_mul_ps(vd, D8), ndm = _mm256_xor_ps(_mm256_mul_ps(vm, D8), sign);
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            if (g >= gm || g >= cnt) break;
            acc[g] = _mm256_fmadd_ps(hi_r_bcast(dd, g), _mm256_cvtepi32_ps(S[g]), acc[g]);
        }
        if (q5) {
            const __m256i imin = _mm256_add_epi32(_mm256_add_epi32(I[0], I[1]), _mm256_add_epi32(I[2], I[3]));
            summs = _mm256_fmadd_ps(ndm, _mm256_cvtepi32_ps(imin), summs);
        } else {
            HI_UNROLL for (int p = 0; p < 4; p++) accm[p] = _mm256_fmadd_ps(ndm, _mm256_cvtepi32_ps(I[p]), accm[p]);
        }
    }
    float r[8], rm[8], s[8], m[4][8];
    _mm256_storeu_ps(r, accr);
    _mm256_storeu_ps(rm, accrm);
    _mm256_storeu_ps(s, summs);
    HI_UNROLL for (int p = 0; p < 4; p++) _mm256_storeu_ps(m[p], accm[p]);
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= gm || g >= cnt) break;
        if (rp) *os[g] = r[g] - rm[g];
        else if (q5) *os[g] = hi_kq_hsum8_ps(acc[g]) + s[g];
        else *os[g] = hi_kq_hsum8_ps(acc[g]) + hi_kq_hsum4_ps(_mm_setr_ps(m[0][g], m[1][g], m[2][g], m[3][g]));
    }
}

/* Q6_K (vec_dot's shape), as hi_dot_q6_K_q8_K's AVX2 path, each group's 6-bit weights and scales once per block */
HI_INLINE void hi_rows_q6(const int gm, const int64_t nb, const uint8_t *restrict w, const hi_kgrp *kg, float *const *os) {
    const int cnt = kg->cnt;
    const block_q6_K *x = (const block_q6_K *)w;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x03), m12 = _mm256_set1_epi8(0x0c);
    const __m256i m48 = _mm256_set1_epi8(0x30), m192 = _mm256_set1_epi8((char)0xc0);
    __m256 acc[HI_KG];
    HI_UNROLL for (int g = 0; g < HI_KG; g++) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m256 vd = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(x[i].d)));
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        /* -32 * sc per int16: madd with a token's bsums gives minus its offsets, the start of its sums */
        const __m256i nsc = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5));
        __m256i S[HI_KG];
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            S[g] = _mm256_setzero_si256();
            if (g >= gm || g >= cnt) continue;
            S[g] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)kg->y[g][i].bsums), nsc);
        }
        HI_UNROLL for (int h = 0; h < 2; h++) {
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * h));
            const __m256i b2 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * h + 32));
            const __m256i bh = _mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * h));
            __m256i wv[4];
            wv[0] = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4));
            wv[1] = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m12), 2));
            wv[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_and_si256(bh, m48));
            wv[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_srli_epi16(_mm256_and_si256(bh, m192), 2));
            HI_UNROLL for (int k = 0; k < 4; k++) {
                const int gr = 4 * h + k; /* 8 x sc[2gr] then 8 x sc[2gr+1], as int16 */
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                    sc8, _mm_set_epi64x(0x0101010101010101LL * (2 * gr + 1), 0x0101010101010101LL * (2 * gr))));
                HI_UNROLL for (int g = 0; g < HI_KG; g++) {
                    if (g >= gm || g >= cnt) break;
                    const __m256i p = _mm256_maddubs_epi16(wv[k], _mm256_loadu_si256((const __m256i *)(kg->q8[g] + i * HI_QK_K + 128 * h + 32 * k)));
                    S[g] = _mm256_add_epi32(S[g], _mm256_madd_epi16(sc, p));
                }
            }
        }
        const __m256 dd = _mm256_mul_ps(vd, _mm256_loadu_ps(kg->Dz + i * 16 + 8));
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            if (g >= gm || g >= cnt) break;
            acc[g] = _mm256_fmadd_ps(hi_r_bcast(dd, g), _mm256_cvtepi32_ps(S[g]), acc[g]);
        }
    }
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= gm || g >= cnt) break;
        *os[g] = hi_kq_hsum8_ps(acc[g]);
    }
}
#endif

/* ================================================================================================ */
/* K-quants, SSSE3: ggml's generic kernels on the prepared activations (hi_q8Kz), each block's weights unpacked once */

#if defined(HI_SSSE3)
#define HI_KG 8

/* Q4_K / Q5_K (hi_kq_dot_k4, layout kind) for the group: per block the weight vectors of its 4 steps, then per
 * token the integer lanes and hi_kq_k4_block_acc's float steps; the min terms two blocks at a time per token */
HI_INLINE void hi_rows_k4_z(const int64_t nb, const uint8_t *restrict vx, const hi_q8Kz *const *ys, const int kind,
                            const int wz, float *const *os, const int cnt) {
    const size_t bs = kind == HI_K4_Q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const __m128i m4 = _mm_set1_epi8(0x0f), m16 = _mm_set1_epi8(0x10);
    __m128 s0[HI_KG], s1[HI_KG];
    float sumf[HI_KG];
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        s0[g] = s1[g] = _mm_setzero_ps();
        sumf[g] = 0.0f;
    }
    for (int64_t i = 0; i < nb; i += 2) {
        __m128i v[2][HI_KG];
        float dmv[2][HI_KG];
        const int nbk = i + 1 < nb ? 2 : 1;
        for (int u = 0; u < nbk; u++) {
            const uint8_t *b = vx + (size_t)(i + u) * bs, *qs = b + (kind == HI_K4_Q5 ? 48 : 16);
            hi_half dd[2];
            memcpy(dd, b, 4);
            const __m128i sm = hi_kq_scales_mins_v(b + 4);
            const __m128i sc16 = _mm_unpacklo_epi8(sm, _mm_setzero_si128());
            __m128i W[16]; /* step j: Q4P: b0 & 15, b0 >> 4, b1 & 15, b1 >> 4; else hi_kq_k4_step_sse's w[4] */
            const __m128i qh0 = kind == HI_K4_Q5 ? hi_kq_load_z(b + 16, wz) : m4;
            const __m128i qh1 = kind == HI_K4_Q5 ? hi_kq_load_z(b + 32, wz) : m4;
            HI_UNROLL for (int j = 0; j < 4; j++) {
                const __m128i b0 = kind == HI_K4_Q4P ? _mm_loadu_si128((const __m128i *)(qs + 32 * j)) : hi_kq_load_z(qs + 32 * j, wz);
                const __m128i b1 = kind == HI_K4_Q4P ? _mm_loadu_si128((const __m128i *)(qs + 32 * j + 16)) : hi_kq_load_z(qs + 32 * j + 16, wz);
                const __m128i l0 = _mm_and_si128(b0, m4), h0 = _mm_and_si128(_mm_srli_epi16(b0, 4), m4);
                const __m128i l1 = _mm_and_si128(b1, m4), h1 = _mm_and_si128(_mm_srli_epi16(b1, 4), m4);
                if (kind == HI_K4_Q4P) {
                    W[4 * j] = l0, W[4 * j + 1] = h0, W[4 * j + 2] = l1, W[4 * j + 3] = h1;
                } else {
                    W[4 * j] = l0, W[4 * j + 1] = l1, W[4 * j + 2] = h0, W[4 * j + 3] = h1;
                    if (kind == HI_K4_Q5) { /* bit s of each qh byte to bit 4 (hi_kq_k4_block's HI_KQ_BIT4) */
#define HI_R_BIT4(v, s) _mm_and_si128((s) <= 4 ? _mm_slli_epi16(v, 4 - (s)) : _mm_srli_epi16(v, (s) - 4), m16)
                        W[4 * j] = _mm_or_si128(W[4 * j], HI_R_BIT4(qh0, 2 * j));
                        W[4 * j + 1] = _mm_or_si128(W[4 * j + 1], HI_R_BIT4(qh1, 2 * j));
                        W[4 * j + 2] = _mm_or_si128(W[4 * j + 2], HI_R_BIT4(qh0, 2 * j + 1));
                        W[4 * j + 3] = _mm_or_si128(W[4 * j + 3], HI_R_BIT4(qh1, 2 * j + 1));
#undef HI_R_BIT4
                    }
                }
            }
            HI_UNROLL for (int g = 0; g < HI_KG; g++) {
                if (g >= cnt) break;
                const hi_q8Kz *y = &ys[g][i + u];
                __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
                HI_UNROLL for (int j = 0; j < 4; j++) {
                    const __m128i scl = _mm_shuffle_epi32(sc16, j * 0x55);
                    if (kind == HI_K4_Q4P) {
                        const int8_t *q4 = y->q4 + 64 * j;
                        const __m128i pl = _mm_add_epi16(_mm_maddubs_epi16(W[4 * j], _mm_loadu_si128((const __m128i *)q4)),
                                                         _mm_maddubs_epi16(W[4 * j + 1], _mm_loadu_si128((const __m128i *)(q4 + 16))));
                        const __m128i ph = _mm_add_epi16(_mm_maddubs_epi16(W[4 * j + 2], _mm_loadu_si128((const __m128i *)(q4 + 32))),
                                                         _mm_maddubs_epi16(W[4 * j + 3], _mm_loadu_si128((const __m128i *)(q4 + 48))));
                        lo = _mm_add_epi32(lo, _mm_madd_epi16(pl, scl));
                        hi = _mm_add_epi32(hi, _mm_madd_epi16(ph, scl));
                    } else {
                        hi_kq_k4_step_sse(&W[4 * j], y->qs + 64 * j, scl, &lo, &hi);
                    }
                }
                v[u][g] = hi_kq_k4_block_acc(dd, y, sm, lo, hi, &s0[g], &s1[g], &dmv[u][g]);
            }
        }
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            if (g >= cnt) break;
            sumf[g] = nbk == 2 ? hi_kq_k4_min2(sumf[g], v[0][g], v[1][g], dmv[0][g], dmv[1][g])
                               : hi_kq_gen_sub(sumf[g], dmv[0][g], hi_kq_hsum4_epi32(v[0][g]));
        }
    }
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= cnt) break;
        *os[g] = hi_kq_gen_end_ps(sumf[g], s0[g], s1[g]);
    }
}

/* Q6_K (hi_kq_dot_q6; packed: the rows repacked) for the group: each block's 8 groups of pair-order weights once */
HI_INLINE void hi_rows_q6_z(const int64_t nb, const uint8_t *restrict vx, const hi_q8Kz *const *ys, const int packed,
                            float *const *os, const int cnt) {
    const block_q6_K *restrict x = (const block_q6_K *)vx;
    __m128 s0[HI_KG], s1[HI_KG];
    HI_UNROLL for (int g = 0; g < HI_KG; g++) s0[g] = s1[g] = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m128i sclo = _mm_srai_epi16(_mm_unpacklo_epi8(sc8, sc8), 8);
        const __m128i schi = _mm_srai_epi16(_mm_unpackhi_epi8(sc8, sc8), 8);
        __m128i W[16]; /* group gr: W[2gr], W[2gr+1] */
        if (packed) {
            HI_UNROLL for (int k = 0; k < 4; k++) hi_kq_q6_unpack3((const uint8_t *)&x[i] + 48 * k, W + 4 * k);
        } else {
            HI_UNROLL for (int h = 0; h < 2; h++) {
                __m128i a[4], qh[2];
                hi_kq_q6_step_load(&x[i], h, a, qh);
                HI_UNROLL for (int k = 0; k < 4; k++) hi_kq_q6_group_raw(a, qh, k, W + 8 * h + 2 * k);
            }
        }
        const float dx = hi_kq_f16_tab[x[i].d];
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            if (g >= cnt) break;
            const hi_q8Kz *y = &ys[g][i];
            __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
            HI_UNROLL for (int gr = 0; gr < 8; gr++) {
                const __m128i p0 = _mm_sub_epi16(_mm_maddubs_epi16(W[2 * gr], _mm_loadu_si128((const __m128i *)(y->q6 + 32 * gr))),
                                                 _mm_loadu_si128((const __m128i *)(y->o6 + 16 * gr)));
                const __m128i p1 = _mm_sub_epi16(_mm_maddubs_epi16(W[2 * gr + 1], _mm_loadu_si128((const __m128i *)(y->q6 + 32 * gr + 16))),
                                                 _mm_loadu_si128((const __m128i *)(y->o6 + 16 * gr + 8)));
                const __m128i sc = _mm_shuffle_epi32(gr < 4 ? sclo : schi, (gr & 3) * 0x55);
                lo = _mm_add_epi32(lo, _mm_madd_epi16(p0, sc));
                hi = _mm_add_epi32(hi, _mm_madd_epi16(p1, sc));
            }
            hi_kq_gen_acc_ps(&s0[g], &s1[g], _mm_set1_ps(dx * y->d), lo, hi);
        }
    }
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= cnt) break;
        *os[g] = hi_kq_gen_end_ps(0.0f, s0[g], s1[g]);
    }
}
#endif

/* ================================================================================================ */
/* F32 / F16 weights: each weight vector loaded (F16: converted) once for the group */

#if !defined(HI_SCALAR)
#if defined(HI_VNNI)
#define HI_FR 2 /* rows a tile: each activation vector loaded once for both (what bounds these products is the
                 * activations' stream from L2, which they read whole for every row) */
#define HI_FG 3 /* tokens: 24 accumulators */
#elif defined(HI_AVX2)
#define HI_FR 1
#define HI_FG 3 /* 12 of the 16 registers */
#else
#define HI_FR 1
#define HI_FG 2
#endif

/* R (<= HI_FR) weight rows from r against the cnt activation rows x (x32: in F32, for F16 weights their conversions,
 * hi_rows_f16x) */
HI_INLINE void hi_rows_float(const int f16, const int R, const hi_mm *m, int64_t r, int64_t t, const void *const *x,
                             const int cnt, const int x32) {
    const void *w[HI_FR];
    HI_UNROLL for (int u = 0; u < HI_FR; u++) w[u] = m->w + (size_t)(r + (u < R ? u : 0)) * m->w_row;
    const int64_t n = m->cols, np = n & ~(int64_t)(4 * HI_FW - 1);
    hi_f16v a[HI_FR][HI_FG][4];
    HI_UNROLL for (int u = 0; u < HI_FR; u++) {
        HI_UNROLL for (int g = 0; g < HI_FG; g++) {
            HI_UNROLL for (int k = 0; k < 4; k++) a[u][g][k] = hi_fv_zero();
        }
    }
    for (int64_t i = 0; i < np; i += 4 * HI_FW) {
        HI_UNROLL for (int k = 0; k < 4; k++) {
            hi_f16v wv[HI_FR];
            HI_UNROLL for (int u = 0; u < R; u++) wv[u] = hi_fv_load(f16, w[u], i + k * HI_FW);
            HI_UNROLL for (int g = 0; g < HI_FG; g++) {
                if (g >= cnt) break;
                const hi_f16v xv = hi_fv_load(!x32, x[g], i + k * HI_FW);
                HI_UNROLL for (int u = 0; u < R; u++) a[u][g][k] = hi_fv_fma(wv[u], xv, a[u][g][k]);
            }
        }
    }
    HI_UNROLL for (int u = 0; u < R; u++) {
        HI_UNROLL for (int g = 0; g < HI_FG; g++) {
            if (g >= cnt) break;
            m->out[(size_t)(t + g) * m->out_row + (size_t)(r + u)] =
                hi_float_end(f16, !x32, a[u][g][0], a[u][g][1], a[u][g][2], a[u][g][3], w[u], x[g], np, n);
        }
    }
}

/* n F16 values at h as F32 at f, as hi_fv_load converts them (exact) */
HI_INLINE void hi_rows_f16x(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#if defined(HI_AVX2)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = hi_h2f(h[i]);
}
#endif

/* ================================================================================================ */
/* legacy types below AVX: ggml's generic loops (and the SSSE3 Q4_0 / Q8_0 kernels), each block's values once */

#if !defined(HI_AVX2)
#define HI_LG 8

#if defined(HI_SSSE3)
/* hi_dot_q4_0_ssse3 for the group */
HI_INLINE void hi_rows_q4_0_ssse3(const uint8_t *w, const uint8_t *const *x, float *const *os, int64_t nb, const int cnt) {
    __m128 acc[HI_LG][4];
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        HI_UNROLL for (int k = 0; k < 4; k++) acc[g][k] = _mm_setzero_ps();
    }
    const __m128i ones = _mm_set1_epi16(1), m4 = _mm_set1_epi8(15), e8 = _mm_set1_epi8(8);
    int64_t ib = 0;
    for (; ib + 1 < nb; ib += 2) {
        HI_UNROLL for (int b = 0; b < 2; b++) {
            const uint8_t *wb = w + (ib + b) * 18;
            const float dw = hi_h2f_at(wb);
            const __m128i q = _mm_loadu_si128((const __m128i *)(wb + 2));
            __m128i bx[2], ax[2];
            HI_UNROLL for (int h = 0; h < 2; h++) {
                bx[h] = _mm_sub_epi8(_mm_and_si128(m4, h ? _mm_srli_epi64(q, 4) : q), e8);
                ax[h] = _mm_sign_epi8(bx[h], bx[h]);
            }
            HI_UNROLL for (int g = 0; g < HI_LG; g++) {
                if (g >= cnt) break;
                const uint8_t *xb = x[g] + (ib + b) * 34;
                const __m128 d = _mm_set1_ps(dw * hi_h2f_at(xb));
                HI_UNROLL for (int h = 0; h < 2; h++) {
                    const __m128i by = _mm_loadu_si128((const __m128i *)(xb + 2 + 16 * h));
                    const __m128i i32 = _mm_madd_epi16(ones, _mm_maddubs_epi16(ax[h], _mm_sign_epi8(by, bx[h])));
                    acc[g][2 * b + h] = _mm_add_ps(_mm_mul_ps(d, _mm_cvtepi32_ps(i32)), acc[g][2 * b + h]);
                }
            }
        }
    }
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        if (g >= cnt) break;
        __m128 r = _mm_hadd_ps(_mm_hadd_ps(acc[g][0], acc[g][1]), _mm_hadd_ps(acc[g][2], acc[g][3]));
        r = _mm_hadd_ps(r, r);
        r = _mm_hadd_ps(r, r);
        *os[g] = hi_legacy_generic_sum(HI_T_Q4_0, w, x[g], ib, nb, _mm_cvtss_f32(r));
    }
}

/* hi_dot_q8_0_ssse3 for the group: the weights' magnitudes and scales once per 4 blocks */
HI_INLINE void hi_rows_q8_0_ssse3(const uint8_t *w, const uint8_t *const *x, float *const *os, int64_t nb, const int cnt) {
    float sumf[HI_LG];
    HI_UNROLL for (int g = 0; g < HI_LG; g++) sumf[g] = 0.0f;
    const __m128i ones = _mm_set1_epi16(1);
    int64_t ib = 0;
    for (; ib + 3 < nb; ib += 4) {
        const uint8_t *wb = w + ib * 34;
        __m128i a[8], aa[8];
        HI_UNROLL for (int k = 0; k < 8; k++) {
            a[k] = _mm_loadu_si128((const __m128i *)(wb + (k / 2) * 34 + 2 + 16 * (k % 2)));
            aa[k] = _mm_sign_epi8(a[k], a[k]);
        }
        const __m128i hw = _mm_setr_epi16((short)hi_rd16(wb), (short)hi_rd16(wb + 34), (short)hi_rd16(wb + 68),
                                          (short)hi_rd16(wb + 102), 0, 0, 0, 0);
        __m128 dw;
        if (__builtin_expect(!hi_h2f4_normal(hw, &dw), 0))
            dw = _mm_setr_ps(hi_h2f_at(wb), hi_h2f_at(wb + 34), hi_h2f_at(wb + 68), hi_h2f_at(wb + 102));
        HI_UNROLL for (int g = 0; g < HI_LG; g++) {
            if (g >= cnt) break;
            const uint8_t *xb = x[g] + ib * 34;
            __m128i s[4];
            HI_UNROLL for (int b = 0; b < 4; b++) {
                s[b] = _mm_setzero_si128();
                HI_UNROLL for (int h = 0; h < 2; h++) {
                    const __m128i y = _mm_loadu_si128((const __m128i *)(xb + b * 34 + 2 + 16 * h));
                    s[b] = _mm_add_epi32(s[b], _mm_madd_epi16(ones, _mm_maddubs_epi16(aa[2 * b + h], _mm_sign_epi8(y, a[2 * b + h]))));
                }
            }
            const __m128 isum = _mm_cvtepi32_ps(_mm_hadd_epi32(_mm_hadd_epi32(s[0], s[1]), _mm_hadd_epi32(s[2], s[3])));
            const __m128i hx = _mm_setr_epi16((short)hi_rd16(xb), (short)hi_rd16(xb + 34), (short)hi_rd16(xb + 68),
                                              (short)hi_rd16(xb + 102), 0, 0, 0, 0);
            __m128 dx;
            if (__builtin_expect(!hi_h2f4_normal(hx, &dx), 0))
                dx = _mm_setr_ps(hi_h2f_at(xb), hi_h2f_at(xb + 34), hi_h2f_at(xb + 68), hi_h2f_at(xb + 102));
            float t4[4];
            _mm_storeu_ps(t4, _mm_mul_ps(isum, _mm_mul_ps(dw, dx)));
            sumf[g] += t4[0];
            sumf[g] += t4[1];
            sumf[g] += t4[2];
            sumf[g] += t4[3];
        }
    }
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        if (g >= cnt) break;
        *os[g] = hi_legacy_generic_sum(HI_T_Q8_0, w, x[g], ib, nb, sumf[g]);
    }
}
#endif

/* the generic loop for the group: each block's values and scales once */
HI_INLINE void hi_rows_legacy(const int qt, const hi_mm *m, int64_t r, int64_t t, const int cnt) {
    const uint8_t *w = m->w + (size_t)r * m->w_row;
    const uint8_t *x[HI_LG];
    float *os[HI_LG];
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        x[g] = m->x + (size_t)(t + (g < cnt ? g : 0)) * m->x_row;
        os[g] = &m->out[(size_t)(t + (g < cnt ? g : 0)) * m->out_row + (size_t)r];
    }
    const int64_t nb = m->cols / 32;
#if defined(HI_SSSE3)
    if (qt == HI_T_Q4_0) {
        hi_rows_q4_0_ssse3(w, x, os, nb, cnt);
        return;
    }
    if (qt == HI_T_Q8_0) {
        hi_rows_q8_0_ssse3(w, x, os, nb, cnt);
        return;
    }
#endif
    const int bs = hi_wbs(qt), ybs = (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) ? 36 : 34;
    float sumf[HI_LG];
    HI_UNROLL for (int g = 0; g < HI_LG; g++) sumf[g] = 0.0f;
    for (int64_t ib = 0; ib < nb; ib++) {
        const uint8_t *wb = w + ib * bs;
        int8_t v[32];
        if (qt == HI_T_Q8_0) memcpy(v, wb + 2, 32);
        else hi_legacy_values(qt, wb, v);
        const float dx = hi_h2f_at(wb), mx = (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) ? hi_h2f_at(wb + 2) : 0.0f;
        HI_UNROLL for (int g = 0; g < HI_LG; g++) {
            if (g >= cnt) break;
            const uint8_t *xb = x[g] + ib * ybs;
            sumf[g] = hi_legacy_step(qt, sumf[g], (float)hi_isum32(v, (const int8_t *)(xb + ybs - 32)), dx, xb, mx);
        }
    }
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        if (g >= cnt) break;
        *os[g] = sumf[g];
    }
}
#endif

/* ================================================================================================ */
/* the sweep */

/* the most tokens a group of weight type qt takes on this unit (0: no group kernel; one-token tiles) */
HI_INLINE int hi_rows_group(const int qt, const hi_mm *m) {
    (void)m;
#if defined(HI_SCALAR)
    if (qt == HI_T_F32 || qt == HI_T_F16) return 0;
#else
    if (qt == HI_T_F32 || qt == HI_T_F16) return HI_FG;
#endif
#if defined(HI_AVX2)
    if (qt == HI_T_Q4_K) return m->kshape == HI_KS_VEC || m->kshape == HI_KS_REPACK ? HI_KG : 0;
    if (qt == HI_T_Q5_K || qt == HI_T_Q6_K) return m->kshape == HI_KS_VEC ? HI_KG : 0;
    return 0;
#elif defined(HI_SSSE3)
    if (qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K) return m->xk ? HI_KG : 0;
    return HI_LG;
#else
    if (qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K) return 0;
    return HI_LG;
#endif
}

/* rows a call of the group path takes at a time, every group in turn (0: the whole chunk, a group at a time): F32 /
 * F16 rows on the AVX units (a row is as long as each of the group's activation rows; the SSSE3 unit converts a
 * group's F16 activations once for the chunk) */
HI_INLINE int hi_rows_step(const int qt) {
#if defined(HI_AVX2)
    return qt == HI_T_F32 || qt == HI_T_F16 ? HI_FR : 0;
#else
    (void)qt;
    return 0;
#endif
}

/* tokens t .. t + cnt - 1 (2 <= cnt <= hi_rows_group) against weight rows [r0, r1) */
HI_INLINE void hi_rows_run(const int qt, const hi_mm *m, int64_t r0, int64_t r1, int64_t t, const int cnt) {
#if !defined(HI_SCALAR)
    if (qt == HI_T_F32 || qt == HI_T_F16) {
        const void *x[HI_FG];
        HI_UNROLL for (int g = 0; g < HI_FG; g++) x[g] = m->x + (size_t)(t + (g < cnt ? g : 0)) * m->x_row;
        float *xf = NULL;
#if defined(HI_SSSE3)
        _Alignas(64) float stack[4096];
        if (qt == HI_T_F16) { /* the group's F16 activations converted once, not once per row (in software here;
                               * the AVX units convert as they load, which costs less than reading twice the bytes) */
            const size_t need = (size_t)cnt * (size_t)m->cols;
            xf = need <= sizeof(stack) / sizeof(float) ? stack : (float *)malloc(need * sizeof(float));
            if (!xf) {
                for (int64_t r = r0; r < r1; r++)
                    for (int k = 0; k < cnt; k++) hi_tile_float(1, m, r, t + k);
                return;
            }
            HI_UNROLL for (int g = 0; g < HI_FG; g++) {
                if (g >= cnt) break;
                hi_rows_f16x((const uint16_t *)x[g], xf + (size_t)g * m->cols, m->cols);
                x[g] = xf + (size_t)g * m->cols;
            }
        }
#endif
        int64_t r = r0;
        for (; r + HI_FR <= r1; r += HI_FR) {
            if (qt == HI_T_F32) hi_rows_float(0, HI_FR, m, r, t, x, cnt, 1);
            else if (xf) hi_rows_float(1, HI_FR, m, r, t, x, cnt, 1);
            else hi_rows_float(1, HI_FR, m, r, t, x, cnt, 0);
        }
        for (; r < r1; r++) {
            if (qt == HI_T_F32) hi_rows_float(0, 1, m, r, t, x, cnt, 1);
            else if (xf) hi_rows_float(1, 1, m, r, t, x, cnt, 1);
            else hi_rows_float(1, 1, m, r, t, x, cnt, 0);
        }
#if defined(HI_SSSE3)
        if (xf && xf != stack) free(xf);
#endif
        return;
    }
#endif
#if defined(HI_AVX2)
    /* the group's preparation: on the stack, or for long rows on the heap (or, failing that, none: one token at a time) */
    const int64_t nb = m->cols / HI_QK_K;
    const size_t need = (size_t)nb * hi_kgrp_bytes(cnt);
    _Alignas(64) uint8_t stack[32768];
    uint8_t *buf = need <= sizeof(stack) ? stack : (uint8_t *)aligned_alloc(64, (need + 63) & ~(size_t)63);
    if (!buf) {
        for (int64_t r = r0; r < r1; r++)
            for (int k = 0; k < cnt; k++) hi_tile_kquant(qt, m, r, t + k);
        return;
    }
    hi_kgrp kg;
    hi_kgrp_prep(&kg, m, t, cnt, nb, buf);
    for (int64_t r = r0; r < r1; r++) {
        float *os[HI_KG];
        HI_UNROLL for (int g = 0; g < HI_KG; g++) os[g] = &m->out[(size_t)(t + (g < cnt ? g : 0)) * m->out_row + (size_t)r];
        const uint8_t *w = m->w + (size_t)r * m->w_row;
        /* kernels for up to 2, 4, 8 tokens: the integer reductions of absent tokens fold away */
#define HI_R_K(GM)                                                                                           \
        if (qt == HI_T_Q6_K) hi_rows_q6(GM, nb, w, &kg, os);                                                 \
        else if (qt == HI_T_Q5_K) hi_rows_k4(1, 0, GM, nb, w, &kg, os);                                      \
        else if (m->kshape == HI_KS_REPACK) hi_rows_k4(0, 1, GM, nb, w, &kg, os);                            \
        else hi_rows_k4(0, 0, GM, nb, w, &kg, os);
        if (cnt <= 2) {
            HI_R_K(2)
        } else if (cnt <= 4) {
            HI_R_K(4)
        } else {
            HI_R_K(8)
        }
#undef HI_R_K
    }
    if (buf != stack) free(buf);
#else
#if defined(HI_SSSE3)
    if (qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K) {
        const hi_q8Kz *ys[HI_KG];
        HI_UNROLL for (int g = 0; g < HI_KG; g++) ys[g] = (const hi_q8Kz *)(m->xk + (size_t)(t + (g < cnt ? g : 0)) * m->xk_row);
        const int64_t nb = m->cols / HI_QK_K;
        const int wz = m->wz;
        for (int64_t r = r0; r < r1; r++) {
            float *os[HI_KG];
            HI_UNROLL for (int g = 0; g < HI_KG; g++) os[g] = &m->out[(size_t)(t + (g < cnt ? g : 0)) * m->out_row + (size_t)r];
            const uint8_t *w = m->w + (size_t)r * m->w_row;
            if (qt == HI_T_Q6_K) {
                if (wz) hi_rows_q6_z(nb, w, ys, 1, os, cnt);
                else hi_rows_q6_z(nb, w, ys, 0, os, cnt);
            } else if (qt == HI_T_Q5_K) {
                if (wz) hi_rows_k4_z(nb, w, ys, HI_K4_Q5, 1, os, cnt);
                else hi_rows_k4_z(nb, w, ys, HI_K4_Q5, 0, os, cnt);
            } else {
                if (wz) hi_rows_k4_z(nb, w, ys, HI_K4_Q4P, 1, os, cnt);
                else hi_rows_k4_z(nb, w, ys, HI_K4_Q4, 0, os, cnt);
            }
        }
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) hi_rows_legacy(qt, m, r, t, cnt);
#endif
}

/* the group path of each type in a function of its own, so that the one-token path's function (the table's `mm`)
 * keeps the inlining it had without it */
#define HI_DEF_ROWS(NAME, QT)                                                                                    \
    static __attribute__((noinline)) void NAME(const hi_mm *m, int64_t r0, int64_t r1, int64_t t, int cnt) {     \
        hi_rows_run(QT, m, r0, r1, t, cnt);                                                                      \
    }
HI_DEF_ROWS(hi_rows_f32, HI_T_F32)
HI_DEF_ROWS(hi_rows_f16, HI_T_F16)
HI_DEF_ROWS(hi_rows_q4_0, HI_T_Q4_0)
HI_DEF_ROWS(hi_rows_q4_1, HI_T_Q4_1)
HI_DEF_ROWS(hi_rows_q5_0, HI_T_Q5_0)
HI_DEF_ROWS(hi_rows_q5_1, HI_T_Q5_1)
HI_DEF_ROWS(hi_rows_q8_0, HI_T_Q8_0)
HI_DEF_ROWS(hi_rows_q4_K, HI_T_Q4_K)
HI_DEF_ROWS(hi_rows_q5_K, HI_T_Q5_K)
HI_DEF_ROWS(hi_rows_q6_K, HI_T_Q6_K)
#undef HI_DEF_ROWS

HI_INLINE void hi_rows_call(const int qt, const hi_mm *m, int64_t r0, int64_t r1, int64_t t, int cnt) {
    switch (qt) {
    case HI_T_F32: hi_rows_f32(m, r0, r1, t, cnt); break;
    case HI_T_F16: hi_rows_f16(m, r0, r1, t, cnt); break;
    case HI_T_Q4_0: hi_rows_q4_0(m, r0, r1, t, cnt); break;
    case HI_T_Q4_1: hi_rows_q4_1(m, r0, r1, t, cnt); break;
    case HI_T_Q5_0: hi_rows_q5_0(m, r0, r1, t, cnt); break;
    case HI_T_Q5_1: hi_rows_q5_1(m, r0, r1, t, cnt); break;
    case HI_T_Q8_0: hi_rows_q8_0(m, r0, r1, t, cnt); break;
    case HI_T_Q4_K: hi_rows_q4_K(m, r0, r1, t, cnt); break;
    case HI_T_Q5_K: hi_rows_q5_K(m, r0, r1, t, cnt); break;
    case HI_T_Q6_K: hi_rows_q6_K(m, r0, r1, t, cnt); break;
    default: break;
    }
}

/* One weight row against a group of tokens (GGML_DECODE_ROWS, hi_mm.rows1; and the AVX units' K-quants in every op):
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
 *       (isum = sum_k lane[k], imin = sum_s m[s]*B[s]); the repacked gemm (tokens below T - T % 4) the same steps
 *       per quarter j of the block, with part_j (isum over sub-blocks 2j, 2j+1) and mpart_j = minl[j]
 *   Q4_K / Q5_K, tiled: res = fma(-dmin, (float)imin, d*(float)isum), row = fma(res, D, row);  Q6_K: res = d*(float)isum
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

/* the software prefetch of a chunk's weight stream, rows [r0, r1) read in order: m->pf bytes of it requested ahead,
 * since the hardware prefetcher restarts at every 4 KiB page (m->pf = 0: none). Start once, then advance a row's
 * bytes before each row is read; the one-token tiles (kernels_tiles.h) and the group kernels' sweeps take it alike
 * (a prefetch changes no value) */
typedef struct {
    const uint8_t *at, *end;
    int64_t step;
} hi_pfs;

HI_INLINE void hi_pf_start(hi_pfs *p, const hi_mm *m, int64_t r0, int64_t r1) {
    p->at = m->w + (size_t)r0 * m->w_row;
    p->end = m->w + (size_t)r1 * m->w_row;
    p->step = m->pf > 0 ? m->w_row : 0;
    if (!p->step) return;
    const uint8_t *ahead = p->at + m->pf < p->end ? p->at + m->pf : p->end;
    for (; p->at < ahead; p->at += 64) __builtin_prefetch(p->at, 0, 3);
}

HI_INLINE void hi_pf_row(hi_pfs *p) {
    if (!p->step) return;
    const uint8_t *lim = p->at + p->step < p->end ? p->at + p->step : p->end;
    for (; p->at < lim; p->at += 64) __builtin_prefetch(p->at, 0, 3);
}

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
 *   and for groups of at most 4 tokens Bz4[i][16]: the same pairs as dword 4p + l (l < 4; of at most 2, 4p + 2l),
 * zero for tokens past cnt (whose rows are the first token's) */
typedef struct {
    const block_q8_K *y[HI_KG];
    const int8_t *q8[HI_KG]; /* the rows' quants, 256 bytes a block, 64-byte aligned (a 64-byte load of the rows
                              * themselves, 292-byte blocks, nearly always spans two cache lines: twice the cost) */
    int cnt;
    const float *Dz;
    const int32_t *Bz, *Bz4;
} hi_kgrp;

/* bytes of a group's preparation per block (buf: 64-byte aligned) */
HI_INLINE size_t hi_kgrp_bytes(const int cnt) { return (size_t)cnt * HI_QK_K + HI_KO * (16 * 4 + 32 * 4) + (cnt <= 4 ? 16 * 4 : 0); }

/* whether the group's quants are copied in the VNNI kernels' order of a block's 32-byte parts, 0 2 1 3 4 6 5 7 (the
 * sub-blocks of each 64-byte load's low nibbles, then its high ones): Q4_K and Q5_K but for the repacked gemm's
 * shape, whose sums are per quarter (sub-blocks 2j, 2j + 1) */
HI_INLINE int hi_kgrp_zip(const int qt, const hi_mm *m) {
#if defined(HI_VNNI)
    return qt != HI_T_Q6_K && m->kshape != HI_KS_REPACK_GEMM;
#else
    (void)qt;
    (void)m;
    return 0;
#endif
}

/* whether the group's kernels read Bz4: the VNNI unit's Q4_K in llama.cpp's repacked gemv shape (hi_rows_k4 with
 * HI_KS_REPACK) for groups of at most 4 tokens; elsewhere it is not built */
HI_INLINE int hi_kgrp_bz4(const int qt, const hi_mm *m, const int cnt) {
#if defined(HI_VNNI)
    return cnt <= 4 && qt != HI_T_Q6_K && qt != HI_T_Q5_K && m->kshape == HI_KS_REPACK;
#else
    (void)qt;
    (void)m;
    (void)cnt;
    return 0;
#endif
}

HI_INLINE void hi_kgrp_prep(hi_kgrp *g, const hi_mm *m, int64_t t, const int cnt, int64_t nb, uint8_t *buf, const int zip,
                            const int bz4) {
    float *Dz = (float *)(buf + (size_t)cnt * nb * HI_QK_K);
    int32_t *Bz = (int32_t *)((uint8_t *)Dz + (size_t)nb * HI_KO * 16 * 4);
    for (int k = 0; k < HI_KG; k++) {
        g->y[k] = (const block_q8_K *)(m->x + (size_t)(t + (k < cnt ? k : 0)) * m->x_row);
        g->q8[k] = (const int8_t *)buf + (size_t)(k < cnt ? k : 0) * nb * HI_QK_K;
    }
    int32_t *Bz4 = Bz + (size_t)nb * HI_KO * 32;
    g->cnt = cnt;
    g->Dz = Dz;
    g->Bz = Bz;
    g->Bz4 = bz4 ? Bz4 : NULL;
    for (int k = 0; k < cnt; k++) {
        int8_t *q = (int8_t *)g->q8[k];
        for (int64_t i = 0; i < nb; i++) {
            HI_UNROLL for (int c = 0; c < HI_QK_K; c += 32) {
                const int src = zip && c % 128 >= 32 && c % 128 < 96 ? c ^ 96 : c; /* parts 1 and 2 of each half swapped */
                _mm256_store_si256((__m256i *)(q + i * HI_QK_K + c), _mm256_loadu_si256((const __m256i *)(g->y[k][i].qs + src)));
            }
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
            if (bz4 && o == 0)
                HI_UNROLL for (int p = 0; p < 4; p++) {
                    if (cnt > 2) {
                        memcpy(Bz4 + i * 16 + 4 * p, b + 8 * p, 16);
                    } else {
                        const int32_t z[4] = {b[8 * p], 0, b[8 * p + 1], 0};
                        memcpy(Bz4 + i * 16 + 4 * p, z, 16);
                    }
                }
        }
    }
}
#endif

#if defined(HI_VNNI)
#include "kernels_rows_vnni.h"
#elif defined(HI_AVX2)
#include "kernels_rows_avx2.h"
#endif

#if defined(HI_SSSE3)
#include "kernels_rows_ssse3.h"
#endif

#include "kernels_rows_small.h"


/* ================================================================================================ */
/* the sweep */

/* whether the group path takes the products of every ggml_op (prefill's, in llama.cpp's shapes of them), not only
 * GGML_DECODE_ROWS: the AVX units' K-quants (F32 / F16 products of a MUL_MAT are not vec_dot's in llama.cpp) */
HI_INLINE int hi_rows_any_op(const int qt) {
#if defined(HI_AVX2)
    return qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K;
#else
    (void)qt;
    return 0;
#endif
}

/* the most tokens a group of weight type qt takes on this unit (0: no group kernel; one-token tiles) */
HI_INLINE int hi_rows_group(const int qt, const hi_mm *m) {
    (void)m;
#if defined(HI_SCALAR)
    if (qt == HI_T_F32 || qt == HI_T_F16) return 0;
#else
    if (qt == HI_T_F32 || qt == HI_T_F16) return HI_FG;
#endif
#if defined(HI_AVX2)
    if (qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K) return HI_KG; /* every float shape (prefill's too) */
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
    hi_kgrp_prep(&kg, m, t, cnt, nb, buf, hi_kgrp_zip(qt, m), hi_kgrp_bz4(qt, m, cnt));
    hi_pfs pf;
    hi_pf_start(&pf, m, r0, r1);
    for (int64_t r = r0; r < r1; r++) {
        hi_pf_row(&pf);
        float *os[HI_KG];
        HI_UNROLL for (int g = 0; g < HI_KG; g++) os[g] = &m->out[(size_t)(t + (g < cnt ? g : 0)) * m->out_row + (size_t)r];
        const uint8_t *w = m->w + (size_t)r * m->w_row;
        /* kernels for up to 2, (3,) 4, 8 tokens: the integer reductions of absent tokens fold away */
#define HI_R_K(GM)                                                                                           \
        if (qt == HI_T_Q6_K && m->kshape == HI_KS_TILED) hi_rows_q6(1, GM, nb, w, &kg, os);                   \
        else if (qt == HI_T_Q6_K) hi_rows_q6(0, GM, nb, w, &kg, os);                                          \
        else if (qt == HI_T_Q5_K && m->kshape == HI_KS_TILED) hi_rows_k4(1, HI_KS_TILED, GM, nb, w, &kg, os); \
        else if (qt == HI_T_Q5_K) hi_rows_k4(1, HI_KS_VEC, GM, nb, w, &kg, os);                               \
        else if (m->kshape == HI_KS_REPACK) hi_rows_k4(0, HI_KS_REPACK, GM, nb, w, &kg, os);                  \
        else if (m->kshape == HI_KS_REPACK_GEMM) hi_rows_k4(0, HI_KS_REPACK_GEMM, GM, nb, w, &kg, os);        \
        else if (m->kshape == HI_KS_TILED) hi_rows_k4(0, HI_KS_TILED, GM, nb, w, &kg, os);                    \
        else hi_rows_k4(0, HI_KS_VEC, GM, nb, w, &kg, os);
        if (cnt <= 2) {
            HI_R_K(2)
#if defined(HI_VNNI)
        } else if (cnt == 3) { /* the vec_dot shapes' last pair a lone token */
            HI_R_K(3)
#endif
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
        hi_pfs pf;
        hi_pf_start(&pf, m, r0, r1);
        for (int64_t r = r0; r < r1; r++) {
            hi_pf_row(&pf);
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

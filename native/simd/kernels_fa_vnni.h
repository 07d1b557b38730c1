/* The AVX-512 unit's share of the tiled kernel (kernels_fa_tiled.h): a part of kernels_body.h, included by it once per
 * ISA unit after kernels_fa.h; empty outside the AVX-512 unit.
 *
 * At 16 threads a long row's attention is bound by these cores' instructions, not by the K/V bytes, and two parts
 * took most of them (perf, 32K q8_0 positions, 8 rows on one K/V head): the rows' K dots, one 256-bit dpbusd,
 * conversion and fused multiply-add per row and block, and V taken to float into a buffer that every row then read
 * back. Here both go through 512-bit registers without changing a bit:
 * - K dots of q8_0 / q4_0 K take the query rows in pairs, row 2p's eight lanes in the low half of a register and
 *   row 2p + 1's in the high half, the K block broadcast to both: one dpbusd, conversion and fused multiply-add for
 *   two rows. The integer lanes are exact, each lane's scale is the same product dk * dy and takes the same fused
 *   multiply-add, and the horizontal sums are hi_hsum8_n's, so each dot has hi_fa_dots_legacy's bits.
 * - V of q8_0, q4_0 and f16 is converted in registers, 32 values of a position at a time, straight into the
 *   fused multiply-adds of 4 or 8 rows (hi_fa_v_float's exact conversions and one rounded product each, then each
 *   row's accumulators in hi_fa_tile_pv4's order), so no float copy of V is written or read back. */
#ifndef HI_INLINE
#error "kernels_fa_vnni.h is a part of kernels_body.h; include that"
#endif

#if defined(HI_VNNI)
/* the q8_0 query rows (qv, corr, dy as hi_fa_query made them, row i rs floats from row 0) of rows 0 .. m - 1 in
 * pairs: pair p's block b at qp + 64 o bytes, cp + 16 o and dp + 16 o (o = p nb + b), row 2p's 32 values, 8
 * corrections and 8 copies of its dy first, then row 2p + 1's */
HI_INLINE void hi_fa_pairs(const uint8_t *qv, const int32_t *corr, const float *dy, int64_t rs, int64_t m, int64_t nb,
                           float *pairs) {
    uint8_t *qp = (uint8_t *)pairs;
    int32_t *cp = (int32_t *)(pairs + m / 2 * nb * 16);
    float *dp = pairs + m / 2 * nb * 32;
    for (int64_t p = 0; p < m / 2; p++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t o = p * nb + b;
            for (int h = 0; h < 2; h++) {
                const int64_t i = 2 * p + h;
                memcpy(qp + 64 * o + 32 * h, qv + 4 * i * rs + b * 34 + 2, 32);
                memcpy(cp + 16 * o + 8 * h, corr + i * rs + 8 * b, 32);
                for (int l = 0; l < 8; l++) dp[16 * o + 8 * h + l] = dy[i * rs + b];
            }
        }
}

/* x[0 .. 2 NP) = the K row w (q8_0 / q4_0 blocks, qt constant) . the rows of NP <= 4 pairs from pair p0 */
HI_INLINE void hi_fa_dots_pairs_n(const int qt, const int NP, const uint8_t *w, const float *pairs, int64_t m,
                                  int64_t nb, int64_t p0, float *x) {
    const uint8_t *qp = (const uint8_t *)pairs;
    const int32_t *cp = (const int32_t *)(pairs + m / 2 * nb * 16);
    const float *dp = pairs + m / 2 * nb * 32;
    const int bs = hi_wbs(qt);
    __m512 acc[4];
    for (int p = 0; p < NP; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bs;
        const __m512 dk = _mm512_set1_ps(hi_h2f(hi_rd16(blk)));
        const __m512i w2 = _mm512_broadcast_i64x4(hi_load_w(qt, blk));
        for (int p = 0; p < NP; p++) {
            const int64_t o = (p0 + p) * nb + b;
            const __m512i l = _mm512_dpbusd_epi32(_mm512_loadu_si512(cp + 16 * o), w2, _mm512_loadu_si512(qp + 64 * o));
            acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(dk, _mm512_loadu_ps(dp + 16 * o)), _mm512_cvtepi32_ps(l), acc[p]);
        }
    }
    hi_fv h[8];
    for (int p = 0; p < NP; p++) {
        h[2 * p] = _mm512_castps512_ps256(acc[p]);
        h[2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p]), 1));
    }
    hi_hsum8_n(h, 2 * NP, x);
}

/* x[i] = K row w . query row i for i < m, q8_0 / q4_0 K: the pairs 4, 2 and 1 at a time, an odd last row alone */
HI_INLINE void hi_fa_dots_pairs(const int qt, const uint8_t *w, const float *pairs, const uint8_t *qv,
                                const int32_t *corr, const float *dy, int64_t rs, int64_t m, int64_t nb, float *x) {
    const int64_t P = m / 2;
    int64_t p = 0;
    for (; p + 4 <= P; p += 4) hi_fa_dots_pairs_n(qt, 4, w, pairs, m, nb, p, x + 2 * p);
    if (p + 2 <= P) {
        hi_fa_dots_pairs_n(qt, 2, w, pairs, m, nb, p, x + 2 * p);
        p += 2;
    }
    if (p < P) hi_fa_dots_pairs_n(qt, 1, w, pairs, m, nb, p, x + 2 * p);
    if (m & 1) {
        const int64_t i = m - 1;
        hi_fa_dots_legacy(qt, 1, w, qv + 4 * i * rs, corr + i * rs, dy + i * rs, NULL, rs, nb, x + i);
    }
}

/* V's values [e0, e0 + 32) of one position (b: the row's bytes at that value, hi_fa_v_off) as two vectors of floats,
 * with hi_fa_v_float's conversions */
HI_INLINE void hi_fa_v32(const int vt, const uint8_t *b, __m512 *v0, __m512 *v1) {
    if (vt == HI_T_F16) {
        *v0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        *v1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
        return;
    }
    const __m512 d = _mm512_set1_ps(hi_h2f(hi_rd16(b)));
    const __m128i x = _mm_loadu_si128((const __m128i *)(b + 2));
    if (vt == HI_T_Q8_0) {
        const __m128i y = _mm_loadu_si128((const __m128i *)(b + 18));
        *v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x)), d);
        *v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(y)), d);
    } else { /* q4_0: values 0 .. 15 in the low nibbles, 16 .. 31 in the high ones */
        const __m512i e = _mm512_set1_epi32(8), m4 = _mm512_set1_epi32(15), q = _mm512_cvtepu8_epi32(x);
        *v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, m4), e)), d);
        *v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), e)), d);
    }
}

/* hi_fa_tile_pv4 of NR (4 or 8) rows over V values [e0, e0 + 32) read from the cache (v: position 0's bytes at e0, vs
 * bytes a position), converted in registers */
HI_INLINE void hi_fa_tile_pvq(const int NR, float *acc, int64_t rs, const float *ms, const float *p, const int vt,
                              const uint8_t *v, int64_t vs, int64_t n) {
    __m512 r[8][2];
    for (int h = 0; h < NR; h++) {
        const __m512 m = _mm512_set1_ps(ms[h]);
        r[h][0] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * rs), m);
        r[h][1] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * rs + 16), m);
    }
    for (int64_t j = 0; j < n; j++) {
        __m512 v0, v1;
        hi_fa_v32(vt, v + j * vs, &v0, &v1);
        for (int h = 0; h < NR; h++) {
            const __m512 pj = _mm512_set1_ps(p[8 * j + h]);
            r[h][0] = _mm512_fmadd_ps(v0, pj, r[h][0]);
            r[h][1] = _mm512_fmadd_ps(v1, pj, r[h][1]);
        }
    }
    for (int h = 0; h < NR; h++) {
        _mm512_storeu_ps(acc + h * rs, r[h][0]);
        _mm512_storeu_ps(acc + h * rs + 16, r[h][1]);
    }
}
#endif

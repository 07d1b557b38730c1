/* The AVX2 unit's group kernels of the K-quants (kernels_rows.h has the maths and the group's preparation) */

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

/* token g's 8 lanes of quarter j (sub-blocks 2j, 2j+1: nibbles lo, hi against scales sl, sh) added to S[g], for the
 * group's tokens below gm */
HI_INLINE void hi_r_k4_quarter(__m256i *S, const __m256i lo, const __m256i hi, const __m256i sl, const __m256i sh,
                               const hi_kgrp *kg, const int64_t i, const int j, const int gm) {
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= gm || g >= kg->cnt) break;
        const int8_t *q8 = kg->q8[g] + i * HI_QK_K + 64 * j;
        const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q8));
        const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 32)));
        S[g] = _mm256_add_epi32(S[g], _mm256_add_epi32(_mm256_madd_epi16(sl, pl), _mm256_madd_epi16(sh, ph)));
    }
}

/* Q4_K (q5 = 0) and Q5_K weight row w of nb blocks against group kg, into *os, in the float shape `rp` (HI_KS_*):
 * vec_dot's, the repacked gemv's (Q4_K), the repacked gemm's (Q4_K; every token of the group below the gemm's
 * T - T % 4) or the tiled kernels'. As hi_rows_k4 of the VNNI unit with 256-bit pmaddubsw + pmaddwd sums, the min
 * sums of the 8 tokens at once from Bz. The per-block shapes take each token's total of the 8 lanes by one
 * transposing tree (hi_r_totals8) per block, the gemm's per quarter: its float steps are per quarter, so its
 * quarters' integers are never added together. */
HI_INLINE void hi_rows_k4(const int q5, const int rp, const int gm, const int64_t nb, const uint8_t *restrict w,
                          const hi_kgrp *kg, float *const *os) {
    const int cnt = kg->cnt;
    const size_t bs = q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const __m256i m4 = _mm256_set1_epi8(0x0f), m16 = _mm256_set1_epi8(0x10);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    /* vec_dot: acc, accm (Q4_K), summs (Q5_K); gemv, gemm: accr - accrm; tiled: accr (tokens 0..7 in lanes) */
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
        /* lane l of I[p]: m[2p] * B[2p] + m[2p+1] * B[2p+1] of token l (minl[p], the gemm's mpart_p) */
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_srli_si128(sm, 8)); /* m0..7 as int16: dword p = (m[2p], m[2p+1]) */
        const float *Dz = kg->Dz + i * 16;
        const int32_t *Bz = kg->Bz + i * 32;
        __m256i I[4];
        HI_UNROLL for (int p = 0; p < 4; p++)
            I[p] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(Bz + 8 * p)),
                                     _mm256_permutevar8x32_epi32(mins16, _mm256_set1_epi32(p)));
        const __m256 D8 = _mm256_loadu_ps(Dz + 8);
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
            if (rp == HI_KS_REPACK_GEMM) { /* acc = fma(part_j, d*D, acc), accm = fma(mpart_j, dmin*D, accm) */
                HI_UNROLL for (int g = 0; g < HI_KG; g++) S[g] = _mm256_setzero_si256();
                hi_r_k4_quarter(S, lo, hi, sl, sh, kg, i, j, gm);
                accr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_r_totals8(S, S + 4)), _mm256_mul_ps(vd, D8), accr);
                accrm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[j]), _mm256_mul_ps(vm, D8), accrm);
            } else {
                hi_r_k4_quarter(S, lo, hi, sl, sh, kg, i, j, gm);
            }
        }
        if (rp == HI_KS_REPACK_GEMM) continue;
        const __m256i imin = _mm256_add_epi32(_mm256_add_epi32(I[0], I[1]), _mm256_add_epi32(I[2], I[3]));
        if (rp == HI_KS_REPACK) { /* acc = fma(isum, d*D, acc), accm = fma(imin, dmin*D, accm) */
            accr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_r_totals8(S, S + 4)), _mm256_mul_ps(vd, D8), accr);
            accrm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(vm, D8), accrm);
            continue;
        }
        if (rp == HI_KS_TILED) { /* res = fma(-dmin, imin, d * isum), row = fma(res, D, row) */
            const __m256 res = _mm256_fmadd_ps(_mm256_xor_ps(vm, sign), _mm256_cvtepi32_ps(imin),
                                               _mm256_mul_ps(vd, _mm256_cvtepi32_ps(hi_r_totals8(S, S + 4))));
            accr = _mm256_fmadd_ps(res, D8, accr);
            continue;
        }
        const __m256 dd = _mm256_mul_ps(vd, D8), ndm = _mm256_xor_ps(_mm256_mul_ps(vm, D8), sign);
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            if (g >= gm || g >= cnt) break;
            acc[g] = _mm256_fmadd_ps(hi_r_bcast(dd, g), _mm256_cvtepi32_ps(S[g]), acc[g]);
        }
        if (q5) {
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
        if (rp == HI_KS_TILED) *os[g] = r[g];
        else if (rp) *os[g] = r[g] - rm[g];
        else if (q5) *os[g] = hi_kq_hsum8_ps(acc[g]) + s[g];
        else *os[g] = hi_kq_hsum8_ps(acc[g]) + hi_kq_hsum4_ps(_mm_setr_ps(m[0][g], m[1][g], m[2][g], m[3][g]));
    }
}

/* Q6_K (vec_dot's shape, or with `tiled` the tiled kernels': res = d * isum, row = fma(res, D, row)), as
 * hi_dot_q6_K_q8_K's AVX2 path, each group's 6-bit weights and scales once per block, for the group's tokens
 * g0 .. g0 + gm - 1 (the others' sums stay zero: the tiled shape's transposing tree gives theirs as nothing) */
HI_INLINE void hi_rows_q6_part(const int tiled, const int g0, const int gm, const int64_t nb, const uint8_t *restrict w,
                               const hi_kgrp *kg, float *const *os) {
    const int cnt = kg->cnt;
    const block_q6_K *x = (const block_q6_K *)w;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x03), m12 = _mm256_set1_epi8(0x0c);
    const __m256i m48 = _mm256_set1_epi8(0x30), m192 = _mm256_set1_epi8((char)0xc0);
    __m256 acc[HI_KG], acct = _mm256_setzero_ps(); /* tiled: tokens 0..7 in lanes */
    HI_UNROLL for (int g = 0; g < HI_KG; g++) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m256 vd = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(x[i].d)));
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        /* -32 * sc per int16: madd with a token's bsums gives minus its offsets, the start of its sums */
        const __m256i nsc = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5));
        __m256i S[HI_KG];
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            S[g] = _mm256_setzero_si256();
            if (g < g0 || g >= g0 + gm || g >= cnt) continue;
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
                    if (g < g0 || g >= g0 + gm || g >= cnt) continue;
                    const __m256i p = _mm256_maddubs_epi16(wv[k], _mm256_loadu_si256((const __m256i *)(kg->q8[g] + i * HI_QK_K + 128 * h + 32 * k)));
                    S[g] = _mm256_add_epi32(S[g], _mm256_madd_epi16(sc, p));
                }
            }
        }
        const __m256 D8 = _mm256_loadu_ps(kg->Dz + i * 16 + 8);
        if (tiled) {
            acct = _mm256_fmadd_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(hi_r_totals8(S, S + 4))), D8, acct);
            continue;
        }
        const __m256 dd = _mm256_mul_ps(vd, D8);
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            if (g < g0 || g >= g0 + gm || g >= cnt) continue;
            acc[g] = _mm256_fmadd_ps(hi_r_bcast(dd, g), _mm256_cvtepi32_ps(S[g]), acc[g]);
        }
    }
    float a[8];
    _mm256_storeu_ps(a, acct);
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g < g0 || g >= g0 + gm || g >= cnt) continue;
        *os[g] = tiled ? a[g] : hi_kq_hsum8_ps(acc[g]);
    }
}

/* Q6_K of the group's first gm tokens: a pass over the row for each quartet of them (eight tokens' sums next to the
 * unpacked block and its scales do not fit the 16 registers, and their spills cost more than a second pass over the
 * row, in L1 by then; the sums are exact integers and each token's float steps its own, so no bit changes) */
HI_INLINE void hi_rows_q6(const int tiled, const int gm, const int64_t nb, const uint8_t *restrict w, const hi_kgrp *kg,
                          float *const *os) {
    HI_UNROLL for (int g0 = 0; g0 < gm; g0 += 4) {
        if (g0 >= kg->cnt) break;
        hi_rows_q6_part(tiled, g0, gm - g0 < 4 ? gm - g0 : 4, nb, w, kg, os);
    }
}

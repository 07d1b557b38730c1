/* The VNNI unit's group kernels of the K-quants (kernels_rows.h has the maths and the group's preparation) */
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

/* vec_dot's step of the pair p of an octet, acc = fma(d*D, lanes, acc) with the 16-lane sums a, b of tokens 2p, 2p + 1
 * folded to their 8 lanes (dd: d*D of the octet's tokens); `lone`: token 2p only, in 256 bits (acc's upper half
 * then holds nothing) */
HI_INLINE __m512 hi_r_vacc(const __m512 acc, const __m256 dd, const __m512i a, const __m512i b, const int p, const int lone) {
    if (lone) {
        const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
        const __m256 d = _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(2 * p));
        return _mm512_castps256_ps512(_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), _mm512_castps512_ps256(acc)));
    }
    return _mm512_fmadd_ps(hi_r_spread2(dd, 2 * p, 2 * p + 1), _mm512_cvtepi32_ps(hi_r_pair(a, b)), acc);
}

/* a dword of pshufb control: byte a zero-extended to the lower int16, byte b to the upper (0x80: zero) */
#define HI_R_W16(a, b) ((int)(0x80008000u | (unsigned)(a) | (unsigned)(b) << 16))

/* dword lo in the lower 8 lanes, hi in the upper 8 */
HI_INLINE __m512i hi_r_bytes2(const int lo, const int hi) {
    return _mm512_inserti64x4(_mm512_set1_epi32(lo), _mm256_set1_epi32(hi), 1);
}

/* D of an octet's tokens 0..7 (Dz + 8) in both halves: a broadcast load */
HI_INLINE __m512 hi_r_D16(const float *Dz) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)(Dz + 8)))); }

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

/* An octet's integer totals from vpdpbusd sums P (|dword| <= 4 * 31 * 128 < 2^15): two tokens' sums packed to int16
 * pairs go through one vpdpwssd with the scales spread to int16 (scw), which scales them and adds each pair of lanes.
 * Against vpdpwssd per token and hi_r_tree8 that halves the vpdpwssd and the tree, whose first level costs three
 * operations per two tokens. hi_r_pairs8 adds quarter j's P[0..7] (scw: its scales) to R[0..3] (per 128-bit lane
 * tokens 2p, 2p, 2p+1, 2p+1), for the pairs holding tokens below gm (the others' R stay zero: a vpdpwssd of zeros is
 * not folded away, and costs a slot of the port the vpdpbusd need) */
HI_INLINE void hi_r_pairs8(__m512i *R, const __m512i *P, const __m512i scw, const int gm, const int first) {
    HI_UNROLL for (int p = 0; p < 4; p++) {
        if (2 * p >= gm) break;
        const __m512i pk = _mm512_packs_epi32(P[2 * p], P[2 * p + 1]);
        /* first (R zero): vpmaddwd, the int32 sums vpdpwssd onto zero gives, with no zeroed copy of R to write */
        R[p] = first ? _mm512_madd_epi16(pk, scw) : _mm512_dpwssd_epi32(R[p], pk, scw);
    }
}

/* R's totals and the min lanes I as [tokens 0..7 | I's tokens 0..7], in order: I's 128-bit lanes 0, 1 (half 0), 2, 3
 * (half 1) or the sums of both (half 2) hold tokens 0..3, 4..7 */
HI_INLINE __m512i hi_r_tree8r(const __m512i *R, const __m512i I, const int half) {
    const __m512 r[4] = {_mm512_castsi512_ps(R[0]), _mm512_castsi512_ps(R[1]), _mm512_castsi512_ps(R[2]), _mm512_castsi512_ps(R[3])};
    /* per 128-bit lane: tokens 0..3 (E0), 4..7 (E1) */
    const __m512i E0 = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(r[0], r[1], 0x88)),
                                        _mm512_castps_si512(_mm512_shuffle_ps(r[0], r[1], 0xdd)));
    const __m512i E1 = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(r[2], r[3], 0x88)),
                                        _mm512_castps_si512(_mm512_shuffle_ps(r[2], r[3], 0xdd)));
    /* [tokens 0..3, 0..3, 4..7, 4..7] */
    const __m512i Y = _mm512_add_epi32(_mm512_shuffle_i64x2(E0, E1, 0x44), _mm512_shuffle_i64x2(E0, E1, 0xee));
    const __m512i Y1 = half == 2 ? _mm512_shuffle_i64x2(Y, I, 0xed) : _mm512_maskz_shuffle_i64x2((__mmask8)0x0f, Y, Y, 0x0d);
    return _mm512_add_epi32(_mm512_shuffle_i64x2(Y, I, half == 1 ? 0xe8 : 0x48), Y1);
}

/* R[0..1] (hi_r_pairs8 of tokens 0..3) and the min lanes I (128-bit lane p: pair p of tokens 0..3) as the totals
 * [isum of tokens 0..3 | imin of tokens 0..3] */
HI_INLINE __m256i hi_r_tree4(const __m512i *R, const __m512i I) {
    const __m512 r0 = _mm512_castsi512_ps(R[0]), r1 = _mm512_castsi512_ps(R[1]);
    /* per 128-bit lane: tokens 0..3 */
    const __m512i E = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(r0, r1, 0x88)),
                                       _mm512_castps_si512(_mm512_shuffle_ps(r0, r1, 0xdd)));
    const __m256i e = _mm256_add_epi32(_mm512_castsi512_si256(E), _mm512_extracti64x4_epi64(E, 1));
    const __m256i m = _mm256_add_epi32(_mm512_castsi512_si256(I), _mm512_extracti64x4_epi64(I, 1));
    return _mm256_add_epi32(_mm256_permute2x128_si256(e, m, 0x20), _mm256_permute2x128_si256(e, m, 0x31));
}

/* R[0] (hi_r_pairs8 of tokens 0, 1) and the min lanes I (128-bit lane p: pair p of token 0 in dword 0, of token 1
 * in dword 2) as the totals isum, isum, imin, imin of tokens 0, 1, 0, 1 */
HI_INLINE __m128i hi_r_tree2(const __m512i R, const __m512i I) {
    const __m512 r = _mm512_castsi512_ps(R), m = _mm512_castsi512_ps(I);
    const __m512i E = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(r, m, 0x88)),
                                       _mm512_castps_si512(_mm512_shuffle_ps(r, m, 0xdd)));
    const __m256i e = _mm256_add_epi32(_mm512_castsi512_si256(E), _mm512_extracti64x4_epi64(E, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(e), _mm256_extracti128_si256(e, 1));
}

/* S[l] = the vpdpbusd sums of quarter j's 64 weights W against token 8o + l's (zero past the group) */
HI_INLINE void hi_r_dots8(__m512i *S, const __m512i W, const hi_kgrp *kg, const int o, const int64_t i, const int j,
                          const int gm) {
    HI_UNROLL for (int l = 0; l < 8; l++) {
        S[l] = _mm512_setzero_si512();
        if (l >= gm || 8 * o + l >= kg->cnt) continue;
        const int8_t *q8 = kg->q8[8 * o + l] + i * HI_QK_K;
        S[l] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W, _mm512_loadu_si512((const void *)(q8 + 64 * j)));
    }
}

/* Q4_K (q5 = 0) and Q5_K weight row w of nb blocks against group kg, into *os, in the float shape `rp` (HI_KS_*):
 * vec_dot's, the repacked gemv's (Q4_K), the repacked gemm's (Q4_K; every token of the group below the gemm's
 * T - T % 4) or the tiled kernels'. Per block: quarter j of the weights as 64 bytes (sub-block 2j in the lower half,
 * 2j+1 in the upper) with the scales spread to match, vpdpbusd per token, and vpdpwssd per token (vec_dot's lanes) or
 * per two (hi_r_pairs8: the other shapes need only each token's totals); the min sums of 8 tokens at once from Bz
 * against the block's mins. The gemm's steps are per quarter: one tree per quarter, the others' one per block. */
HI_INLINE void hi_rows_k4(const int q5, const int rp, const int gm, const int64_t nb, const uint8_t *restrict w,
                          const hi_kgrp *kg, float *const *os) {
    const int cnt = kg->cnt;
    const size_t bs = q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const __m512i m4 = _mm512_set1_epi8(0x0f), m16 = _mm512_set1_epi8(0x10), zero = _mm512_setzero_si512();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m512 acc[HI_KG / 2];      /* vec_dot: tokens 2p, 2p+1 in halves */
    __m512 accm[HI_KO][2];      /* vec_dot, Q4_K: minl[0] | minl[1], minl[2] | minl[3] of the octet's tokens */
    __m512 accr[HI_KO];         /* gemv, gemm: acc of tokens 0..7 | accm of tokens 0..7 */
    __m256 acct[HI_KO];         /* tiled: tokens 0..7 */
    __m256 summs[HI_KO];        /* Q5_K */
    __m256 acc4 = _mm256_setzero_ps(); /* gemv of at most 4 tokens: acc of tokens 0..3 | accm of tokens 0..3 */
    __m128 acc2 = _mm_setzero_ps();    /* gemv of at most 2 tokens: acc, acc, accm, accm of tokens 0, 1, 0, 1 */
    HI_UNROLL for (int p = 0; p < HI_KG / 2; p++) acc[p] = _mm512_setzero_ps();
    HI_UNROLL for (int o = 0; o < HI_KO; o++) {
        accm[o][0] = accm[o][1] = accr[o] = _mm512_setzero_ps();
        summs[o] = acct[o] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + (size_t)i * bs, *qs = b + (q5 ? 48 : 16);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)hi_rd32(b))); /* d, dmin */
        const __m256 vd = _mm256_broadcastss_ps(dm), vm = _mm256_broadcastss_ps(_mm_shuffle_ps(dm, dm, 0x55));
        /* d in the lower 8 lanes, dmin in the upper: against hi_r_D16 the products d*D | dmin*D of 8 tokens */
        const __m512 dm16 = _mm512_permutexvar_ps(hi_r_bytes2(0, 1), _mm512_castps128_ps512(dm));
        /* bytes sc0..7, m0..7 in each 128-bit lane: each spread of them below is one in-lane byte shuffle */
        const __m512i smb = _mm512_broadcast_i32x4(hi_kq_scales_mins_v(b + 4));
        /* the int16 pairs (m[2p], m[2p+1]): p = 0 | 1 (MP0), 2 | 3 (MP1) */
        const __m512i MP0 = _mm512_shuffle_epi8(smb, hi_r_bytes2(HI_R_W16(8, 9), HI_R_W16(10, 11)));
        const __m512i MP1 = _mm512_shuffle_epi8(smb, hi_r_bytes2(HI_R_W16(12, 13), HI_R_W16(14, 15)));
        /* the pair p in 128-bit lane p (against Bz4) */
        const __m512i MP4 = _mm512_shuffle_epi8(smb, _mm512_setr_epi32(HI_R_W16(8, 9), HI_R_W16(8, 9), HI_R_W16(8, 9), HI_R_W16(8, 9),
                                                                        HI_R_W16(10, 11), HI_R_W16(10, 11), HI_R_W16(10, 11), HI_R_W16(10, 11),
                                                                        HI_R_W16(12, 13), HI_R_W16(12, 13), HI_R_W16(12, 13), HI_R_W16(12, 13),
                                                                        HI_R_W16(14, 15), HI_R_W16(14, 15), HI_R_W16(14, 15), HI_R_W16(14, 15)));
        const __m256 dm8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dm), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)); /* d x4 | dmin x4 */
        const __m512i qh = q5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16))) : zero;
        /* the gemm's quarters j: 32 bytes broadcast, sub-block 2j (low nibbles) in the lower half, 2j + 1 (high) in the
         * upper; the other shapes' (the group's activations in hi_kgrp_zip's order): a 64-byte load each of quarters 0, 1
         * and 2, 3, W[0..3] its low and high nibbles, sub-blocks 0 | 2, 1 | 3, 4 | 6, 5 | 7 (two fewer shifts a block) */
        const int zp = rp != HI_KS_REPACK_GEMM;
        __m512i W[4], SC[4], SCW[4]; /* SCW: the scales as int16 of W's sub-blocks, the lower half's, the upper's */
        HI_UNROLL for (int j = 0; j < 4; j++) {
            const int slo = zp ? 4 * (j / 2) + j % 2 : 2 * j, shi = zp ? slo + 2 : slo + 1; /* W[j]'s sub-blocks */
            __m512i v;
            if (zp) {
                const __m512i q = _mm512_loadu_si512((const void *)(qs + 64 * (j / 2)));
                v = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(q, 4) : q, m4);
            } else {
                const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
                v = _mm512_and_si512(_mm512_mask_srli_epi16(q, (__mmask32)0xffff0000u, q, 4), m4);
            }
            if (q5) { /* bit slo (lower half) / shi (upper) of each qh byte to bit 4: rotate the dwords */
                const __m512i rot = _mm512_inserti64x4(_mm512_set1_epi32((4 - slo) & 31), _mm256_set1_epi32((4 - shi) & 31), 1);
                v = _mm512_ternarylogic_epi32(v, _mm512_rolv_epi32(qh, rot), m16, 0xf8); /* v | (rot & m16) */
            }
            W[j] = v;
            SC[j] = _mm512_shuffle_epi8(smb, hi_r_bytes2(HI_R_W16(slo, 0x80), HI_R_W16(shi, 0x80)));
            /* the scales are < 2^6: (sc, sc) as int16 */
            SCW[j] = _mm512_shuffle_epi8(smb, hi_r_bytes2(HI_R_W16(slo, slo), HI_R_W16(shi, shi)));
        }
        HI_UNROLL for (int o = 0; o < HI_KO; o++) {
            if (8 * o >= cnt) break;
            const float *Dz = kg->Dz + (i * HI_KO + o) * 16;
            const int32_t *Bz = kg->Bz + (i * HI_KO + o) * 32;
            /* lanes l / 8 + l: minl[0] / minl[1] of token l, then minl[2] / minl[3] */
            const __m512i IA = _mm512_madd_epi16(_mm512_loadu_si512((const void *)Bz), MP0);
            const __m512i IB = _mm512_madd_epi16(_mm512_loadu_si512((const void *)(Bz + 16)), MP1);
            __m512i S[8];
            if (rp == HI_KS_REPACK_GEMM) { /* acc, accm per quarter j: its part and mpart (minl[j]), tokens in order */
                const __m512 dd = _mm512_mul_ps(dm16, hi_r_D16(Dz));
                HI_UNROLL for (int j = 0; j < 4; j++) {
                    hi_r_dots8(S, W[j], kg, o, i, j, gm);
                    __m512i R[4] = {zero, zero, zero, zero};
                    hi_r_pairs8(R, S, SCW[j], gm, 1); /* each quarter its own sums */
                    accr[o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_r_tree8r(R, j < 2 ? IA : IB, j % 2)), dd, accr[o]);
                }
                continue;
            }
            if (rp == HI_KS_REPACK && gm <= 2) { /* isum, imin of tokens 0, 1: 128-bit float steps */
                __m512i R[4] = {zero, zero, zero, zero};
                HI_UNROLL for (int j = 0; j < 4; j++) {
                    hi_r_dots8(S, W[j], kg, o, i, j, gm);
                    hi_r_pairs8(R, S, SCW[j], gm, j == 0);
                }
                /* lane p: m[2p]*B[2p] + m[2p+1]*B[2p+1] of token 0 (dword 0), of token 1 (dword 2) */
                const __m512i I2 = _mm512_madd_epi16(_mm512_loadu_si512((const void *)(kg->Bz4 + i * 16)), MP4);
                const __m128 f = _mm_cvtepi32_ps(hi_r_tree2(R[0], I2));
                const __m128 D2 = _mm_castpd_ps(_mm_loaddup_pd((const double *)(Dz + 8))); /* D of tokens 0, 1, 0, 1 */
                acc2 = _mm_fmadd_ps(f, _mm_mul_ps(_mm_unpacklo_ps(dm, dm), D2), acc2);
                continue;
            }
            if (rp == HI_KS_REPACK && gm <= 4) { /* isum | imin of tokens 0..3, in 256-bit float steps */
                __m512i R[4] = {zero, zero, zero, zero};
                HI_UNROLL for (int j = 0; j < 4; j++) {
                    hi_r_dots8(S, W[j], kg, o, i, j, gm);
                    hi_r_pairs8(R, S, SCW[j], gm, j == 0);
                }
                /* lane p: m[2p]*B[2p] + m[2p+1]*B[2p+1] of tokens 0..3 */
                const __m512i I4 = _mm512_madd_epi16(_mm512_loadu_si512((const void *)(kg->Bz4 + i * 16)), MP4);
                const __m256 f = _mm256_cvtepi32_ps(hi_r_tree4(R, I4));
                acc4 = _mm256_fmadd_ps(f, _mm256_mul_ps(dm8, _mm256_broadcast_ps((const __m128 *)(Dz + 8))), acc4);
                continue;
            }
            if (rp == HI_KS_REPACK || rp == HI_KS_TILED) { /* isum, imin of tokens 0..7 in order */
                __m512i R[4] = {zero, zero, zero, zero};
                HI_UNROLL for (int j = 0; j < 4; j++) {
                    hi_r_dots8(S, W[j], kg, o, i, j, gm);
                    hi_r_pairs8(R, S, SCW[j], gm, j == 0);
                }
                const __m512 f = _mm512_cvtepi32_ps(hi_r_tree8r(R, _mm512_add_epi32(IA, IB), 2));
                if (rp == HI_KS_TILED) {
                    const __m256 D8 = _mm256_loadu_ps(Dz + 8); /* res = fma(-dmin, imin, d * isum), row = fma(res, D, row) */
                    const __m256 res = _mm256_fmadd_ps(_mm256_xor_ps(vm, sign), hi_r_hi8(f), _mm256_mul_ps(vd, _mm512_castps512_ps256(f)));
                    acct[o] = _mm256_fmadd_ps(res, D8, acct[o]);
                } else { /* acc = fma(isum, d*D, acc), accm = fma(imin, dmin*D, accm) */
                    accr[o] = _mm512_fmadd_ps(f, _mm512_mul_ps(dm16, hi_r_D16(Dz)), accr[o]);
                }
                continue;
            }
            HI_UNROLL for (int l = 0; l < 8; l++) {
                S[l] = zero;
                if (l >= gm || 8 * o + l >= cnt) continue;
                const int8_t *q8 = kg->q8[8 * o + l] + i * HI_QK_K;
                HI_UNROLL for (int j = 0; j < 4; j++)
                    S[l] = _mm512_dpwssd_epi32(S[l], _mm512_dpbusd_epi32(zero, W[j], _mm512_loadu_si512((const void *)(q8 + 64 * j))), SC[j]);
            }
            const __m256 D8 = _mm256_loadu_ps(Dz + 8);
            const __m256 dd = _mm256_mul_ps(vd, D8), ndm = _mm256_xor_ps(_mm256_mul_ps(vm, D8), sign); /* d*D, -(dmin*D) */
            HI_UNROLL for (int p = 0; p < 4; p++) {
                if (2 * p >= gm || 8 * o + 2 * p >= cnt) break;
                acc[4 * o + p] = hi_r_vacc(acc[4 * o + p], dd, S[2 * p], S[2 * p + 1], p, 2 * p + 1 >= gm);
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
        if (rp == HI_KS_TILED) {
            float a[8];
            _mm256_storeu_ps(a, acct[o]);
            v = a[l];
        } else if (rp == HI_KS_REPACK && gm <= 2) {
            float a[4];
            _mm_storeu_ps(a, acc2);
            v = a[l] - a[2 + l];
        } else if (rp == HI_KS_REPACK && gm <= 4) {
            float a[8];
            _mm256_storeu_ps(a, acc4);
            v = a[l] - a[4 + l];
        } else if (rp) {
            float a[16];
            _mm512_storeu_ps(a, accr[o]);
            v = a[l] - a[8 + l];
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

/* Q6_K (vec_dot's shape, or with `tiled` the tiled kernels': res = d * isum, row = fma(res, D, row)), as
 * hi_dot_q6_K_q8_K's VNNI path builds its 512-bit weights and scales, once per block */
HI_INLINE void hi_rows_q6(const int tiled, const int gm, const int64_t nb, const uint8_t *restrict w, const hi_kgrp *kg,
                          float *const *os) {
    const int cnt = kg->cnt;
    const block_q6_K *x = (const block_q6_K *)w;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m48 = _mm512_set1_epi8(0x30), zero = _mm512_setzero_si512();
    const __m512i shA = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shB = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i idx0 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[HI_KG / 2];
    __m256 acct[HI_KO]; /* tiled: tokens 0, 2, 4, 6, 1, 3, 5, 7 */
    HI_UNROLL for (int p = 0; p < HI_KG / 2; p++) acc[p] = _mm512_setzero_ps();
    HI_UNROLL for (int o = 0; o < HI_KO; o++) acct[o] = _mm256_setzero_ps();
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
            if (tiled) {
                __m512i S[8];
                HI_UNROLL for (int l = 0; l < 8; l++) {
                    S[l] = zero;
                    if (l >= gm || 8 * o + l >= cnt) continue;
                    S[l] = _mm512_zextsi256_si512(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)kg->y[8 * o + l][i].bsums), nsc));
                    const int8_t *q8 = kg->q8[8 * o + l] + i * HI_QK_K;
                    HI_UNROLL for (int h = 0; h < 2; h++) {
                        S[l] = _mm512_dpwssd_epi32(S[l], _mm512_dpbusd_epi32(zero, WA[h], _mm512_loadu_si512((const void *)(q8 + 128 * h))), SC[2 * h]);
                        S[l] = _mm512_dpwssd_epi32(S[l], _mm512_dpbusd_epi32(zero, WB[h], _mm512_loadu_si512((const void *)(q8 + 128 * h + 64))), SC[2 * h + 1]);
                    }
                }
                const __m256 isum = _mm512_castps512_ps256(_mm512_cvtepi32_ps(hi_r_tree8(S, zero)));
                acct[o] = _mm256_fmadd_ps(_mm256_mul_ps(vd, isum), _mm256_loadu_ps(kg->Dz + (i * HI_KO + o) * 16), acct[o]);
                continue;
            }
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
                acc[4 * o + p] = hi_r_vacc(acc[4 * o + p], dd, S[0], S[1], p, 2 * p + 1 >= gm);
            }
        }
    }
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= cnt) break;
        if (tiled) {
            float a[8];
            _mm256_storeu_ps(a, acct[g / 8]);
            *os[g] = a[g % 2 ? 4 + g % 8 / 2 : g % 8 / 2];
            continue;
        }
        const __m512 a = acc[g / 2];
        *os[g] = hi_kq_hsum8_ps(g % 2 ? hi_r_hi8(a) : _mm512_castps512_ps256(a));
    }
}

/* ================================================================================================ */
/* K-quants, AVX2: 256-bit sums as the one-token kernels form them, the weights' halves and scales once per step */

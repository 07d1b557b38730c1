/* llama.cpp's other float shapes of a K-quant row (Q4_K, Q5_K, Q6_K weights x Q8_K activations).
 * A part of dot_kquants.h (which has vec_dot's shape, the helpers and the notation); include that.
 *
 * On a host with AVX2, llama.cpp multiplies most K-quant matrices without ggml_vec_dot_*_q8_K:
 *   - Q4_K weights whose row count is a multiple of 8 are repacked at load (ggml-cpu/repack.cpp,
 *     q4_K_8x8_q8_K). One token at a time (gemv: decode, the last T % 4 tokens of a MUL_MAT, and every row of
 *     a MUL_MAT_ID) sums each block's integers exactly and then, per block,
 *         acc = fma((float)isum, d*D, acc),   accm = fma((float)imin, dmin*D, accm),   row = acc - accm;
 *     four tokens at a time (gemm: the first T - T % 4 tokens of a MUL_MAT) do the same per 64-element
 *     quarter j of the block: acc = fma((float)part_j, d*D, acc), accm = fma((float)mpart_j, dmin*D, accm).
 *   - the other K-quant matrices of a MUL_MAT over T >= 8 tokens (MUL_MAT_ID: >= 8 tokens routed to the
 *     expert) go to the tiled kernels (ggml-cpu/tiled/), per block
 *         res = d * (float)isum  [Q4_K, Q5_K: res = fma(-dmin, (float)imin, res)],   row = fma(res, D, row).
 * Here isum = sum_s sc[s] * sum_l q[l] q8[l] over the block (Q6_K: q - 32), imin = sum_s m[s] * B[s] with
 * B[s] = bsums[2s] + bsums[2s+1], part_j and mpart_j the same over sub-blocks 2j and 2j+1 (32-element
 * sub-blocks); d, dmin the block's fp16 scales as float, D the Q8_K block scale, d*D one float product. The
 * integer sums are exact (their 16-bit intermediates stay below 2^15), so only these float steps define the
 * result. Measured bit for bit against llama.cpp 0.3.36's graph outputs (its intermediates through cb_eval);
 * tests/test_simd_ggml_shapes.py holds the kernels to the numpy reference (tests/oracles/ggml_ref.py).
 * The gemm's activations come from ggml_quantize_mat_q8_K_4x8, whose bytes equal quantize_row_q8_K's except
 * for a block whose largest magnitude occurs with both signs (it takes the positive one, ggml's reference the
 * first): not reproduced.
 *
 * hi_dot_q4_K_rp(n, w, y, quarters): the repacked Q4_K row (quarters: the gemm's per-quarter steps);
 * hi_dot_kq_tiled(qt, n, w, y): the tiled row. The integer sums have an AVX2 path (also the AVX-512 unit's, which
 * forms the repacked gemv's Q4_K block lanes with vpdpbusd/vpdpwssd instead) and a scalar one.
 */
#ifndef HI_DOT_KQUANTS_H
#error "dot_kq_shapes.h is a part of dot_kquants.h; include that"
#endif

#if defined(__AVX2__)
static inline int32_t hi_kq_hsum8_epi32(__m256i v) {
    return hi_kq_hsum4_epi32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

/* Q4_K: lane sums of the quarter j (sub-blocks 2j, 2j+1), scaled: their total is part_j */
static inline __m256i hi_kq4_quarter(__m256i scales, const uint8_t *q4, const int8_t *q8, int j) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 1) << 8 | 4 * j)));
    const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 3) << 8 | (4 * j + 2))));
    const __m256i bits = _mm256_loadu_si256((const __m256i *)(q4 + 32 * j));
    const __m256i pl = _mm256_maddubs_epi16(_mm256_and_si256(bits, m4), _mm256_loadu_si256((const __m256i *)(q8 + 64 * j)));
    const __m256i ph = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4),
                                            _mm256_loadu_si256((const __m256i *)(q8 + 64 * j + 32)));
    return _mm256_add_epi32(_mm256_madd_epi16(sl, pl), _mm256_madd_epi16(sh, ph));
}

/* Q4_K block: int32 lanes whose total is isum (sm: hi_kq_scales_mins_v of the block). With VNNI the lanes come
 * from vpdpbusd and vpdpwssd as in hi_dot_q4_K_q8_K's VNNI path; the integer total is the same either way. */
static inline __m256i hi_kq4_block_lanes(const block_q4_K *restrict x, const block_q8_K *restrict y, __m128i sm) {
#if HI_KQ_VNNI
    const __m256i m4 = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
    const __m256i scales = _mm256_broadcastsi128_si256(sm); /* bytes: sc0..7 m0..7 */
    __m256i s = zero;
    for (int j = 0; j < 4; ++j) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * j));
        const __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        const __m256i pl = _mm256_dpbusd_epi32(zero, lo, _mm256_loadu_si256((const __m256i *)(y->qs + 64 * j)));
        const __m256i ph = _mm256_dpbusd_epi32(zero, hi, _mm256_loadu_si256((const __m256i *)(y->qs + 64 * j + 32)));
        const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi32((int)(0x80808000u | (2 * j))));
        const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi32((int)(0x80808000u | (2 * j + 1))));
        s = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(s, pl, sl), ph, sh);
    }
    return s;
#else
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_unpacklo_epi8(sm, _mm_setzero_si128()));
    const __m256i q01 = _mm256_add_epi32(hi_kq4_quarter(scales, x->qs, y->qs, 0), hi_kq4_quarter(scales, x->qs, y->qs, 1));
    const __m256i q23 = _mm256_add_epi32(hi_kq4_quarter(scales, x->qs, y->qs, 2), hi_kq4_quarter(scales, x->qs, y->qs, 3));
    return _mm256_add_epi32(q01, q23);
#endif
}
#endif

/* Q4_K block: part[j] and mpart[j] (j < 4) when quarters, else part[0] = isum and mpart[0] = imin */
static inline void hi_kq4_sums(const block_q4_K *restrict x, const block_q8_K *restrict y, int quarters,
                               int32_t *restrict part, int32_t *restrict mpart) {
#if defined(__AVX2__)
    const __m128i sm = hi_kq_scales_mins_v(x->scales);
    const __m128i ml = hi_kq_min_lanes(_mm_unpackhi_epi8(sm, _mm_setzero_si128()), y->bsums);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_unpacklo_epi8(sm, _mm_setzero_si128()));
    if (quarters) {
        _mm_storeu_si128((__m128i *)mpart, ml);
        for (int j = 0; j < 4; ++j) part[j] = hi_kq_hsum8_epi32(hi_kq4_quarter(scales, x->qs, y->qs, j));
        return;
    }
    *mpart = hi_kq_hsum4_epi32(ml);
    __m256i s = hi_kq4_quarter(scales, x->qs, y->qs, 0);
    for (int j = 1; j < 4; ++j) s = _mm256_add_epi32(s, hi_kq4_quarter(scales, x->qs, y->qs, j));
    *part = hi_kq_hsum8_epi32(s);
#else
    uint8_t sm[16], q[256];
    hi_kq_scales_mins(x->scales, sm);
    hi_kq_unpack_k4(x->qs, 0, q);
    int32_t p[4] = {0}, mp[4] = {0};
    for (int s = 0; s < 8; ++s) {
        int32_t dot = 0;
        for (int l = 0; l < 32; ++l) dot += q[32 * s + l] * y->qs[32 * s + l];
        p[s / 2] += sm[s] * dot;
        mp[s / 2] += sm[8 + s] * (y->bsums[2 * s] + y->bsums[2 * s + 1]);
    }
    if (quarters) {
        memcpy(part, p, sizeof(p));
        memcpy(mpart, mp, sizeof(mp));
    } else {
        *part = p[0] + p[1] + p[2] + p[3];
        *mpart = mp[0] + mp[1] + mp[2] + mp[3];
    }
#endif
}

/* Q5_K block: isum and imin */
static inline void hi_kq5_sums(const block_q5_K *restrict x, const block_q8_K *restrict y, int32_t *isum,
                               int32_t *imin) {
#if defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0x0f), m16 = _mm256_set1_epi8(0x10);
    const __m128i sm = hi_kq_scales_mins_v(x->scales);
    *imin = hi_kq_hsum4_epi32(hi_kq_min_lanes(_mm_unpackhi_epi8(sm, _mm_setzero_si128()), y->bsums));
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_unpacklo_epi8(sm, _mm_setzero_si128()));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)x->qh);
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const int bl = 2 * j, bh = 2 * j + 1; /* bit bl / bh of each qh byte to bit 4 */
        const __m256i hl = _mm256_and_si256(bl <= 4 ? _mm256_slli_epi16(qh, 4 - bl) : _mm256_srli_epi16(qh, bl - 4), m16);
        const __m256i hh = _mm256_and_si256(bh <= 4 ? _mm256_slli_epi16(qh, 4 - bh) : _mm256_srli_epi16(qh, bh - 4), m16);
        const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 1) << 8 | 4 * j)));
        const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 3) << 8 | (4 * j + 2))));
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * j));
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(bits, m4), hl);
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), hh);
        const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(y->qs + 64 * j)));
        const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y->qs + 64 * j + 32)));
        s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(sl, pl), _mm256_madd_epi16(sh, ph)));
    }
    *isum = hi_kq_hsum8_epi32(s);
#else
    uint8_t sm[16], q[256];
    hi_kq_scales_mins(x->scales, sm);
    hi_kq_unpack_k4(x->qs, x->qh, q);
    int32_t is = 0, im = 0;
    for (int s = 0; s < 8; ++s) {
        int32_t dot = 0;
        for (int l = 0; l < 32; ++l) dot += q[32 * s + l] * y->qs[32 * s + l];
        is += sm[s] * dot;
        im += sm[8 + s] * (y->bsums[2 * s] + y->bsums[2 * s + 1]);
    }
    *isum = is;
    *imin = im;
#endif
}

/* Q6_K block: isum = sum_s sc[s] * sum_l (q - 32) q8 */
static inline int32_t hi_kq6_sum(const block_q6_K *restrict x, const block_q8_K *restrict y) {
#if defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(0x03), m12 = _mm256_set1_epi8(0x0c);
    const __m256i m48 = _mm256_set1_epi8(0x30), m192 = _mm256_set1_epi8((char)0xc0);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)x->scales);
    __m256i s = _mm256_sub_epi32(_mm256_setzero_si256(), hi_kq_q6_offset_lanes(x->scales, y->bsums));
    for (int h = 0; h < 2; ++h) {
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h));
        const __m256i b2 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32));
        const __m256i bh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
        __m256i w[4];
        w[0] = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4));
        w[1] = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m12), 2));
        w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_and_si256(bh, m48));
        w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_srli_epi16(_mm256_and_si256(bh, m192), 2));
        for (int r = 0; r < 4; ++r) {
            const int g = 4 * h + r; /* scales of group g: 8 x sc[2g] then 8 x sc[2g+1], as int16 */
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                sc8, _mm_set_epi64x(0x0101010101010101LL * (2 * g + 1), 0x0101010101010101LL * (2 * g))));
            const __m256i p = _mm256_maddubs_epi16(w[r], _mm256_loadu_si256((const __m256i *)(y->qs + 128 * h + 32 * r)));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(sc, p));
        }
    }
    return hi_kq_hsum8_epi32(s);
#else
    int32_t is = 0;
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 4; ++r)
            for (int l = 0; l < 32; ++l) {
                const int e = 128 * h + 32 * r + l;
                const int q = ((x->ql[64 * h + 32 * (r & 1) + l] >> (4 * (r >> 1))) & 15) |
                              (((x->qh[32 * h + l] >> (2 * r)) & 3) << 4);
                is += x->scales[e / 16] * (q - 32) * y->qs[e];
            }
    return is;
#endif
}

/* the repacked Q4_K row: gemv shape, or with `quarters` the gemm's */
static inline __attribute__((always_inline)) float hi_dot_q4_K_rp(int n, const void *restrict vx,
                                                                  const void *restrict vy, int quarters) {
    const block_q4_K *restrict x = (const block_q4_K *)vx;
    const block_q8_K *restrict y = (const block_q8_K *)vy;
    float acc = 0.0f, accm = 0.0f;
    int i = 0;
#if defined(__AVX2__)
    /* the gemv: four blocks' integer totals at once (one horizontal-add transpose instead of four sums) */
    for (; !quarters && i + 4 <= n / HI_QK_K; i += 4) {
        __m256i s[4];
        __m128i ml[4];
        for (int b = 0; b < 4; ++b) {
            const __m128i sm = hi_kq_scales_mins_v(x[i + b].scales);
            ml[b] = hi_kq_min_lanes(_mm_unpackhi_epi8(sm, _mm_setzero_si128()), y[i + b].bsums);
            s[b] = hi_kq4_block_lanes(&x[i + b], &y[i + b], sm);
        }
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
        float fs[4], fm[4];
        _mm_storeu_ps(fs, _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))));
        _mm_storeu_ps(fm, _mm_cvtepi32_ps(_mm_hadd_epi32(_mm_hadd_epi32(ml[0], ml[1]), _mm_hadd_epi32(ml[2], ml[3]))));
        for (int b = 0; b < 4; ++b) { /* lanes d*D and -dmin*D, F16C (hi_kq_d_dmin) */
            const __m128 dd = hi_kq_d_dmin(&x[i + b].d, y[i + b].d);
            acc = hi_kq_fmaf(fs[b], _mm_cvtss_f32(dd), acc);
            accm = hi_kq_fmaf(fm[b], -_mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 0x55)), accm);
        }
    }
#endif
    for (; i < n / HI_QK_K; ++i) {
        const float dd = hi_kq_f16(x[i].d) * y[i].d, dm = hi_kq_f16(x[i].dmin) * y[i].d;
        int32_t p[4], mp[4];
        hi_kq4_sums(&x[i], &y[i], quarters, p, mp);
        for (int j = 0; j < (quarters ? 4 : 1); ++j) {
            acc = hi_kq_fmaf((float)p[j], dd, acc);
            accm = hi_kq_fmaf((float)mp[j], dm, accm);
        }
    }
    return acc - accm;
}

/* the tiled kernels' row (qt: 12 Q4_K, 13 Q5_K, 14 Q6_K) */
static inline float hi_dot_kq_tiled(int qt, int n, const void *restrict vx, const void *restrict vy) {
    const block_q8_K *restrict y = (const block_q8_K *)vy;
    float out = 0.0f;
    for (int i = 0; i < n / HI_QK_K; ++i) {
        float res;
        if (qt == 14) {
            const block_q6_K *x = (const block_q6_K *)vx + i;
            res = hi_kq_f16(x->d) * (float)hi_kq6_sum(x, &y[i]);
        } else {
            int32_t is, im;
            hi_half d, dmin;
            if (qt == 12) {
                const block_q4_K *x = (const block_q4_K *)vx + i;
                hi_kq4_sums(x, &y[i], 0, &is, &im);
                d = x->d;
                dmin = x->dmin;
            } else {
                const block_q5_K *x = (const block_q5_K *)vx + i;
                hi_kq5_sums(x, &y[i], &is, &im);
                d = x->d;
                dmin = x->dmin;
            }
            res = hi_kq_fmaf(-hi_kq_f16(dmin), (float)im, hi_kq_f16(d) * (float)is);
        }
        out = hi_kq_fmaf(res, y[i].d, out);
    }
    return out;
}

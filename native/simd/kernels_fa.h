/* Attention over a typed K/V cache (the table's attn_fa, attn_fa_scratch, attn_fa_tiled): llama.cpp's CPU flash
 * attention order. A part of kernels_body.h (which has the ISA macros), included by it once per ISA unit, after
 * kernels_attn.h (whose vector exp it shares). */
#ifndef HI_INLINE
#error "kernels_fa.h is a part of kernels_body.h; include that"
#endif

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

#if defined(HI_AVX2)
/* hi_lm_decode 8 values at a time: each code's level looked up by a permute of the level table in registers (lm4's
 * 16 levels as two halves picked by the code's bit 3), then the same product d * level */
HI_INLINE void hi_lm_decode8(const int t, const uint8_t *b, float *out) {
    uint16_t dh;
    memcpy(&dh, b, 2);
    const __m256 d = _mm256_set1_ps(hi_h2f_soft(dh));
    if (t == HI_T_LM3) {
        const __m256 lv = _mm256_loadu_ps(hi_lm3_levels);
        const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
        for (int k = 0; k < 4; k++) {
            const uint32_t w = (uint32_t)b[2 + 3 * k] | ((uint32_t)b[3 + 3 * k] << 8) | ((uint32_t)b[4 + 3 * k] << 16);
            const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh), _mm256_set1_epi32(7));
            _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(d, _mm256_permutevar8x32_ps(lv, c)));
        }
    } else {
        const __m256 lo = _mm256_loadu_ps(hi_lm4_levels), hi = _mm256_loadu_ps(hi_lm4_levels + 8);
        const __m256i sh = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
        const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        for (int k = 0; k < 4; k++) { /* out[8k + 2j], out[8k + 2j + 1]: byte 4k + j's low and high nibbles */
            const __m256i x = _mm256_cvtepu8_epi32(_mm_cvtsi32_si128((int)hi_rd32(b + 2 + 4 * k)));
            const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(x, dup), sh),
                                               _mm256_set1_epi32(15));
            const __m256 l = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, c), _mm256_permutevar8x32_ps(hi, c),
                                              _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
            _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(d, l));
        }
    }
}
#endif

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
#if defined(HI_AVX2) /* the same exact conversions and one rounded product each, 8 at a time */
            for (int j = 0; j < 32; j += 8)
                _mm256_storeu_ps(out + 32 * b + j,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                   _mm_loadl_epi64((const __m128i *)(blk + 2 + j)))),
                                               _mm256_set1_ps(d)));
#else
            for (int j = 0; j < 32; j++) out[32 * b + j] = (float)(int8_t)blk[2 + j] * d;
#endif
        }
    } else if (hi_is_lm(vt)) {
        const int64_t bs = vt == HI_T_LM3 ? HI_LM3_BYTES : HI_LM4_BYTES;
#if defined(HI_AVX2)
        for (int64_t b = 0; b < hd / 32; b++) hi_lm_decode8(vt, v + b * bs, out + 32 * b);
#else
        for (int64_t b = 0; b < hd / 32; b++) hi_lm_decode(vt, v + b * bs, out + 32 * b);
#endif
    } else { /* q4_0 */
        for (int64_t b = 0; b < hd / 32; b++) {
            const uint8_t *blk = v + b * 18;
            const float d = hi_h2f(hi_rd16(blk));
#if defined(HI_AVX2) /* the same exact conversions of q - 8 and one rounded product each, 8 at a time */
            const __m128i x = _mm_loadu_si128((const __m128i *)(blk + 2)), m4 = _mm_set1_epi8(0x0F);
            const __m128i nib[2] = {_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)};
            for (int k = 0; k < 4; k++) { /* values 8k .. 8k + 7: nibbles (k & 1) * 8 .. of half k / 2 */
                const __m256i qi = _mm256_cvtepu8_epi32(_mm_srli_si128(nib[k / 2], 8 * (k & 1)));
                _mm256_storeu_ps(out + 32 * b + 8 * k,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(qi, _mm256_set1_epi32(8))),
                                               _mm256_set1_ps(d)));
            }
            continue;
#endif
            for (int j = 0; j < 16; j++) {
                out[32 * b + j] = (float)((blk[2 + j] & 0x0F) - 8) * d;
                out[32 * b + j + 16] = (float)((blk[2 + j] >> 4) - 8) * d;
            }
        }
    }
}

/* out[i] = hi_hsum8(acc[i]) for i < NH <= 8. The AVX2 / AVX-512 units take eight sums together by a transpose and
 * add with hi_hsum8's pairs: lanes l + (l + 4), then (r0 + r2) + (r1 + r3) (each a single float add, commutative):
 * the same bits as one at a time, in about a fifth of the instructions */
HI_INLINE void hi_hsum8_n(const hi_fv *acc, const int NH, float *out) {
#if defined(HI_AVX2)
    __m256 x[8];
    for (int i = 0; i < 8; i++) x[i] = i < NH ? acc[i] : _mm256_setzero_ps();
    __m256 r[4]; /* r[p] = [x_p's four r_l | x_{p+4}'s] */
    for (int p = 0; p < 4; p++)
        r[p] = _mm256_add_ps(_mm256_permute2f128_ps(x[p], x[p + 4], 0x31),
                             _mm256_permute2f128_ps(x[p], x[p + 4], 0x20));
    /* [r0 + r2, r1 + r3] of p and p + 1, interleaved: (p r02, p+1 r02, p r13, p+1 r13) in each half */
    const __m256 a01 = _mm256_add_ps(_mm256_unpacklo_ps(r[0], r[1]), _mm256_unpackhi_ps(r[0], r[1]));
    const __m256 a23 = _mm256_add_ps(_mm256_unpacklo_ps(r[2], r[3]), _mm256_unpackhi_ps(r[2], r[3]));
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(a01, a23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(a01, a23, _MM_SHUFFLE(3, 2, 3, 2)));
    if (NH == 8) {
        _mm256_storeu_ps(out, s);
    } else {
        float t[8];
        _mm256_storeu_ps(t, s);
        for (int i = 0; i < NH; i++) out[i] = t[i];
    }
#else
    for (int i = 0; i < NH; i++) out[i] = hi_hsum8(acc[i]);
#endif
}

/* a K row of nb q8_0 / q4_0 blocks (qt, a constant where inlined) against NH <= 8 query rows' q8_0 rows prepared by
 * hi_prep (row i's blocks at qv + i * rs * 4 bytes, its dy and corr likewise rs floats apart): each row's dot in
 * hi_fa_dot_legacy's order, the K block loaded (and its scale converted) once for the rows. dyt (8 rows, AVX units):
 * the rows' dy of block b at dyt[8 b ..], so the 8 products dk * dy are one vector product (the same products) */
HI_INLINE void hi_fa_dots_legacy(const int qt, const int NH, const uint8_t *w, const uint8_t *qv, const int32_t *corr,
                                 const float *dy, const float *dyt, int64_t rs, int64_t nb, float *out) {
    const int bs = hi_wbs(qt), need_corr = HI_CORR(qt) != 0;
    hi_fv acc[8];
    for (int i = 0; i < NH; i++) acc[i] = hi_fzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bs;
        const float dk = hi_h2f(hi_rd16(blk));
        const hi_wv wv = hi_load_w(qt, blk);
#if defined(HI_AVX2)
        if (qt == HI_T_Q8_0 && NH == 8 && dyt) { /* measured faster for q8_0 K; q4_0 K no faster */
            float d8[8];
            _mm256_storeu_ps(d8, _mm256_mul_ps(_mm256_set1_ps(dk), _mm256_loadu_ps(dyt + 8 * b)));
            for (int i = 0; i < 8; i++) {
                const hi_iv nc = need_corr ? hi_load_corr(corr + i * rs + 8 * b) : hi_izero();
                const hi_iv l = hi_lanes(qt, wv, hi_load_y(qv + 4 * i * rs + b * 34 + 2), nc);
                acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(d8 + i), _mm256_cvtepi32_ps(l), acc[i]);
            }
            continue;
        }
#endif
        for (int i = 0; i < NH; i++) {
            const hi_iv nc = need_corr ? hi_load_corr(corr + i * rs + 8 * b) : hi_izero();
            acc[i] = hi_fmadd8(dk * dy[i * rs + b], hi_lanes(qt, wv, hi_load_y(qv + 4 * i * rs + b * 34 + 2), nc),
                               acc[i]);
        }
    }
    hi_hsum8_n(acc, NH, out);
}

/* the rows of a q8_0 / q4_0 K (qt constant) in groups of 8, 4 and 1 (each a constant count, so the accumulators stay
 * in registers) */
HI_INLINE void hi_fa_dots_legacy_m(const int qt, const uint8_t *w, const uint8_t *qv, const int32_t *corr,
                                   const float *dy, const float *dyt, int64_t rs, int64_t m, int64_t nb, float *x) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8)
        hi_fa_dots_legacy(qt, 8, w, qv + 4 * i * rs, corr + i * rs, dy + i * rs, dyt ? dyt + i * nb : NULL, rs, nb,
                          x + i);
    if (i + 4 <= m) {
        hi_fa_dots_legacy(qt, 4, w, qv + 4 * i * rs, corr + i * rs, dy + i * rs, NULL, rs, nb, x + i);
        i += 4;
    }
    for (; i < m; i++) hi_fa_dots_legacy(qt, 1, w, qv + 4 * i * rs, corr + i * rs, dy + i * rs, NULL, rs, nb, x + i);
}

/* dyt for hi_fa_dots_legacy: row i's dy of block b (dy + i * rs) at dyt[i * nb + 8 b + i % 8], for the rows of whole
 * groups of 8 */
HI_INLINE void hi_fa_dyt(const float *dy, int64_t rs, int64_t m, int64_t nb, float *dyt) {
    for (int64_t i = 0; i + 8 <= m; i += 8)
        for (int64_t b = 0; b < nb; b++)
            for (int l = 0; l < 8; l++) dyt[i * nb + 8 * b + l] = dy[(i + l) * rs + b];
}

#if defined(HI_AVX2)
/* x[i] = k . q_i for NH <= 8 float rows q_i = q + i * qs (hd a multiple of 32), each in the AVX2 shape of
 * ggml_vec_dot_f32 (and of ggml_vec_dot_f16 on exact conversions): 4 accumulators over 32-value steps,
 * (a0 + a2) + (a1 + a3), the halves added, then hadd twice; the rows' horizontal sums taken together with those
 * pairs (the same bits as one at a time) */
HI_INLINE void hi_fa_dots_f32x(const int NH, const float *k, const float *q, int64_t qs, int64_t hd, float *x) {
    __m256 r[8];
    for (int i = 0; i < 8; i++) {
        if (i >= NH) {
            r[i] = _mm256_setzero_ps();
            continue;
        }
        const float *qi = q + i * qs;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t e = 0; e < hd; e += 32) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + e), _mm256_loadu_ps(qi + e), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + e + 8), _mm256_loadu_ps(qi + e + 8), s1);
            s2 = _mm256_fmadd_ps(_mm256_loadu_ps(k + e + 16), _mm256_loadu_ps(qi + e + 16), s2);
            s3 = _mm256_fmadd_ps(_mm256_loadu_ps(k + e + 24), _mm256_loadu_ps(qi + e + 24), s3);
        }
        r[i] = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
    }
    __m256 t[4]; /* t[p] = [row p's lo + hi | row p + 4's] */
    for (int p = 0; p < 4; p++)
        t[p] = _mm256_add_ps(_mm256_permute2f128_ps(r[p], r[p + 4], 0x20),
                             _mm256_permute2f128_ps(r[p], r[p + 4], 0x31));
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    if (NH == 8) {
        _mm256_storeu_ps(x, s);
    } else {
        float o[8];
        _mm256_storeu_ps(o, s);
        for (int i = 0; i < NH; i++) x[i] = o[i];
    }
}
#endif

/* x[i] = K row ks . query row i < m (k32: K taken back to float for a Lloyd-Max type, room for it for f16; row i's
 * float q at q + i * hd, its qv, corr, dy as hi_fa_query made them, rs floats apart from row 0's): each dot the ggml
 * vec_dot of K's type */
HI_INLINE void hi_fa_dots(int kt, const uint8_t *ks, float *k32, const float *q, const uint8_t *qv,
                          const int32_t *corr, const float *dy, const float *dyt, int64_t rs, int64_t m, int64_t hd,
                          float *x) {
#if defined(HI_AVX2)
    /* f16 K (each unit with AVX2 dots it in AVX2's shape) and, where ggml_vec_dot_f32 has AVX2's shape (not the
     * AVX-512 unit), f32 and Lloyd-Max K: K in float once (k32), the rows' float dots 8 at a time */
#if defined(HI_VNNI)
    const int fdot = kt == HI_T_F16;
#else
    const int fdot = kt == HI_T_F16 || kt == HI_T_F32 || hi_is_lm(kt);
#endif
    if (fdot) {
        if (kt == HI_T_F16) hi_fa_v_float(HI_T_F16, ks, (float *)k32, hd);
        const float *kf = kt == HI_T_F32 ? (const float *)ks : k32, *qf = kt == HI_T_F16 ? (const float *)qv : q;
        const int64_t qs = kt == HI_T_F16 ? rs : hd;
        int64_t i = 0;
        for (; i + 8 <= m; i += 8) hi_fa_dots_f32x(8, kf, qf + i * qs, qs, hd, x + i);
        if (i + 4 <= m) {
            hi_fa_dots_f32x(4, kf, qf + i * qs, qs, hd, x + i);
            i += 4;
        }
        for (; i < m; i++) hi_fa_dots_f32x(1, kf, qf + i * qs, qs, hd, x + i);
        return;
    }
#endif
    if (kt == HI_T_Q8_0) {
        hi_fa_dots_legacy_m(HI_T_Q8_0, ks, qv, corr, dy, dyt, rs, m, hd / 32, x);
    } else if (kt == HI_T_Q4_0) {
        hi_fa_dots_legacy_m(HI_T_Q4_0, ks, qv, corr, dy, dyt, rs, m, hd / 32, x);
    } else {
        for (int64_t i = 0; i < m; i++) {
            if (kt == HI_T_F32) x[i] = hi_ggml_dot_f32((const float *)ks, q + i * hd, hd);
            else if (hi_is_lm(kt)) x[i] = hi_ggml_dot_f32(k32, q + i * hd, hd);
            else x[i] = hi_fa_dot_f16((const uint16_t *)ks, (const uint16_t *)(qv + 4 * i * rs), hd);
        }
    }
}

/* a query row converted once to K's vec_dot type: fp16 for f16 K, q8_0 blocks (with their dot's per-block data) for
 * q8_0 / q4_0 K; f32 and Lloyd-Max K read q itself */
HI_INLINE void hi_fa_query(int kt, const float *q, int64_t hd, uint8_t *qv, int32_t *corr, float *dy) {
    if (kt == HI_T_F16) {
#if defined(HI_AVX2) /* the fp16 values in float: hi_fa_dots' float dots (the conversion is exact) */
        for (int64_t e = 0; e < hd; e++) ((float *)qv)[e] = hi_h2f(hi_f2h(q[e]));
#else
        for (int64_t e = 0; e < hd; e++) ((uint16_t *)qv)[e] = hi_f2h(q[e]);
#endif
    } else if (kt == HI_T_Q8_0 || kt == HI_T_Q4_0) {
        hi_quantize(HI_ACT_Q8_0, q, hd, qv);
        hi_prep(kt, qv, hd / 32, corr, dy, NULL);
    }
}

/* a cache row's bytes [p, p + len) asked into cache ahead of use: a unit's K (or V) head rows are len bytes every
 * position's row apart (the other K/V heads between), a stride the hardware prefetch follows late; the kernels ask
 * HI_FA_PF positions ahead */
#define HI_FA_PF 4
HI_INLINE void hi_fa_prefetch(const uint8_t *p, int64_t len) {
    for (int64_t o = 0; o < len; o += 64) __builtin_prefetch(p + o);
    __builtin_prefetch(p + len - 1);
}

#define HI_FA_TILE 64 /* positions a tile of hi_attn_fa_tiled (kernels_fa_tiled.h) */
/* values of a tile's V rows taken to float at a time (8 KiB of floats: they stay in L1 while every row's
 * accumulators of those values take them; a whole tile's would not) */
#define HI_FA_SLAB 32
/* floats of scratch the AVX-512 unit's query pairs take for m rows of nb blocks (kernels_fa_vnni.h) */
#if defined(HI_VNNI)
#define HI_FA_PAIRS_LEN(m, nb) (((m) / 2) * (nb) * 48)
#else
#define HI_FA_PAIRS_LEN(m, nb) 0
#endif

static int64_t hi_attn_fa_scratch(int64_t hd, int64_t m) {
    const int64_t dyt = m / 8 * 8 * (hd / 32); /* hi_fa_dyt's */
    const int64_t one = m * (3 * hd + 8) + 2 * hd + dyt + 64; /* hi_attn_fa_run's layout, then hi_attn_fa_tiled's */
    const int64_t tiled = m * (3 * hd + 8) + (m + 7) / 8 * 8 * HI_FA_TILE + HI_FA_TILE * HI_FA_SLAB + hd + dyt +
                          HI_FA_PAIRS_LEN(m, hd / 32) + 64;
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
    float *v32 = scratch + m * row, *k32 = v32 + hd, *dyt = k32 + hd, M[HI_FA_MAXG], S[HI_FA_MAXG], xs[HI_FA_MAXG];
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
    if (kt == HI_T_Q8_0 || kt == HI_T_Q4_0) hi_fa_dyt(HI_FA_DY(0), row, m, nb, dyt);
    const uint8_t *kb = (const uint8_t *)a->k + g * kh, *vb = (const uint8_t *)a->v + g * vh;
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *ks = kb + s * a->k_bytes, *vs_row = vb + s * a->v_bytes;
        if (s + HI_FA_PF < s1) {
            hi_fa_prefetch(ks + HI_FA_PF * a->k_bytes, kh);
            hi_fa_prefetch(vs_row + HI_FA_PF * a->v_bytes, vh);
        }
        const float *vf = (const float *)vs_row;
        if (vt != HI_T_F32 && vt != HI_T_F16) {
            hi_fa_v_float(vt, vs_row, v32, hd);
            vf = v32;
        }
        if (hi_is_lm(kt)) hi_fa_v_float(kt, ks, k32, hd); /* no integer dot for Lloyd-Max codes: K in float */
        hi_fa_dots(kt, ks, k32, a->q + t * a->q_row + h0 * hd, HI_FA_QV(0), HI_FA_CORR(0), HI_FA_DY(0), dyt, row, m, hd,
                   xs);
        for (int64_t i = 0; i < m; i++) {
            float x = xs[i] * a->scale;
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

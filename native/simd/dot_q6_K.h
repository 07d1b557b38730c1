/* The Q6_K x Q8_K dot product, hi_dot_Q6_K_q8_K: one path per ISA (VNNI, AVX2, SSSE3, scalar).
 * A part of dot_kquants.h (which has the maths, the helpers and the scalar definitions); include that. */
#ifndef HI_DOT_KQUANTS_H
#error "dot_q6_K.h is a part of dot_kquants.h; include that"
#endif

/* ------------------------------------------------------------------------------------------------ */
/* Q6_K                                                                                              */

#if defined(__SSSE3__) && !defined(__AVX2__)
/* the 32 bytes at p in Q6_K's pair order (hi_kq_q6_pair) */
static inline void hi_kq_q6_load(const uint8_t *p, __m128i *v0, __m128i *v1) {
    hi_kq_q6_pair(_mm_loadu_si128((const __m128i *)p), _mm_loadu_si128((const __m128i *)(p + 16)), v0, v1);
}

/* the raw quant bytes of step h (64 elements of ql, 32 of qh: groups 4h..4h+3) of a block as the file stores it,
 * in pair order: a[0..1] ql's first 32 bytes, a[2..3] its next 32, qh[0..1] the step's 32 qh bytes */
static inline void hi_kq_q6_step_load(const block_q6_K *x, int h, __m128i a[4], __m128i qh[2]) {
    hi_kq_q6_load(x->ql + 64 * h, &a[0], &a[1]);
    hi_kq_q6_load(x->ql + 64 * h + 32, &a[2], &a[3]);
    hi_kq_q6_load(x->qh + 32 * h, &qh[0], &qh[1]);
}

/* the 6-bit quants (0..63) of group 4h+k of that step, its two pair-order vectors w[0], w[1] */
static inline void hi_kq_q6_group_raw(const __m128i a[4], const __m128i qh[2], const int k, __m128i w[2]) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    for (int j = 0; j < 2; ++j) {
        const __m128i q = a[2 * (k & 1) + j], h = qh[j];
        const __m128i l4 = k < 2 ? _mm_and_si128(q, m4) : _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        const __m128i h2 = k == 0   ? _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi8(0x03)), 4)
                           : k == 1 ? _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi8(0x0c)), 2)
                           : k == 2 ? _mm_and_si128(h, _mm_set1_epi8(0x30))
                                    : _mm_srli_epi16(_mm_and_si128(h, _mm_set1_epi8((char)0xc0)), 2);
        w[j] = _mm_or_si128(l4, h2);
    }
}

/* Repacked Q6_K rows (hi_kq_zip_blocks) hold each block's quants as four 48-byte quarters, quarter k (groups 2k,
 * 2k+1, pair order) three vectors a, b, c: its vectors w0, w1, w2 in their low 6 bits, w3's bits 0-1, 2-3, 4-5 in
 * their top 2 bits. Unpacking a quarter is 11 vector ops against 17 for the file's ql / qh split. */
static inline void hi_kq_q6_pack3(const __m128i w[4], uint8_t *p) {
    /* w3's bits 2k, 2k+1 to bits 6, 7 of vector k: each byte's pair stays within its byte */
    const __m128i m3 = _mm_set1_epi8(3), t[3] = {w[3], _mm_srli_epi16(w[3], 2), _mm_srli_epi16(w[3], 4)};
    for (int k = 0; k < 3; ++k)
        _mm_storeu_si128((__m128i *)(p + 16 * k), _mm_or_si128(w[k], _mm_slli_epi16(_mm_and_si128(t[k], m3), 6)));
}

static inline void hi_kq_q6_unpack3(const uint8_t *p, __m128i w[4]) {
    const __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 16));
    const __m128i c = _mm_loadu_si128((const __m128i *)(p + 32)), m63 = _mm_set1_epi8(63);
    w[0] = _mm_and_si128(a, m63);
    w[1] = _mm_and_si128(b, m63);
    w[2] = _mm_and_si128(c, m63);
    w[3] = _mm_or_si128(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 6), _mm_set1_epi8(3)),
                                     _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(12))),
                        _mm_and_si128(_mm_srli_epi16(c, 2), _mm_set1_epi8(48)));
}

/* a block's ql / qh rewritten in place as hi_kq_q6_unpack3 reads them */
static inline void hi_kq_q6_repack_block(uint8_t *p) {
    __m128i w[16], a[4], qh[2];
    for (int h = 0; h < 2; ++h) {
        hi_kq_q6_step_load((const block_q6_K *)p, h, a, qh);
        for (int k = 0; k < 4; ++k) hi_kq_q6_group_raw(a, qh, k, w + 8 * h + 2 * k);
    }
    for (int k = 0; k < 4; ++k) hi_kq_q6_pack3(w + 4 * k, p + 48 * k);
}

/* ggml's generic kernel on a prepared activation row (hi_kq_prep_z); packed: the rows are repacked
 * (hi_kq_q6_repack_block), else as the file stores them. q enters unsigned and the -32 comes off each pair sum
 * as the prepared 32 * (its two q8). In pair order one pmaddubsw gives lanes 0..3 (or 4..7) of both sub-blocks
 * of a 32-element group side by side, and pmaddwd against the two scales adds them into the 8 int32 lanes as
 * ggml's loop does. Inlined into one kernel per layout (hi_dot_q6_K_z). */
static inline __attribute__((always_inline)) float hi_kq_dot_q6(int n, const void *restrict vx,
                                                                const hi_q8Kz *restrict y, const int packed) {
    const block_q6_K *restrict x = (const block_q6_K *)vx;
    const int nb = n / HI_QK_K;
    __m128 sums0 = _mm_setzero_ps(), sums1 = _mm_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        /* int8 -> int16 sign extension without SSE4.1; dword g of (sclo, schi): (sc[2g], sc[2g+1]) */
        const __m128i sclo = _mm_srai_epi16(_mm_unpacklo_epi8(sc8, sc8), 8);
        const __m128i schi = _mm_srai_epi16(_mm_unpackhi_epi8(sc8, sc8), 8);
        const int8_t *q6 = y[i].q6;
        const int16_t *o6 = y[i].o6;
        __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
        /* group g (32 elements, sub-blocks 2g and 2g+1) from its two 16-byte halves of quants in pair order */
#define HI_KQ_Q6_GROUP(g, w0, w1)                                                                          \
        {                                                                                                  \
            const __m128i p0 = _mm_sub_epi16(_mm_maddubs_epi16(w0, _mm_loadu_si128((const __m128i *)(q6 + 32 * (g)))), \
                                             _mm_loadu_si128((const __m128i *)(o6 + 16 * (g))));          \
            const __m128i p1 = _mm_sub_epi16(_mm_maddubs_epi16(w1, _mm_loadu_si128((const __m128i *)(q6 + 32 * (g) + 16))), \
                                             _mm_loadu_si128((const __m128i *)(o6 + 16 * (g) + 8)));      \
            const __m128i sc = _mm_shuffle_epi32((g) < 4 ? sclo : schi, ((g) & 3) * 0x55);                 \
            lo = _mm_add_epi32(lo, _mm_madd_epi16(p0, sc));                                                \
            hi = _mm_add_epi32(hi, _mm_madd_epi16(p1, sc));                                                \
        }
        if (packed) {
#define HI_KQ_Q6_QUARTER(k)                                                                                \
            {                                                                                              \
                __m128i w[4];                                                                              \
                hi_kq_q6_unpack3((const uint8_t *)&x[i] + 48 * (k), w);                                    \
                HI_KQ_Q6_GROUP(2 * (k), w[0], w[1])                                                        \
                HI_KQ_Q6_GROUP(2 * (k) + 1, w[2], w[3])                                                    \
            }
            HI_KQ_Q6_QUARTER(0)
            HI_KQ_Q6_QUARTER(1)
            HI_KQ_Q6_QUARTER(2)
            HI_KQ_Q6_QUARTER(3)
#undef HI_KQ_Q6_QUARTER
        } else {
#define HI_KQ_Q6_STEP(h)                                                                                   \
            {                                                                                              \
                __m128i a[4], qh[2], w[2];                                                                 \
                hi_kq_q6_step_load(&x[i], h, a, qh);                                                       \
                hi_kq_q6_group_raw(a, qh, 0, w);                                                           \
                HI_KQ_Q6_GROUP(4 * (h), w[0], w[1])                                                        \
                hi_kq_q6_group_raw(a, qh, 1, w);                                                           \
                HI_KQ_Q6_GROUP(4 * (h) + 1, w[0], w[1])                                                    \
                hi_kq_q6_group_raw(a, qh, 2, w);                                                           \
                HI_KQ_Q6_GROUP(4 * (h) + 2, w[0], w[1])                                                    \
                hi_kq_q6_group_raw(a, qh, 3, w);                                                           \
                HI_KQ_Q6_GROUP(4 * (h) + 3, w[0], w[1])                                                    \
            }
            HI_KQ_Q6_STEP(0)
            HI_KQ_Q6_STEP(1)
#undef HI_KQ_Q6_STEP
        }
#undef HI_KQ_Q6_GROUP
        hi_kq_gen_acc_ps(&sums0, &sums1, _mm_set1_ps(hi_kq_f16_tab[x[i].d] * y[i].d), lo, hi);
    }
    return hi_kq_gen_end_ps(0.0f, sums0, sums1);
}

/* Q6_K rows repacked (wz: hi_kq_q6_repack_block) or as stored in the file */
static inline float hi_dot_q6_K_z(int n, const void *restrict vx, const hi_q8Kz *restrict y, const int wz) {
    return wz ? hi_kq_dot_q6(n, vx, y, 1) : hi_kq_dot_q6(n, vx, y, 0);
}
#endif

static inline float hi_dot_q6_K_q8_K(int n, const void *restrict vx, const void *restrict vy) {
    const block_q6_K *restrict x = (const block_q6_K *)vx;
    const block_q8_K *restrict y = (const block_q8_K *)vy;
    const int nb = n / HI_QK_K;
#if HI_KQ_VNNI
    /* 512-bit (the fastest here on Zen 4 and Sapphire Rapids): per half h, the 64 bytes ql[64h..] hold groups
     * 4h, 4h+1 in their low nibbles (A) and 4h+2, 4h+3 in their high nibbles (B); qh[32h..] sits in both
     * 256-bit halves, shifted per half to bring the right 2 bits to bits 4..5. vpdpbusd gives 16 lanes of
     * 4-element sums (|.| <= 4*63*128 < 2^15), vpdpwssd scales them by the sub-block scale (lanes 4t..4t+3:
     * sub-block 4z+t), and the two 256-bit halves added give AVX2's 8 lanes. */
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i m48 = _mm512_set1_epi8(0x30);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i shA = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1); /* left  */
    const __m512i shB = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1); /* right */
    const __m512i idx0 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i idx1 = _mm512_add_epi32(idx0, _mm512_set1_epi32(4));
    const __m512i idx2 = _mm512_add_epi32(idx0, _mm512_set1_epi32(8));
    const __m512i idx3 = _mm512_add_epi32(idx0, _mm512_set1_epi32(12));
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const float d = hi_kq_d1(x[i].d, y[i].d);
        const __m256i off = hi_kq_q6_offset_lanes(x[i].scales, y[i].bsums);
        /* the 16 int8 scales as int16 values zero-extended to 32 bits, for vpdpwssd */
        const __m512i sc32 = _mm512_cvtepu16_epi32(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales)));
        const int8_t *q8 = y[i].qs;
        __m512i sum = _mm512_setzero_si512();
#define HI_KQ_Q6_STEP(h, ia, ib)                                                                           \
        {                                                                                                  \
            const __m512i ql = _mm512_loadu_si512((const void *)(x[i].ql + 64 * (h)));                     \
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * (h)))); \
            const __m512i wa = _mm512_ternarylogic_epi32(ql, m4, _mm512_and_si512(_mm512_sllv_epi16(qh, shA), m48), 0xea); \
            const __m512i wb = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), m4,                     \
                                                         _mm512_and_si512(_mm512_srlv_epi16(qh, shB), m48), 0xea); \
            const __m512i da = _mm512_dpbusd_epi32(zero, wa, _mm512_loadu_si512((const void *)(q8 + 128 * (h))));      \
            const __m512i db = _mm512_dpbusd_epi32(zero, wb, _mm512_loadu_si512((const void *)(q8 + 128 * (h) + 64))); \
            sum = _mm512_dpwssd_epi32(sum, da, _mm512_permutexvar_epi32(ia, sc32));                        \
            sum = _mm512_dpwssd_epi32(sum, db, _mm512_permutexvar_epi32(ib, sc32));                        \
        }
        HI_KQ_Q6_STEP(0, idx0, idx1)
        HI_KQ_Q6_STEP(1, idx2, idx3)
#undef HI_KQ_Q6_STEP
        __m256i sumi = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
        sumi = _mm256_sub_epi32(sumi, off);
        acc = HI_KQ_FMA8(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hi_kq_hsum8_ps(acc);
#elif defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i m3 = _mm256_set1_epi8(0x03);
    const __m256i m12 = _mm256_set1_epi8(0x0c);
    const __m256i m48 = _mm256_set1_epi8(0x30);
    const __m256i m192 = _mm256_set1_epi8((char)0xc0);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const float d = hi_kq_d1(x[i].d, y[i].d);
        const __m256i off = hi_kq_q6_offset_lanes(x[i].scales, y[i].bsums);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        const int8_t *q8 = y[i].qs;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        /* scales of group g: 8 x sc[2g] then 8 x sc[2g+1], as int16 */
#define HI_KQ_SC(g) _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_set_epi64x(0x0101010101010101LL * (2 * (g) + 1), \
                                                                              0x0101010101010101LL * (2 * (g)))))
#define HI_KQ_Q6_STEP(h)                                                                                   \
        {                                                                                                  \
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * (h)));                  \
            const __m256i b2 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * (h) + 32));             \
            const __m256i bh = _mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * (h)));                  \
            const __m256i w0 = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4));  \
            const __m256i w1 = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m12), 2)); \
            const __m256i w2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_and_si256(bh, m48)); \
            const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4),             \
                                               _mm256_srli_epi16(_mm256_and_si256(bh, m192), 2));          \
            const __m256i p0 = _mm256_maddubs_epi16(w0, _mm256_loadu_si256((const __m256i *)(q8 + 128 * (h))));      \
            const __m256i p1 = _mm256_maddubs_epi16(w1, _mm256_loadu_si256((const __m256i *)(q8 + 128 * (h) + 32))); \
            const __m256i p2 = _mm256_maddubs_epi16(w2, _mm256_loadu_si256((const __m256i *)(q8 + 128 * (h) + 64))); \
            const __m256i p3 = _mm256_maddubs_epi16(w3, _mm256_loadu_si256((const __m256i *)(q8 + 128 * (h) + 96))); \
            s0 = _mm256_add_epi32(s0, _mm256_add_epi32(_mm256_madd_epi16(HI_KQ_SC(4 * (h)), p0),          \
                                                       _mm256_madd_epi16(HI_KQ_SC(4 * (h) + 1), p1)));     \
            s1 = _mm256_add_epi32(s1, _mm256_add_epi32(_mm256_madd_epi16(HI_KQ_SC(4 * (h) + 2), p2),      \
                                                       _mm256_madd_epi16(HI_KQ_SC(4 * (h) + 3), p3)));     \
        }
        HI_KQ_Q6_STEP(0)
        HI_KQ_Q6_STEP(1)
#undef HI_KQ_Q6_STEP
#undef HI_KQ_SC
        const __m256i sumi = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), off);
        acc = HI_KQ_FMA8(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hi_kq_hsum8_ps(acc);
#elif defined(__SSSE3__)
    (void)x;
    hi_q8Kz z[nb > 0 ? nb : 1];
    hi_kq_prep_z(y, nb, z);
    return hi_dot_q6_K_z(n, vx, z, 0);
#else
    (void)x;
    (void)y;
    (void)nb;
    return hi_dot_q6_K_q8_K_scalar(n, vx, vy);
#endif
}

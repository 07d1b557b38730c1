/* The Q6_K x Q8_K dot product, hi_dot_Q6_K_q8_K: one path per ISA (VNNI, AVX2, SSSE3, scalar).
 * A part of dot_kquants.h (which has the maths, the helpers and the scalar definitions); include that. */
#ifndef HI_DOT_KQUANTS_H
#error "dot_q6_K.h is a part of dot_kquants.h; include that"
#endif

/* ------------------------------------------------------------------------------------------------ */
/* Q6_K                                                                                              */

#if defined(__SSSE3__) && !defined(__AVX2__)
/* the 32 bytes at p in Q6_K's pair order (hi_kq_q6_pair), unless the row is stored so already (wz) */
static inline void hi_kq_q6_load(const uint8_t *p, const int wz, __m128i *v0, __m128i *v1) {
    *v0 = _mm_loadu_si128((const __m128i *)p);
    *v1 = _mm_loadu_si128((const __m128i *)(p + 16));
    if (!wz) hi_kq_q6_pair(*v0, *v1, v0, v1);
}

/* ggml's generic kernel on a prepared activation row (hi_kq_prep_z); wz: the row's ql and qh are stored in pair
 * order (hi_kq_zip_blocks). q enters unsigned and the -32 comes off each pair sum as the prepared 32 * (its two
 * q8). In pair order one pmaddubsw gives lanes 0..3 (or 4..7) of both sub-blocks of a 32-element group side by
 * side, and pmaddwd against the two scales adds them into the 8 int32 lanes as ggml's loop does. */
static inline float hi_dot_q6_K_z(int n, const void *restrict vx, const hi_q8Kz *restrict y, const int wz) {
    const block_q6_K *restrict x = (const block_q6_K *)vx;
    const int nb = n / HI_QK_K;
    const __m128i m4 = _mm_set1_epi8(0x0f), m3 = _mm_set1_epi8(0x03), m12 = _mm_set1_epi8(0x0c);
    const __m128i m48 = _mm_set1_epi8(0x30), m192 = _mm_set1_epi8((char)0xc0);
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
#define HI_KQ_Q6_STEP(h)                                                                                   \
        {                                                                                                  \
            __m128i a0, a1, a2, a3, h0, h1;                                                                \
            hi_kq_q6_load(x[i].ql + 64 * (h), wz, &a0, &a1);                                               \
            hi_kq_q6_load(x[i].ql + 64 * (h) + 32, wz, &a2, &a3);                                          \
            hi_kq_q6_load(x[i].qh + 32 * (h), wz, &h0, &h1);                                               \
            HI_KQ_Q6_GROUP(4 * (h) + 0, _mm_or_si128(_mm_and_si128(a0, m4), _mm_slli_epi16(_mm_and_si128(h0, m3), 4)), \
                           _mm_or_si128(_mm_and_si128(a1, m4), _mm_slli_epi16(_mm_and_si128(h1, m3), 4)))  \
            HI_KQ_Q6_GROUP(4 * (h) + 1, _mm_or_si128(_mm_and_si128(a2, m4), _mm_slli_epi16(_mm_and_si128(h0, m12), 2)), \
                           _mm_or_si128(_mm_and_si128(a3, m4), _mm_slli_epi16(_mm_and_si128(h1, m12), 2))) \
            HI_KQ_Q6_GROUP(4 * (h) + 2, _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a0, 4), m4), _mm_and_si128(h0, m48)), \
                           _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a1, 4), m4), _mm_and_si128(h1, m48))) \
            HI_KQ_Q6_GROUP(4 * (h) + 3,                                                                    \
                           _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a2, 4), m4), _mm_srli_epi16(_mm_and_si128(h0, m192), 2)), \
                           _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a3, 4), m4), _mm_srli_epi16(_mm_and_si128(h1, m192), 2))) \
        }
        HI_KQ_Q6_STEP(0)
        HI_KQ_Q6_STEP(1)
#undef HI_KQ_Q6_STEP
#undef HI_KQ_Q6_GROUP
        hi_kq_gen_acc_ps(&sums0, &sums1, _mm_set1_ps(hi_kq_f16_tab[x[i].d] * y[i].d), lo, hi);
    }
    return hi_kq_gen_end_ps(0.0f, sums0, sums1);
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

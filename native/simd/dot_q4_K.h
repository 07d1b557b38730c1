/* The Q4_K x Q8_K dot product, hi_dot_Q4_K_q8_K: one path per ISA (VNNI, AVX2, SSSE3, scalar).
 * A part of dot_kquants.h (which has the maths, the helpers and the scalar definitions); include that. */
#ifndef HI_DOT_KQUANTS_H
#error "dot_q4_K.h is a part of dot_kquants.h; include that"
#endif

/* ------------------------------------------------------------------------------------------------ */
/* Q4_K                                                                                              */

static inline float hi_dot_q4_K_q8_K(int n, const void *restrict vx, const void *restrict vy) {
    const block_q4_K *restrict x = (const block_q4_K *)vx;
    const block_q8_K *restrict y = (const block_q8_K *)vy;
    const int nb = n / HI_QK_K;
#if HI_KQ_VNNI
    /* AVX2's structure with vpdpbusd for pmaddubsw and vpdpwssd (against the scale zero-extended to 32 bits:
     * the 4-element sums fit in 16 bits) for pmaddwd + add. 256-bit: on Zen 4 and Sapphire Rapids this beats
     * a 512-bit version, whose nibble split needs a lane insert and whose scales need a cross-lane permute. */
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc = _mm256_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const __m128 dd = hi_kq_d_dmin(&x[i].d, y[i].d);
        const float d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 0x55));
        const __m128i sm = hi_kq_scales_mins_v(x[i].scales);
        const __m128i mins16 = _mm_unpackhi_epi8(sm, _mm_setzero_si128());
        accm = HI_KQ_FMA4(_mm_set1_ps(dmin), _mm_cvtepi32_ps(hi_kq_min_lanes(mins16, y[i].bsums)), accm);
        const __m256i scales = _mm256_broadcastsi128_si256(sm); /* bytes: sc0..7 m0..7 */
        const uint8_t *q4 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#define HI_KQ_SC32(s) _mm256_shuffle_epi8(scales, _mm256_set1_epi32((int)(0x80808000u | (s))))
#define HI_KQ_Q4_STEP(j)                                                                                   \
        {                                                                                                  \
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q4 + 32 * (j)));                     \
            const __m256i lo = _mm256_and_si256(bits, m4);                                                 \
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);                           \
            const __m256i pl = _mm256_dpbusd_epi32(zero, lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * (j))));      \
            const __m256i ph = _mm256_dpbusd_epi32(zero, hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * (j) + 32))); \
            s0 = _mm256_dpwssd_epi32(s0, pl, HI_KQ_SC32(2 * (j)));                                         \
            s1 = _mm256_dpwssd_epi32(s1, ph, HI_KQ_SC32(2 * (j) + 1));                                     \
        }
        HI_KQ_Q4_STEP(0)
        HI_KQ_Q4_STEP(1)
        HI_KQ_Q4_STEP(2)
        HI_KQ_Q4_STEP(3)
#undef HI_KQ_Q4_STEP
#undef HI_KQ_SC32
        acc = HI_KQ_FMA8(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc);
    }
    return hi_kq_hsum8_ps(acc) + hi_kq_hsum4_ps(accm);
#elif defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const __m128 dd = hi_kq_d_dmin(&x[i].d, y[i].d);
        const float d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 0x55));
        const __m128i sm = hi_kq_scales_mins_v(x[i].scales);
        const __m128i mins16 = _mm_unpackhi_epi8(sm, _mm_setzero_si128());
        accm = HI_KQ_FMA4(_mm_set1_ps(dmin), _mm_cvtepi32_ps(hi_kq_min_lanes(mins16, y[i].bsums)), accm);
        const __m128i sc16 = _mm_unpacklo_epi8(sm, _mm_setzero_si128());
        const __m256i scales = _mm256_broadcastsi128_si256(sc16);
        const uint8_t *q4 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#define HI_KQ_Q4_STEP(j)                                                                                   \
        {                                                                                                  \
            const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((4 * (j) + 1) << 8 | 4 * (j)));     \
            const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((4 * (j) + 3) << 8 | (4 * (j) + 2))); \
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q4 + 32 * (j)));                     \
            const __m256i lo = _mm256_and_si256(bits, m4);                                                 \
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);                           \
            const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * (j))));      \
            const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * (j) + 32))); \
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(sl, pl));                                          \
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(sh, ph));                                          \
        }
        HI_KQ_Q4_STEP(0)
        HI_KQ_Q4_STEP(1)
        HI_KQ_Q4_STEP(2)
        HI_KQ_Q4_STEP(3)
#undef HI_KQ_Q4_STEP
        acc = HI_KQ_FMA8(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc);
    }
    return hi_kq_hsum8_ps(acc) + hi_kq_hsum4_ps(accm);
#elif defined(__SSSE3__)
    (void)x;
    hi_q8Kz z[nb > 0 ? nb : 1];
    hi_kq_prep_z(y, nb, z);
    return hi_dot_q4_K_z(n, vx, z, 0);
#else
    (void)x;
    (void)y;
    (void)nb;
    return hi_dot_q4_K_q8_K_scalar(n, vx, vy);
#endif
}

/* The Q5_K x Q8_K dot product, hi_dot_Q5_K_q8_K: one path per ISA (VNNI, AVX2, SSSE3, scalar).
 * A part of dot_kquants.h (which has the maths, the helpers and the scalar definitions); include that. */
#ifndef HI_DOT_KQUANTS_H
#error "dot_q5_K.h is a part of dot_kquants.h; include that"
#endif

/* ------------------------------------------------------------------------------------------------ */
/* Q5_K                                                                                              */

static inline float hi_dot_q5_K_q8_K(int n, const void *restrict vx, const void *restrict vy) {
    const block_q5_K *restrict x = (const block_q5_K *)vx;
    const block_q8_K *restrict y = (const block_q8_K *)vy;
    const int nb = n / HI_QK_K;
#if HI_KQ_VNNI
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i m16 = _mm256_set1_epi8(0x10);
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc = _mm256_setzero_ps();
    float summs = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const __m128 dd = hi_kq_d_dmin(&x[i].d, y[i].d);
        const float d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 0x55));
        const __m128i sm = hi_kq_scales_mins_v(x[i].scales);
        const __m128i mins16 = _mm_unpackhi_epi8(sm, _mm_setzero_si128());
        summs = hi_kq_fmaf(dmin, (float)hi_kq_hsum4_epi32(hi_kq_min_lanes(mins16, y[i].bsums)), summs);
        const __m256i scales = _mm256_broadcastsi128_si256(sm);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)x[i].qh);
        const uint8_t *q5 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#define HI_KQ_SC32(s) _mm256_shuffle_epi8(scales, _mm256_set1_epi32((int)(0x80808000u | (s))))
#define HI_KQ_BIT4(v, s) _mm256_and_si256((s) <= 4 ? _mm256_slli_epi16(v, 4 - (s)) : _mm256_srli_epi16(v, (s) - 4), m16)
#define HI_KQ_Q5_STEP(j)                                                                                   \
        {                                                                                                  \
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q5 + 32 * (j)));                     \
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(bits, m4), HI_KQ_BIT4(qh, 2 * (j)));       \
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4),           \
                                               HI_KQ_BIT4(qh, 2 * (j) + 1));                               \
            const __m256i pl = _mm256_dpbusd_epi32(zero, lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * (j))));      \
            const __m256i ph = _mm256_dpbusd_epi32(zero, hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * (j) + 32))); \
            s0 = _mm256_dpwssd_epi32(s0, pl, HI_KQ_SC32(2 * (j)));                                         \
            s1 = _mm256_dpwssd_epi32(s1, ph, HI_KQ_SC32(2 * (j) + 1));                                     \
        }
        HI_KQ_Q5_STEP(0)
        HI_KQ_Q5_STEP(1)
        HI_KQ_Q5_STEP(2)
        HI_KQ_Q5_STEP(3)
#undef HI_KQ_Q5_STEP
#undef HI_KQ_BIT4
#undef HI_KQ_SC32
        acc = HI_KQ_FMA8(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc);
    }
    return hi_kq_hsum8_ps(acc) + summs;
#elif defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i m16 = _mm256_set1_epi8(0x10);
    __m256 acc = _mm256_setzero_ps();
    float summs = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const __m128 dd = hi_kq_d_dmin(&x[i].d, y[i].d);
        const float d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 0x55));
        const __m128i sm = hi_kq_scales_mins_v(x[i].scales);
        const __m128i mins16 = _mm_unpackhi_epi8(sm, _mm_setzero_si128());
        summs = hi_kq_fmaf(dmin, (float)hi_kq_hsum4_epi32(hi_kq_min_lanes(mins16, y[i].bsums)), summs);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_unpacklo_epi8(sm, _mm_setzero_si128()));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)x[i].qh);
        const uint8_t *q5 = x[i].qs;
        const int8_t *q8 = y[i].qs;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        /* bit s of each qh byte to bit 4: shift the 16-bit words by 4 - s, keep bit 4 of each byte */
#define HI_KQ_BIT4(v, s) _mm256_and_si256((s) <= 4 ? _mm256_slli_epi16(v, 4 - (s)) : _mm256_srli_epi16(v, (s) - 4), m16)
#define HI_KQ_Q5_STEP(j)                                                                                   \
        {                                                                                                  \
            const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((4 * (j) + 1) << 8 | 4 * (j)));     \
            const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((4 * (j) + 3) << 8 | (4 * (j) + 2))); \
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(q5 + 32 * (j)));                     \
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(bits, m4), HI_KQ_BIT4(qh, 2 * (j)));       \
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4),           \
                                               HI_KQ_BIT4(qh, 2 * (j) + 1));                               \
            const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(q8 + 64 * (j))));      \
            const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 64 * (j) + 32))); \
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(sl, pl));                                          \
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(sh, ph));                                          \
        }
        HI_KQ_Q5_STEP(0)
        HI_KQ_Q5_STEP(1)
        HI_KQ_Q5_STEP(2)
        HI_KQ_Q5_STEP(3)
#undef HI_KQ_Q5_STEP
#undef HI_KQ_BIT4
        acc = HI_KQ_FMA8(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc);
    }
    return hi_kq_hsum8_ps(acc) + summs;
#elif defined(__SSSE3__)
    (void)x;
    hi_q8Kz z[nb > 0 ? nb : 1];
    hi_kq_prep_z(y, nb, z);
    return hi_dot_q5_K_z(n, vx, z, 0);
#else
    (void)x;
    (void)y;
    (void)nb;
    return hi_dot_q5_K_q8_K_scalar(n, vx, vy);
#endif
}

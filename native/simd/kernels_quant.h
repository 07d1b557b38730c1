/* Activation quantizers (Q8_0, Q8_1, Q8_K, F16, F32) and the per-call preparation of the activation
 * rows of the legacy types (block scales, q8_1 sums, lane corrections).
 * A part of kernels_body.h (which has the maths and the ISA macros), included by it once per ISA unit. */
#ifndef HI_INLINE
#error "kernels_quant.h is a part of kernels_body.h; include that"
#endif

/* ================================================================================================ */
/* activation quantizers */

#if defined(HI_AVX2)

HI_INLINE float hi_hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

HI_INLINE int hi_hsum_i32_8(__m256i a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 4 x 8 int32 (already in int8 range) -> 32 int8 in order */
HI_INLINE __m256i hi_pack32(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    return _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void hi_quant_q8_01(const float *x, int64_t n, uint8_t *y, int with_s) {
    const int64_t nb = n / 32;
    const size_t bs = with_s ? sizeof(block_q8_1) : sizeof(block_q8_0);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += 32, y += bs) {
        __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        __m256 ma = _mm256_andnot_ps(sign, v0);
        ma = _mm256_max_ps(ma, _mm256_andnot_ps(sign, v1));
        ma = _mm256_max_ps(ma, _mm256_andnot_ps(sign, v2));
        ma = _mm256_max_ps(ma, _mm256_andnot_ps(sign, v3));
        const float amax = hi_hmax8(ma);
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        const __m256 mul = _mm256_set1_ps(id);
        /* cvtps_epi32 rounds by MXCSR: to nearest even, as _mm256_round_ps(_MM_ROUND_NEAREST) */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, mul));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, mul));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, mul));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, mul));
        const uint16_t dh = hi_f2h(d);
        memcpy(y, &dh, 2);
        if (with_s) {
            const int sum = hi_hsum_i32_8(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
            const uint16_t sh = hi_f2h(d * (float)sum);
            memcpy(y + 2, &sh, 2);
        }
        _mm256_storeu_si256((__m256i *)(y + bs - 32), hi_pack32(i0, i1, i2, i3));
    }
}

/* ggml's nearest_int on 8 floats (v + 1.5*2^23, low 23 bits - 2^22), then MIN(127, .) and the int8 store
 * (truncation to the low byte, as C's conversion does), sign-extended back to int32 */
HI_INLINE __m256i hi_q8k_round(__m256 v) {
    const __m256i b = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(12582912.f)));
    __m256i i = _mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x00400000));
    i = _mm256_min_epi32(i, _mm256_set1_epi32(127));
    return _mm256_srai_epi32(_mm256_slli_epi32(i, 24), 24);
}

static void hi_quant_q8_K(const float *x, int64_t n, uint8_t *yv) {
    block_q8_K *y = (block_q8_K *)yv;
    const int64_t nb = n / 256;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += 256) {
        __m256 ma = _mm256_setzero_ps();
        /* max(|x|, ma): a NaN |x| leaves ma, as ggml's strict `ax > amax` scan skips NaN */
        for (int j = 0; j < 256; j += 8) ma = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), ma);
        const float amax = hi_hmax8(ma);
        if (!(amax > 0.0f)) {
            memset(&y[i], 0, sizeof(block_q8_K));
            continue;
        }
        const __m256 vmax = _mm256_set1_ps(amax);
        int jm = 0;
        for (int j = 0; j < 256; j += 8) {
            const int mk = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), vmax, _CMP_EQ_OQ));
            if (mk) { jm = j + __builtin_ctz((unsigned)mk); break; }
        }
        const float iscale = -127.f / x[jm];
        const __m256 mul = _mm256_set1_ps(iscale);
        for (int j = 0; j < 256; j += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++) q[k] = hi_q8k_round(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), mul));
            _mm256_storeu_si256((__m256i *)(y[i].qs + j), hi_pack32(q[0], q[1], q[2], q[3]));
            y[i].bsums[j / 16] = (int16_t)hi_hsum_i32_8(_mm256_add_epi32(q[0], q[1]));
            y[i].bsums[j / 16 + 1] = (int16_t)hi_hsum_i32_8(_mm256_add_epi32(q[2], q[3]));
        }
        y[i].d = 1 / iscale;
    }
}

static void hi_quant_f16(const float *x, int64_t n, uint16_t *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), 0));
    for (; i < n; i++) y[i] = hi_f2h(x[i]);
}

#elif defined(HI_SSSE3)

HI_INLINE float hi_hmax4(__m128 m) {
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

HI_INLINE int hi_hsum_i32_4(__m128i s) {
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 4 x 4 int32 (in int8 range) -> 16 int8 in order */
HI_INLINE __m128i hi_pack16(__m128i a, __m128i b, __m128i c, __m128i d) {
    return _mm_packs_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d));
}

/* ggml built without AVX quantizes with quantize_row_q8_0_ref / q8_1_ref: id = 1 / d, roundf (half away
 * from zero), s = fp16(sum q * d) (hi_quant_q8_01_ref, shared with the scalar unit) */
#define HI_Q8_REF 1

/* see the AVX2 version */
HI_INLINE __m128i hi_q8k_round(__m128 v) {
    const __m128i b = _mm_castps_si128(_mm_add_ps(v, _mm_set1_ps(12582912.f)));
    __m128i i = _mm_sub_epi32(_mm_and_si128(b, _mm_set1_epi32(0x007fffff)), _mm_set1_epi32(0x00400000));
    const __m128i lim = _mm_set1_epi32(127), gt = _mm_cmpgt_epi32(i, lim); /* no pminsd before SSE4.1 */
    i = _mm_or_si128(_mm_andnot_si128(gt, i), _mm_and_si128(gt, lim));
    return _mm_srai_epi32(_mm_slli_epi32(i, 24), 24);
}

static void hi_quant_q8_K(const float *x, int64_t n, uint8_t *yv) {
    block_q8_K *y = (block_q8_K *)yv;
    const int64_t nb = n / 256;
    const __m128 sign = _mm_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += 256) {
        __m128 ma = _mm_setzero_ps();
        for (int j = 0; j < 256; j += 4) ma = _mm_max_ps(_mm_andnot_ps(sign, _mm_loadu_ps(x + j)), ma);
        const float amax = hi_hmax4(ma);
        if (!(amax > 0.0f)) {
            memset(&y[i], 0, sizeof(block_q8_K));
            continue;
        }
        const __m128 vmax = _mm_set1_ps(amax);
        int jm = 0;
        for (int j = 0; j < 256; j += 4) {
            const int mk = _mm_movemask_ps(_mm_cmpeq_ps(_mm_andnot_ps(sign, _mm_loadu_ps(x + j)), vmax));
            if (mk) { jm = j + __builtin_ctz((unsigned)mk); break; }
        }
        const float iscale = -127.f / x[jm];
        const __m128 mul = _mm_set1_ps(iscale);
        for (int j = 0; j < 256; j += 16) {
            __m128i q[4];
            for (int k = 0; k < 4; k++) q[k] = hi_q8k_round(_mm_mul_ps(_mm_loadu_ps(x + j + 4 * k), mul));
            _mm_storeu_si128((__m128i *)(y[i].qs + j), hi_pack16(q[0], q[1], q[2], q[3]));
            y[i].bsums[j / 16] = (int16_t)hi_hsum_i32_4(_mm_add_epi32(_mm_add_epi32(q[0], q[1]), _mm_add_epi32(q[2], q[3])));
        }
        y[i].d = 1 / iscale;
    }
}

static void hi_quant_f16(const float *x, int64_t n, uint16_t *y) {
    for (int64_t i = 0; i < n; i++) y[i] = hi_f2h(x[i]);
}

#else /* scalar */

#define HI_Q8_REF 1
static void hi_quant_q8_K(const float *x, int64_t n, uint8_t *yv) {
    block_q8_K *y = (block_q8_K *)yv;
    const int64_t nb = n / 256;
    for (int64_t i = 0; i < nb; i++, x += 256) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 256; j++) {
            const float a = fabsf(x[j]);
            if (a > amax) { amax = a; max = x[j]; }
        }
        if (!(amax > 0.0f)) {
            memset(&y[i], 0, sizeof(block_q8_K));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < 256; j++) {
            const int v = hi_nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += y[i].qs[16 * g + j];
            y[i].bsums[g] = (int16_t)s;
        }
        y[i].d = 1 / iscale;
    }
}

static void hi_quant_f16(const float *x, int64_t n, uint16_t *y) {
    for (int64_t i = 0; i < n; i++) y[i] = hi_f2h(x[i]);
}

#endif

#if defined(HI_Q8_REF)
/* quantize_row_q8_0_ref / quantize_row_q8_1_ref: d = amax / 127, id = 1 / d, q = roundf(x * id),
 * s = fp16((float)sum q * d) */
static void hi_quant_q8_01(const float *x, int64_t n, uint8_t *y, int with_s) {
    const int64_t nb = n / 32;
    const size_t bs = with_s ? sizeof(block_q8_1) : sizeof(block_q8_0);
    for (int64_t i = 0; i < nb; i++, x += 32, y += bs) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = amax > fabsf(x[j]) ? amax : fabsf(x[j]);
        const float d = amax / 127.f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int8_t *q = (int8_t *)(y + bs - 32);
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            q[j] = (int8_t)roundf(x[j] * id);
            sum += q[j];
        }
        const uint16_t dh = hi_f2h(d);
        memcpy(y, &dh, 2);
        if (with_s) {
            const uint16_t sh = hi_f2h((float)sum * d);
            memcpy(y + 2, &sh, 2);
        }
    }
}
#endif

#if defined(HI_SSSE3)
/* quantize_row_q8_0_ref a block of 32 at a time in vectors, the same bits: amax by maxps (a block holding a NaN,
 * whose result depends on the scan's order, or an infinity goes to the scalar loop), x * id as the loop
 * multiplies (an infinite 1 / d to the scalar loop too), and roundf (half away from zero) as trunc(v) plus
 * sign(v) where |v - trunc(v)| >= 0.5 (v - trunc(v) is exact below 2^23) */
static void hi_quant_q8_0_sse(const float *x, int64_t n, uint8_t *y) {
    const int64_t nb = n / 32;
    const __m128 sign = _mm_set1_ps(-0.0f), half = _mm_set1_ps(0.5f), inf = _mm_set1_ps(INFINITY);
    for (int64_t i = 0; i < nb; i++, x += 32, y += sizeof(block_q8_0)) {
        __m128 v[8], ma = _mm_setzero_ps(), bad = _mm_setzero_ps();
        for (int k = 0; k < 8; k++) {
            v[k] = _mm_loadu_ps(x + 4 * k);
            const __m128 a = _mm_andnot_ps(sign, v[k]);
            bad = _mm_or_ps(bad, _mm_or_ps(_mm_cmpunord_ps(v[k], v[k]), _mm_cmpeq_ps(a, inf)));
            ma = _mm_max_ps(ma, a);
        }
        const float d = hi_hmax4(ma) / 127.f, idf = d != 0.0f ? 1.0f / d : 0.0f;
        if (_mm_movemask_ps(bad) || !(idf < INFINITY)) { /* (1 / d overflows for amax below ~2^-119) */
            hi_quant_q8_01(x, 32, y, 0);
            continue;
        }
        const __m128 id = _mm_set1_ps(idf);
        __m128i q[8];
        for (int k = 0; k < 8; k++) {
            const __m128 p = _mm_mul_ps(v[k], id);
            const __m128i t = _mm_cvttps_epi32(p);
            const __m128 frac = _mm_andnot_ps(sign, _mm_sub_ps(p, _mm_cvtepi32_ps(t)));
            const __m128i away = _mm_castps_si128(_mm_cmpge_ps(frac, half));
            const __m128i sgn = _mm_or_si128(_mm_srai_epi32(_mm_castps_si128(p), 31), _mm_set1_epi32(1));
            q[k] = _mm_add_epi32(t, _mm_and_si128(away, sgn));
        }
        const uint16_t dh = hi_f2h(d);
        memcpy(y, &dh, 2);
        _mm_storeu_si128((__m128i *)(y + 2), hi_pack16(q[0], q[1], q[2], q[3]));
        _mm_storeu_si128((__m128i *)(y + 18), hi_pack16(q[4], q[5], q[6], q[7]));
    }
}
#define HI_QUANT_Q8_0(x, n, y) hi_quant_q8_0_sse(x, n, y)
#else
#define HI_QUANT_Q8_0(x, n, y) hi_quant_q8_01(x, n, y, 0)
#endif

static void hi_quantize(int kind, const float *x, int64_t n, void *y) {
    switch (kind) {
    case HI_ACT_Q8_0: HI_QUANT_Q8_0(x, n, (uint8_t *)y); break;
    case HI_ACT_Q8_1: hi_quant_q8_01(x, n, (uint8_t *)y, 1); break;
    case HI_ACT_Q8_K: hi_quant_q8_K(x, n, (uint8_t *)y); break;
    case HI_ACT_F16: hi_quant_f16(x, n, (uint16_t *)y); break;
    case HI_ACT_F32: memcpy(y, x, (size_t)n * sizeof(float)); break;
    default: break;
    }
}

/* ================================================================================================ */
/* per-call preparation of the activation rows (legacy types) */

/* the constant c of the lane correction -c * (sum of 4 activations) this ISA uses for weight type qt, 0 if
 * none: the unsigned-weight forms of Q4_0 and Q5_0 (SSSE3, AVX2, VNNI) and Q8_0 with w + 128 (VNNI) */
#if defined(HI_SCALAR)
#define HI_CORR(qt) 0
#elif defined(HI_VNNI)
#define HI_CORR(qt) ((qt) == HI_T_Q4_0 ? 8 : (qt) == HI_T_Q5_0 ? 16 : (qt) == HI_T_Q8_0 ? 128 : 0)
#else
#define HI_CORR(qt) ((qt) == HI_T_Q4_0 ? 8 : (qt) == HI_T_Q5_0 ? 16 : 0)
#endif

#if defined(HI_SSSE3)
/* the SSSE3 K-quant dots read their activations zipped, with the sums they need, prepared once per product */
static void hi_kprep(const uint8_t *xq, int64_t nb, uint8_t *out) {
    _Static_assert(sizeof(hi_q8Kz) == HI_KPREP_BYTES, "HI_KPREP_BYTES");
    hi_kq_prep_z((const block_q8_K *)xq, (int)nb, (hi_q8Kz *)out);
}
#endif

static void hi_prep(int qt, const uint8_t *xq, int64_t nb, int32_t *corr, float *dy, float *sy) {
    const int q81 = qt == HI_T_Q4_1 || qt == HI_T_Q5_1;
    const size_t ybs = q81 ? sizeof(block_q8_1) : sizeof(block_q8_0);
    const int c = HI_CORR(qt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = xq + b * ybs;
        dy[b] = hi_h2f(hi_rd16(blk));
        if (q81 && sy) sy[b] = hi_h2f(hi_rd16(blk + 2));
        if (c && corr) {
            const int8_t *q = (const int8_t *)(blk + ybs - 32);
            (void)q;
#if defined(HI_AVX2)
            const __m256i y = _mm256_loadu_si256((const __m256i *)q);
            const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), y), _mm256_set1_epi16(1));
            _mm256_storeu_si256((__m256i *)(corr + 8 * b), _mm256_mullo_epi32(s4, _mm256_set1_epi32(-c)));
#elif defined(HI_SSSE3)
            const __m128i one8 = _mm_set1_epi8(1), one16 = _mm_set1_epi16(1);
            for (int h = 0; h < 2; h++) {
                const __m128i y = _mm_loadu_si128((const __m128i *)(q + 16 * h));
                const __m128i s4 = _mm_madd_epi16(_mm_maddubs_epi16(one8, y), one16);
                /* -c * s4 with c a power of two (SSSE3 has no pmulld) */
                const __m128i sh = _mm_cvtsi32_si128(c == 8 ? 3 : c == 16 ? 4 : 7);
                _mm_storeu_si128((__m128i *)(corr + 8 * b + 4 * h), _mm_sub_epi32(_mm_setzero_si128(), _mm_sll_epi32(s4, sh)));
            }
#endif
        }
    }
}

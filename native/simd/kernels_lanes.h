/* The 8-lane primitives of the legacy (32-element block) dot products, one set per ISA branch: weight
 * and activation loads, the integer lanes, their float accumulation, the R-row scale vectors.
 * A part of kernels_body.h (which has the maths and the ISA macros), included by it once per ISA unit. */
#ifndef HI_INLINE
#error "kernels_lanes.h is a part of kernels_body.h; include that"
#endif

/* ================================================================================================ */
/* 8-lane primitives of the legacy dot products */

#if defined(HI_AVX2)

typedef __m256i hi_wv; /* 32 weight bytes */
typedef __m256i hi_yv; /* 32 activation bytes */
typedef __m256i hi_iv; /* 8 int32 lanes */
typedef __m256 hi_fv;  /* 8 float lanes */

HI_INLINE __m256i hi_nib32(const uint8_t *qs) {
    /* the 16 bytes in both halves (a pure load), the upper half shifted by 4 bits */
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(t, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

/* bit j of the 32-bit word at qh -> 0x10 in byte j */
HI_INLINE __m256i hi_hbit32(const uint8_t *qh) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)hi_rd32(qh)), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

HI_INLINE hi_wv hi_load_w(const int qt, const uint8_t *blk) {
    switch (qt) {
    case HI_T_Q4_0: return hi_nib32(blk + 2);
    case HI_T_Q4_1: return hi_nib32(blk + 4);
    case HI_T_Q5_0: return _mm256_or_si256(hi_nib32(blk + 6), hi_hbit32(blk + 2));
    case HI_T_Q5_1: return _mm256_or_si256(hi_nib32(blk + 8), hi_hbit32(blk + 4));
    default: {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
#if defined(HI_VNNI)
        return _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)); /* w + 128, unsigned */
#else
        return w;
#endif
    }
    }
}

HI_INLINE hi_yv hi_load_y(const uint8_t *q) { return _mm256_loadu_si256((const __m256i *)q); }
HI_INLINE hi_iv hi_load_corr(const int32_t *c) { return _mm256_loadu_si256((const __m256i *)c); }
HI_INLINE hi_iv hi_izero(void) { return _mm256_setzero_si256(); }
HI_INLINE hi_fv hi_fzero(void) { return _mm256_setzero_ps(); }

HI_INLINE hi_iv hi_lanes(const int qt, hi_wv w, hi_yv y, hi_iv nc) {
#if defined(HI_VNNI)
    if (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, y);
    return _mm256_dpbusd_epi32(nc, w, y);
#else
    const __m256i one = _mm256_set1_epi16(1);
    if (qt == HI_T_Q8_0)
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w)), one);
    const __m256i l = _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), one);
    if (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) return l;
    return _mm256_add_epi32(l, nc);
#endif
}

HI_INLINE hi_fv hi_fmadd8(float d, hi_iv l, hi_fv acc) {
    return _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l), acc);
}

HI_INLINE float hi_hsum8(hi_fv x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* the scales of R <= 4 rows in one register: lanes 2i, 2i+1 = d, m of row i (the 32 bits at the block's
 * start, converted together); products with d_a and the min sums live in the same lanes */
typedef __m256 hi_sv;
HI_INLINE hi_sv hi_load_sv_m(const int R, const int has_min, const uint8_t *const *p) {
    (void)has_min;
    __m128i h = _mm_cvtsi32_si128((int)hi_rd32(p[0]));
    if (R > 1) h = _mm_insert_epi32(h, (int)hi_rd32(p[1]), 1);
    if (R > 2) h = _mm_insert_epi32(h, (int)hi_rd32(p[2]), 2);
    if (R > 3) h = _mm_insert_epi32(h, (int)hi_rd32(p[3]), 3);
    return _mm256_cvtph_ps(h);
}
HI_INLINE hi_sv hi_sv_zero(void) { return _mm256_setzero_ps(); }
HI_INLINE hi_sv hi_sv_mul(hi_sv a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
/* c + a*b in the m lanes (the d lanes compute unused values) */
HI_INLINE hi_sv hi_sv_fma_m(hi_sv a, float b, hi_sv c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
HI_INLINE float hi_sv_get_m(hi_sv a, const int i) {
    return _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_permutevar8x32_ps(a, _mm256_set1_epi32(2 * i + 1))));
}
HI_INLINE hi_fv hi_fmadd8_sv(hi_sv d, const int i, hi_iv l, hi_fv acc) {
    const __m256 dv = i == 0 ? _mm256_broadcastss_ps(_mm256_castps256_ps128(d))
                             : _mm256_permutevar8x32_ps(d, _mm256_set1_epi32(2 * i));
    return _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(l), acc);
}

#elif defined(HI_SSSE3)

typedef struct { __m128i lo, hi; } hi_wv;
typedef struct { __m128i lo, hi; } hi_yv;
typedef struct { __m128i lo, hi; } hi_iv;
typedef struct { __m128 lo, hi; } hi_fv;

HI_INLINE void hi_hbit32(const uint8_t *qh, __m128i *lo, __m128i *hi) {
    const __m128i x = _mm_set1_epi32((int)hi_rd32(qh));
    const __m128i mask = _mm_set1_epi64x(0x7fbfdfeff7fbfdfe), ones = _mm_set1_epi64x(-1), b4 = _mm_set1_epi8(0x10);
    const __m128i l = _mm_or_si128(_mm_shuffle_epi8(x, _mm_set_epi64x(0x0101010101010101, 0)), mask);
    const __m128i h = _mm_or_si128(_mm_shuffle_epi8(x, _mm_set_epi64x(0x0303030303030303, 0x0202020202020202)), mask);
    *lo = _mm_and_si128(_mm_cmpeq_epi8(l, ones), b4);
    *hi = _mm_and_si128(_mm_cmpeq_epi8(h, ones), b4);
}

HI_INLINE hi_wv hi_load_w(const int qt, const uint8_t *blk) {
    hi_wv w;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    if (qt == HI_T_Q8_0) {
        w.lo = _mm_loadu_si128((const __m128i *)(blk + 2));
        w.hi = _mm_loadu_si128((const __m128i *)(blk + 18));
        return w;
    }
    const int off = qt == HI_T_Q4_0 ? 2 : qt == HI_T_Q4_1 ? 4 : qt == HI_T_Q5_0 ? 6 : 8;
    const __m128i t = _mm_loadu_si128((const __m128i *)(blk + off));
    w.lo = _mm_and_si128(t, m4);
    w.hi = _mm_and_si128(_mm_srli_epi16(t, 4), m4);
    if (qt == HI_T_Q5_0 || qt == HI_T_Q5_1) {
        __m128i bl, bh;
        hi_hbit32(blk + off - 4, &bl, &bh);
        w.lo = _mm_or_si128(w.lo, bl);
        w.hi = _mm_or_si128(w.hi, bh);
    }
    return w;
}

HI_INLINE hi_yv hi_load_y(const uint8_t *q) {
    hi_yv y = {_mm_loadu_si128((const __m128i *)q), _mm_loadu_si128((const __m128i *)(q + 16))};
    return y;
}
HI_INLINE hi_iv hi_load_corr(const int32_t *c) {
    hi_iv v = {_mm_loadu_si128((const __m128i *)c), _mm_loadu_si128((const __m128i *)(c + 4))};
    return v;
}
HI_INLINE hi_iv hi_izero(void) { hi_iv v = {_mm_setzero_si128(), _mm_setzero_si128()}; return v; }
HI_INLINE hi_fv hi_fzero(void) { hi_fv v = {_mm_setzero_ps(), _mm_setzero_ps()}; return v; }

HI_INLINE hi_iv hi_lanes(const int qt, hi_wv w, hi_yv y, hi_iv nc) {
    const __m128i one = _mm_set1_epi16(1);
    hi_iv l;
    if (qt == HI_T_Q8_0) {
        l.lo = _mm_madd_epi16(_mm_maddubs_epi16(_mm_sign_epi8(w.lo, w.lo), _mm_sign_epi8(y.lo, w.lo)), one);
        l.hi = _mm_madd_epi16(_mm_maddubs_epi16(_mm_sign_epi8(w.hi, w.hi), _mm_sign_epi8(y.hi, w.hi)), one);
        return l;
    }
    l.lo = _mm_madd_epi16(_mm_maddubs_epi16(w.lo, y.lo), one);
    l.hi = _mm_madd_epi16(_mm_maddubs_epi16(w.hi, y.hi), one);
    if (qt == HI_T_Q4_0 || qt == HI_T_Q5_0) {
        l.lo = _mm_add_epi32(l.lo, nc.lo);
        l.hi = _mm_add_epi32(l.hi, nc.hi);
    }
    return l;
}

HI_INLINE hi_fv hi_fmadd8(float d, hi_iv l, hi_fv acc) {
    const __m128 dv = _mm_set1_ps(d);
    acc.lo = _mm_add_ps(_mm_mul_ps(dv, _mm_cvtepi32_ps(l.lo)), acc.lo);
    acc.hi = _mm_add_ps(_mm_mul_ps(dv, _mm_cvtepi32_ps(l.hi)), acc.hi);
    return acc;
}

HI_INLINE float hi_hsum8(hi_fv x) {
    __m128 r = _mm_add_ps(x.hi, x.lo);
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* exact fp16 -> fp32 of 4 values (the low 16 bits of each 32-bit lane), subnormals and inf/nan included */
HI_INLINE __m128 hi_h2f4(__m128i h) {
    const __m128i em = _mm_and_si128(h, _mm_set1_epi32(0x7fff));
    const __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
    const __m128i norm = _mm_add_epi32(_mm_slli_epi32(em, 13), _mm_set1_epi32((127 - 15) << 23));
    const __m128i infnan = _mm_or_si128(_mm_slli_epi32(em, 13), _mm_set1_epi32(0x7f800000));
    const __m128i sub = _mm_castps_si128(_mm_mul_ps(_mm_cvtepi32_ps(em), _mm_set1_ps(0x1p-24f)));
    const __m128i is_sub = _mm_cmplt_epi32(em, _mm_set1_epi32(0x0400));
    const __m128i is_inf = _mm_cmpgt_epi32(em, _mm_set1_epi32(0x7bff));
    __m128i r = _mm_or_si128(_mm_and_si128(is_inf, infnan), _mm_andnot_si128(is_inf, norm));
    r = _mm_or_si128(_mm_and_si128(is_sub, sub), _mm_andnot_si128(is_sub, r));
    return _mm_castsi128_ps(_mm_or_si128(r, sign));
}

/* the scales of R <= 4 rows: d (and m) of the rows as one vector each, 4 halves converted together */
typedef struct { __m128 d, m; } hi_sv;
HI_INLINE __m128 hi_load_h4(const int R, const uint8_t *const *p, const int off) {
    __m128i h = _mm_cvtsi32_si128(hi_rd16(p[0] + off));
    if (R > 1) h = _mm_insert_epi16(h, hi_rd16(p[1] + off), 2);
    if (R > 2) h = _mm_insert_epi16(h, hi_rd16(p[2] + off), 4);
    if (R > 3) h = _mm_insert_epi16(h, hi_rd16(p[3] + off), 6);
    return hi_h2f4(h);
}
HI_INLINE hi_sv hi_load_sv_m(const int R, const int has_min, const uint8_t *const *p) {
    hi_sv s;
    s.d = hi_load_h4(R, p, 0);
    s.m = has_min ? hi_load_h4(R, p, 2) : _mm_setzero_ps();
    return s;
}
HI_INLINE hi_sv hi_sv_zero(void) { hi_sv s = {_mm_setzero_ps(), _mm_setzero_ps()}; return s; }
HI_INLINE hi_sv hi_sv_mul(hi_sv a, float b) { a.d = _mm_mul_ps(a.d, _mm_set1_ps(b)); return a; }
HI_INLINE hi_sv hi_sv_fma_m(hi_sv a, float b, hi_sv c) { c.m = _mm_add_ps(_mm_mul_ps(a.m, _mm_set1_ps(b)), c.m); return c; }
HI_INLINE float hi_sv_get_m(hi_sv a, const int i) {
    const __m128 v = a.m;
    return _mm_cvtss_f32(i == 0 ? v : i == 1 ? _mm_shuffle_ps(v, v, 0x55) : i == 2 ? _mm_movehl_ps(v, v) : _mm_shuffle_ps(v, v, 0xff));
}
HI_INLINE hi_fv hi_fmadd8_sv(hi_sv s, const int i, hi_iv l, hi_fv acc) {
    const __m128 d = s.d;
    const __m128 dv = i == 0 ? _mm_shuffle_ps(d, d, 0x00) : i == 1 ? _mm_shuffle_ps(d, d, 0x55)
                    : i == 2 ? _mm_shuffle_ps(d, d, 0xaa) : _mm_shuffle_ps(d, d, 0xff);
    acc.lo = _mm_add_ps(_mm_mul_ps(dv, _mm_cvtepi32_ps(l.lo)), acc.lo);
    acc.hi = _mm_add_ps(_mm_mul_ps(dv, _mm_cvtepi32_ps(l.hi)), acc.hi);
    return acc;
}

#else /* scalar */

typedef struct { int8_t v[32]; } hi_wv; /* signed weights (offsets applied) */
typedef const int8_t *hi_yv;
typedef struct { int32_t v[8]; } hi_iv;
typedef struct { float v[8]; } hi_fv;

HI_INLINE hi_wv hi_load_w(const int qt, const uint8_t *blk) {
    hi_wv w;
    if (qt == HI_T_Q8_0) {
        memcpy(w.v, blk + 2, 32);
        return w;
    }
    const int off = qt == HI_T_Q4_0 ? 2 : qt == HI_T_Q4_1 ? 4 : qt == HI_T_Q5_0 ? 6 : 8;
    const int sub = qt == HI_T_Q4_0 ? 8 : qt == HI_T_Q5_0 ? 16 : 0;
    const uint32_t qh = (qt == HI_T_Q5_0 || qt == HI_T_Q5_1) ? hi_rd32(blk + off - 4) : 0;
    for (int j = 0; j < 16; j++) {
        const int lo = (blk[off + j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
        const int hi = (blk[off + j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        w.v[j] = (int8_t)(lo - sub);
        w.v[j + 16] = (int8_t)(hi - sub);
    }
    return w;
}

HI_INLINE hi_yv hi_load_y(const uint8_t *q) { return (const int8_t *)q; }
HI_INLINE hi_iv hi_load_corr(const int32_t *c) { hi_iv v; memcpy(v.v, c, 32); return v; }
HI_INLINE hi_iv hi_izero(void) { hi_iv v; memset(&v, 0, sizeof v); return v; }
HI_INLINE hi_fv hi_fzero(void) { hi_fv v; for (int k = 0; k < 8; k++) v.v[k] = 0.0f; return v; }

HI_INLINE hi_iv hi_lanes(const int qt, hi_wv w, hi_yv y, hi_iv nc) {
    (void)qt; (void)nc;
    hi_iv l;
    for (int k = 0; k < 8; k++) {
        int s = 0;
        for (int j = 4 * k; j < 4 * k + 4; j++) s += (int)w.v[j] * (int)y[j];
        l.v[k] = s;
    }
    return l;
}

HI_INLINE hi_fv hi_fmadd8(float d, hi_iv l, hi_fv acc) {
    for (int k = 0; k < 8; k++) acc.v[k] = fmaf(d, (float)l.v[k], acc.v[k]);
    return acc;
}

HI_INLINE float hi_hsum8(hi_fv x) {
    const float r0 = x.v[4] + x.v[0], r1 = x.v[5] + x.v[1], r2 = x.v[6] + x.v[2], r3 = x.v[7] + x.v[3];
    return (r0 + r2) + (r1 + r3);
}

typedef struct { float d[4], m[4]; } hi_sv;
HI_INLINE hi_sv hi_load_sv_m(const int R, const int has_min, const uint8_t *const *p) {
    hi_sv s;
    memset(&s, 0, sizeof s);
    for (int i = 0; i < R; i++) {
        s.d[i] = hi_h2f(hi_rd16(p[i]));
        s.m[i] = has_min ? hi_h2f(hi_rd16(p[i] + 2)) : 0.0f;
    }
    return s;
}
HI_INLINE hi_sv hi_sv_zero(void) { hi_sv s; memset(&s, 0, sizeof s); return s; }
HI_INLINE hi_sv hi_sv_mul(hi_sv a, float b) { for (int i = 0; i < 4; i++) a.d[i] *= b; return a; }
HI_INLINE hi_sv hi_sv_fma_m(hi_sv a, float b, hi_sv c) { for (int i = 0; i < 4; i++) c.m[i] = fmaf(a.m[i], b, c.m[i]); return c; }
HI_INLINE float hi_sv_get_m(hi_sv a, const int i) { return a.m[i]; }
HI_INLINE hi_fv hi_fmadd8_sv(hi_sv s, const int i, hi_iv l, hi_fv acc) { return hi_fmadd8(s.d[i], l, acc); }

#endif

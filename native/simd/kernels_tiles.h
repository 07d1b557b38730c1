/* Tiles (R weight rows x C activation rows) of the legacy, float and K-quant types, and the driver that
 * sweeps a job's rows over token blocks (hi_mm_run, the table's `mm`).
 * A part of kernels_body.h (which has the maths and the ISA macros), included by it once per ISA unit. */
#ifndef HI_INLINE
#error "kernels_tiles.h is a part of kernels_body.h; include that"
#endif

/* ================================================================================================ */
/* tiles */

HI_INLINE int hi_wbs(const int qt) {
    return qt == HI_T_Q4_0 ? 18 : qt == HI_T_Q4_1 ? 20 : qt == HI_T_Q5_0 ? 22 : qt == HI_T_Q5_1 ? 24 : 34;
}

/* R weight rows from r x C activation rows from t, legacy 32-element types */
HI_INLINE void hi_tile_legacy(const int qt, const int R, const int C, const hi_mm *m, int64_t r, int64_t t) {
    const int bs = hi_wbs(qt);
    const int has_min = qt == HI_T_Q4_1 || qt == HI_T_Q5_1;
    const int ybs = has_min ? 36 : 34;
    const int need_corr = HI_CORR(qt) != 0;
    const int64_t nb = m->cols / 32;
    const uint8_t *wr[HI_MAXR];
    const uint8_t *xr[HI_MAXC];
    const int32_t *cr[HI_MAXC];
    const float *dyr[HI_MAXC];
    const float *syr[HI_MAXC];
    hi_fv acc[HI_MAXR][HI_MAXC];
    hi_sv summs[HI_MAXC]; /* lane i: row r + i */
    HI_UNROLL for (int i = 0; i < R; i++) wr[i] = m->w + (size_t)(r + i) * m->w_row;
    HI_UNROLL for (int c = 0; c < C; c++) {
        xr[c] = m->x + (size_t)(t + c) * m->x_row + (ybs - 32);
        cr[c] = need_corr ? m->corr + (size_t)(t + c) * nb * 8 : NULL;
        dyr[c] = m->dy + (size_t)(t + c) * nb;
        syr[c] = has_min ? m->sy + (size_t)(t + c) * nb : NULL;
        summs[c] = hi_sv_zero();
    }
    HI_UNROLL for (int i = 0; i < R; i++) {
        HI_UNROLL for (int c = 0; c < C; c++) acc[i][c] = hi_fzero();
    }
    /* the rows of a tile are one contiguous region, and the next tiles follow it: while this tile's blocks
     * are read as R interleaved streams (too short for the hardware prefetcher), fetch what lies one tile
     * (at least 2 KiB) ahead as one linear stream at the same pace; successive tiles continue that stream */
    const size_t tile = (size_t)R * m->w_row;
    const uint8_t *pf = wr[0] + (tile > 2048 ? tile : 2048), *pf_end = pf;
    const size_t pf_step = (size_t)R * bs;
    for (int64_t b = 0; b < nb; b++) {
        for (pf_end += pf_step; pf < pf_end; pf += 64) __builtin_prefetch(pf, 0, 3);
        const uint8_t *blk[HI_MAXR];
        HI_UNROLL for (int i = 0; i < R; i++) blk[i] = wr[i] + b * bs;
        const hi_sv dm = hi_load_sv_m(R, has_min, blk); /* d (and m) of the R rows */
        hi_yv y[HI_MAXC];
        hi_iv nc[HI_MAXC];
        hi_sv dd[HI_MAXC];
        HI_UNROLL for (int c = 0; c < C; c++) {
            y[c] = hi_load_y(xr[c] + b * ybs);
            nc[c] = need_corr ? hi_load_corr(cr[c] + 8 * b) : hi_izero();
            dd[c] = hi_sv_mul(dm, dyr[c][b]); /* d_w * d_a, one float product per row */
            if (has_min) summs[c] = hi_sv_fma_m(dm, syr[c][b], summs[c]);
        }
        HI_UNROLL for (int i = 0; i < R; i++) {
            const hi_wv w = hi_load_w(qt, blk[i]);
            HI_UNROLL for (int c = 0; c < C; c++) acc[i][c] = hi_fmadd8_sv(dd[c], i, hi_lanes(qt, w, y[c], nc[c]), acc[i][c]);
        }
    }
    HI_UNROLL for (int i = 0; i < R; i++) {
        HI_UNROLL for (int c = 0; c < C; c++) {
            float s = hi_hsum8(acc[i][c]);
            if (has_min) s = s + hi_sv_get_m(summs[c], i);
            m->out[(size_t)(t + c) * m->out_row + (size_t)(r + i)] = s;
        }
    }
}

/* ---- F32 / F16 weights ------------------------------------------------------------------------- */

#if defined(HI_AVX2)
typedef __m256 hi_f8;
HI_INLINE hi_f8 hi_f8_load(const int f16, const void *p, int64_t i) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}
HI_INLINE hi_f8 hi_f8_zero(void) { return _mm256_setzero_ps(); }
HI_INLINE hi_f8 hi_f8_fma(hi_f8 a, hi_f8 b, hi_f8 c) { return _mm256_fmadd_ps(a, b, c); }
HI_INLINE hi_f8 hi_f8_add(hi_f8 a, hi_f8 b) { return _mm256_add_ps(a, b); }
HI_INLINE float hi_f8_reduce(hi_f8 x) {
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
}
#elif defined(HI_SSSE3)
typedef struct { __m128 lo, hi; } hi_f8;
HI_INLINE hi_f8 hi_f8_load(const int f16, const void *p, int64_t i) {
    hi_f8 v;
    if (f16) {
        const uint16_t *h = (const uint16_t *)p + i;
        v.lo = _mm_setr_ps(hi_h2f(h[0]), hi_h2f(h[1]), hi_h2f(h[2]), hi_h2f(h[3]));
        v.hi = _mm_setr_ps(hi_h2f(h[4]), hi_h2f(h[5]), hi_h2f(h[6]), hi_h2f(h[7]));
    } else {
        v.lo = _mm_loadu_ps((const float *)p + i);
        v.hi = _mm_loadu_ps((const float *)p + i + 4);
    }
    return v;
}
HI_INLINE hi_f8 hi_f8_zero(void) { hi_f8 v = {_mm_setzero_ps(), _mm_setzero_ps()}; return v; }
HI_INLINE hi_f8 hi_f8_fma(hi_f8 a, hi_f8 b, hi_f8 c) {
    c.lo = _mm_add_ps(_mm_mul_ps(a.lo, b.lo), c.lo);
    c.hi = _mm_add_ps(_mm_mul_ps(a.hi, b.hi), c.hi);
    return c;
}
HI_INLINE hi_f8 hi_f8_add(hi_f8 a, hi_f8 b) { a.lo = _mm_add_ps(a.lo, b.lo); a.hi = _mm_add_ps(a.hi, b.hi); return a; }
HI_INLINE float hi_f8_reduce(hi_f8 x) {
    const __m128 t0 = _mm_add_ps(x.lo, x.hi);
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
}
#endif

HI_INLINE float hi_ldf(const int f16, const void *p, int64_t i) {
    return f16 ? hi_h2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(HI_VNNI)
#define HI_FW 16 /* the AVX-512 build's float vectors */
typedef __m512 hi_f16v;
HI_INLINE hi_f16v hi_fv_load(const int f16, const void *p, int64_t i) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
               : _mm512_loadu_ps((const float *)p + i);
}
HI_INLINE hi_f16v hi_fv_zero(void) { return _mm512_setzero_ps(); }
HI_INLINE hi_f16v hi_fv_fma(hi_f16v a, hi_f16v b, hi_f16v c) { return _mm512_fmadd_ps(a, b, c); }
HI_INLINE hi_f16v hi_fv_add(hi_f16v a, hi_f16v b) { return _mm512_add_ps(a, b); }
HI_INLINE float hi_fv_vecdot_hsum(hi_f16v x) { return _mm512_reduce_add_ps(x); }
HI_INLINE float hi_fv_tiny_hsum(hi_f16v x) { return _mm512_reduce_add_ps(x); }
#elif !defined(HI_SCALAR)
#define HI_FW 8 /* the AVX2 build's, and the SSE3 build's as two halves: the 8-lane helpers above */
typedef hi_f8 hi_f16v;
#define hi_fv_load hi_f8_load
#define hi_fv_zero hi_f8_zero
#define hi_fv_fma hi_f8_fma
#define hi_fv_add hi_f8_add
#define hi_fv_vecdot_hsum hi_f8_reduce
#if defined(HI_AVX2)
HI_INLINE float hi_fv_tiny_hsum(hi_f16v x) { /* tinyBLAS: hi + lo, + movehl, + movehdup */
    __m128 v = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}
#endif
#endif

#if !defined(HI_SCALAR)
/* the end of vec_dot's F32 / F16 row from its 4 accumulators over elements [0, np) of n: their reduction, then the
 * tail (x: F16 values, or with f16x = 0 the same values converted to F32) */
HI_INLINE float hi_float_end(const int f16, const int f16x, hi_f16v a0, hi_f16v a1, hi_f16v a2, hi_f16v a3,
                             const void *w, const void *x, int64_t np, int64_t n) {
    const float red = hi_fv_vecdot_hsum(hi_fv_add(hi_fv_add(a0, a2), hi_fv_add(a1, a3)));
#if defined(HI_AVX2)
    if (!f16) { /* ggml_vec_dot_f32's float tail, contracted in an FMA build */
        float s = red;
        for (int64_t i = np; i < n; i++) s = fmaf(hi_ldf(0, w, i), hi_ldf(0, x, i), s);
        return s;
    }
#endif
    double s = (double)red;
    for (int64_t i = np; i < n; i++) s += (double)(hi_ldf(f16, w, i) * hi_ldf(f16x, x, i));
    return (float)s;
}
#endif

/* One F32 / F16 row. The AVX units take the float order of llama.cpp's AVX build: for a product over two tokens
 * or more whose length is a multiple of the vector width, llamafile's tinyBLAS (one accumulator of fused
 * multiply-adds per row and token, then its horizontal sum); otherwise ggml_vec_dot_f32 / _f16 (4 accumulators
 * over steps of 4 vectors, (a0 + a2) + (a1 + a3), the horizontal sum, the tail fused into a float (F32) or summed
 * in double (F16)). The SSSE3 unit: vec_dot of the SSE3 build (4 x 8 lanes as 8 accumulators of 4); the scalar
 * unit: ggml without SIMD, float products summed in double. */
HI_INLINE void hi_tile_float(const int f16, const hi_mm *m, int64_t r, int64_t t) {
    const void *w = m->w + (size_t)r * m->w_row;
    const void *x = m->x + (size_t)t * m->x_row;
    const int64_t n = m->cols;
    float *out = &m->out[(size_t)t * m->out_row + (size_t)r];
#if defined(HI_SCALAR)
    double d = 0.0;
    for (int64_t i = 0; i < n; i++) d += (double)(hi_ldf(f16, w, i) * hi_ldf(f16, x, i));
    *out = (float)d;
#else
#if defined(HI_AVX2)
    if (m->T >= 2 && !m->rows1 && n % HI_FW == 0) {
        hi_f16v a = hi_fv_zero();
        for (int64_t i = 0; i < n; i += HI_FW) a = hi_fv_fma(hi_fv_load(f16, w, i), hi_fv_load(f16, x, i), a);
        *out = hi_fv_tiny_hsum(a);
        return;
    }
#endif
    const int64_t np = n & ~(int64_t)(4 * HI_FW - 1);
    hi_f16v a0 = hi_fv_zero(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < np; i += 4 * HI_FW) {
        a0 = hi_fv_fma(hi_fv_load(f16, w, i), hi_fv_load(f16, x, i), a0);
        a1 = hi_fv_fma(hi_fv_load(f16, w, i + HI_FW), hi_fv_load(f16, x, i + HI_FW), a1);
        a2 = hi_fv_fma(hi_fv_load(f16, w, i + 2 * HI_FW), hi_fv_load(f16, x, i + 2 * HI_FW), a2);
        a3 = hi_fv_fma(hi_fv_load(f16, w, i + 3 * HI_FW), hi_fv_load(f16, x, i + 3 * HI_FW), a3);
    }
    *out = hi_float_end(f16, f16, a0, a1, a2, a3, w, x, np, n);
#endif
}

/* ---- K-quants ---------------------------------------------------------------------------------- */

HI_INLINE void hi_tile_kquant(const int qt, const hi_mm *m, int64_t r, int64_t t) {
    const void *w = m->w + (size_t)r * m->w_row;
    const void *x = m->x + (size_t)t * m->x_row;
    const int n = (int)m->cols;
    float v;
#if defined(HI_SSSE3)
    if (m->xk) {
        const hi_q8Kz *z = (const hi_q8Kz *)(m->xk + (size_t)t * m->xk_row);
        const int wz = m->wz;
        v = qt == HI_T_Q4_K ? hi_dot_q4_K_z(n, w, z, wz) : qt == HI_T_Q5_K ? hi_dot_q5_K_z(n, w, z, wz) : hi_dot_q6_K_z(n, w, z, wz);
        m->out[(size_t)t * m->out_row + (size_t)r] = v;
        return;
    }
#endif
    if (m->kshape == HI_KS_TILED) v = hi_dot_kq_tiled(qt, n, w, x);
    else if (m->kshape != HI_KS_VEC && qt == HI_T_Q4_K)
        v = hi_dot_q4_K_rp(n, w, x, m->kshape == HI_KS_REPACK_GEMM && t < m->T - m->T % 4);
    else if (qt == HI_T_Q4_K) v = hi_dot_q4_K_q8_K(n, w, x);
    else if (qt == HI_T_Q5_K) v = hi_dot_q5_K_q8_K(n, w, x);
    else v = hi_dot_q6_K_q8_K(n, w, x);
    m->out[(size_t)t * m->out_row + (size_t)r] = v;
}

/* ---- legacy types below AVX ------------------------------------------------------------------------ */

#if !defined(HI_AVX2)
/* ggml built without AVX (its SSE4.2 build, or baseline x86-64) multiplies the legacy types with the generic C
 * loops of quants.c: one float sum per row, block by block, a product and a sum (no FMA):
 *   Q4_0  sumf += (isum * dx) * dy          Q5_0  sumf += (dx * dy) * isum       Q8_0  sumf += isum * (dx * dy)
 *   Q4_1, Q5_1  sumf += (dx * dy) * isum + mx * sy
 * except Q4_0 on SSSE3 (hi_dot_q4_0_ssse3). isum is the block's exact integer dot product. */

/* the block's weights as int8 values (Q4_0 and Q5_0 signed, Q4_1 and Q5_1 0..31), element order */
HI_INLINE void hi_legacy_values(const int qt, const uint8_t *b, int8_t *v) {
    const uint8_t *qs = b + (qt == HI_T_Q4_0 ? 2 : qt == HI_T_Q4_1 ? 4 : qt == HI_T_Q5_0 ? 6 : 8);
    uint32_t qh = 0;
    if (qt == HI_T_Q5_0 || qt == HI_T_Q5_1) memcpy(&qh, b + (qt == HI_T_Q5_0 ? 2 : 4), 4);
    const int off = qt == HI_T_Q4_0 ? 8 : qt == HI_T_Q5_0 ? 16 : 0;
    for (int j = 0; j < 16; j++) {
        v[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - off);
        v[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
    }
}

/* the fp16 at p (2 bytes, any alignment) as float */
HI_INLINE float hi_h2f_at(const uint8_t *p) { return hi_h2f((uint16_t)(p[0] | p[1] << 8)); }

#if defined(HI_SSSE3)
/* the dot product of 32 int8 a and b as 4 int32 partial sums (|a|, sign-moved b: pmaddubsw without overflow) */
HI_INLINE __m128i hi_isum32_lanes(const int8_t *a, const int8_t *b) {
    const __m128i ones = _mm_set1_epi16(1);
    __m128i s = _mm_setzero_si128();
    for (int h = 0; h < 32; h += 16) {
        const __m128i x = _mm_loadu_si128((const __m128i *)(a + h)), y = _mm_loadu_si128((const __m128i *)(b + h));
        s = _mm_add_epi32(s, _mm_madd_epi16(ones, _mm_maddubs_epi16(_mm_sign_epi8(x, x), _mm_sign_epi8(y, x))));
    }
    return s;
}
#endif

HI_INLINE int32_t hi_isum32(const int8_t *a, const int8_t *b) {
#if defined(HI_SSSE3)
    __m128i s = hi_isum32_lanes(a, b);
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
#else
    int32_t s = 0;
    for (int j = 0; j < 32; j++) s += a[j] * b[j];
    return s;
#endif
}

/* the generic loop's step: sumf plus the term of a block (isum its integer sum, dx and mx the weight block's scale and
 * min, xb the activation block) */
HI_INLINE float hi_legacy_step(const int qt, float sumf, const float isum, const float dx, const uint8_t *xb,
                               const float mx) {
    const float dy = hi_h2f_at(xb);
    if (qt == HI_T_Q4_0) sumf += isum * dx * dy;
    else if (qt == HI_T_Q5_0) sumf += (dx * dy) * isum;
    else if (qt == HI_T_Q8_0) sumf += isum * (dx * dy);
    else sumf += (dx * dy) * isum + mx * hi_h2f_at(xb + 2);
    return sumf;
}

/* sumf plus the generic loop's terms of blocks ib0..nb-1 of a row (w) and an activation row (x) */
HI_INLINE float hi_legacy_generic_sum(const int qt, const uint8_t *w, const uint8_t *x, int64_t ib0, int64_t nb,
                                      float sumf) {
    const int bs = hi_wbs(qt), ybs = (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) ? 36 : 34;
    for (int64_t ib = ib0; ib < nb; ib++) {
        const uint8_t *wb = w + ib * bs, *xb = x + ib * ybs;
        int8_t v[32];
        if (qt == HI_T_Q8_0) memcpy(v, wb + 2, 32);
        else hi_legacy_values(qt, wb, v);
        const float mx = (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) ? hi_h2f_at(wb + 2) : 0.0f;
        sumf = hi_legacy_step(qt, sumf, (float)hi_isum32(v, (const int8_t *)(xb + ybs - 32)), hi_h2f_at(wb), xb, mx);
    }
    return sumf;
}

#if defined(HI_SSSE3)
/* ggml_vec_dot_q4_0_q8_0's SSSE3 path: pairs of blocks into 4 accumulators of 4 lanes (lane k: elements 4k..4k+3
 * of the block's low or high half), hsum_float_4x4 (hadd), the odd block generic */
HI_INLINE float hi_dot_q4_0_ssse3(const uint8_t *w, const uint8_t *x, int64_t nb) {
    __m128 acc[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    const __m128i ones = _mm_set1_epi16(1);
    int64_t ib = 0;
    for (; ib + 1 < nb; ib += 2) {
        for (int b = 0; b < 2; b++) {
            const uint8_t *wb = w + (ib + b) * 18, *xb = x + (ib + b) * 34;
            const __m128 d = _mm_set1_ps(hi_h2f_at(wb) * hi_h2f_at(xb));
            const __m128i q = _mm_loadu_si128((const __m128i *)(wb + 2)), m4 = _mm_set1_epi8(15), e8 = _mm_set1_epi8(8);
            for (int h = 0; h < 2; h++) {
                const __m128i bx = _mm_sub_epi8(_mm_and_si128(m4, h ? _mm_srli_epi64(q, 4) : q), e8);
                const __m128i by = _mm_loadu_si128((const __m128i *)(xb + 2 + 16 * h));
                const __m128i i32 = _mm_madd_epi16(ones, _mm_maddubs_epi16(_mm_sign_epi8(bx, bx), _mm_sign_epi8(by, bx)));
                acc[2 * b + h] = _mm_add_ps(_mm_mul_ps(d, _mm_cvtepi32_ps(i32)), acc[2 * b + h]);
            }
        }
    }
    __m128 r = _mm_hadd_ps(_mm_hadd_ps(acc[0], acc[1]), _mm_hadd_ps(acc[2], acc[3]));
    r = _mm_hadd_ps(r, r);
    r = _mm_hadd_ps(r, r);
    return hi_legacy_generic_sum(HI_T_Q4_0, w, x, ib, nb, _mm_cvtss_f32(r));
}
#endif

#if defined(HI_SSSE3)
/* 4 fp16 values (the low 4 16-bit lanes of h) as floats in *f, when all are normal (else 0: the caller converts
 * them one by one): the bits of hi_h2f_soft's normal case, (em + (112 << 10)) << 13 | sign << 16 */
HI_INLINE int hi_h2f4_normal(__m128i h, __m128 *f) {
    const __m128i u = _mm_unpacklo_epi16(h, _mm_setzero_si128());
    const __m128i em = _mm_and_si128(u, _mm_set1_epi32(0x7fff));
    const __m128i ok = _mm_and_si128(_mm_cmpgt_epi32(em, _mm_set1_epi32(0x03ff)), _mm_cmplt_epi32(em, _mm_set1_epi32(0x7c00)));
    const __m128i sign = _mm_slli_epi32(_mm_and_si128(u, _mm_set1_epi32(0x8000)), 16);
    *f = _mm_castsi128_ps(_mm_or_si128(_mm_slli_epi32(_mm_add_epi32(em, _mm_set1_epi32(112 << 10)), 13), sign));
    return _mm_movemask_epi8(ok) == 0xffff;
}

/* the scales of 4 Q8_0 blocks (34 bytes apart) at w and x one by one: some is not a normal fp16 (out of line) */
static __attribute__((noinline)) void hi_q8_0_scales_soft(const uint8_t *w, const uint8_t *x, __m128 *dw, __m128 *dx) {
    *dw = _mm_setr_ps(hi_h2f_at(w), hi_h2f_at(w + 34), hi_h2f_at(w + 68), hi_h2f_at(w + 102));
    *dx = _mm_setr_ps(hi_h2f_at(x), hi_h2f_at(x + 34), hi_h2f_at(x + 68), hi_h2f_at(x + 102));
}

/* ggml_vec_dot_q8_0_q8_0 below AVX is the generic loop, sumf += (float)isum_b * (dx_b * dy_b) block by block: the
 * integer sums (exact, any order) and the scale products of 4 blocks at a time in vectors, then the 4 float adds in
 * the loop's order */
HI_INLINE float hi_dot_q8_0_ssse3(const uint8_t *w, const uint8_t *x, int64_t nb) {
    float sumf = 0.0f;
    int64_t ib = 0;
    for (; ib + 3 < nb; ib += 4) {
        __m128i s[4];
        for (int b = 0; b < 4; b++)
            s[b] = hi_isum32_lanes((const int8_t *)(w + (ib + b) * 34 + 2), (const int8_t *)(x + (ib + b) * 34 + 2));
        const __m128 isum = _mm_cvtepi32_ps(_mm_hadd_epi32(_mm_hadd_epi32(s[0], s[1]), _mm_hadd_epi32(s[2], s[3])));
        const uint8_t *wb = w + ib * 34, *xb = x + ib * 34;
        const __m128i hw = _mm_setr_epi16((short)hi_rd16(wb), (short)hi_rd16(wb + 34), (short)hi_rd16(wb + 68),
                                          (short)hi_rd16(wb + 102), 0, 0, 0, 0);
        const __m128i hx = _mm_setr_epi16((short)hi_rd16(xb), (short)hi_rd16(xb + 34), (short)hi_rd16(xb + 68),
                                          (short)hi_rd16(xb + 102), 0, 0, 0, 0);
        __m128 dw, dx;
        if (__builtin_expect(!(hi_h2f4_normal(hw, &dw) & hi_h2f4_normal(hx, &dx)), 0)) hi_q8_0_scales_soft(wb, xb, &dw, &dx);
        float t[4];
        _mm_storeu_ps(t, _mm_mul_ps(isum, _mm_mul_ps(dw, dx)));
        sumf += t[0];
        sumf += t[1];
        sumf += t[2];
        sumf += t[3];
    }
    return hi_legacy_generic_sum(HI_T_Q8_0, w, x, ib, nb, sumf);
}
#endif

HI_INLINE void hi_tile_legacy_generic(const int qt, const hi_mm *m, int64_t r, int64_t t) {
    const uint8_t *w = m->w + (size_t)r * m->w_row, *x = m->x + (size_t)t * m->x_row;
    const int64_t nb = m->cols / 32;
    float *out = &m->out[(size_t)t * m->out_row + (size_t)r];
#if defined(HI_SSSE3)
    if (qt == HI_T_Q4_0) {
        *out = hi_dot_q4_0_ssse3(w, x, nb);
        return;
    }
    if (qt == HI_T_Q8_0) {
        *out = hi_dot_q8_0_ssse3(w, x, nb);
        return;
    }
#endif
    *out = hi_legacy_generic_sum(qt, w, x, 0, nb, 0.0f);
}
#endif

/* ---- driver ------------------------------------------------------------------------------------ */

#include "kernels_rows.h"

HI_INLINE void hi_tile(const int qt, const int R, const int C, const hi_mm *m, int64_t r, int64_t t) {
#if !defined(HI_AVX2)
    if (!(qt == HI_T_F32 || qt == HI_T_F16 || qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K)) {
        HI_UNROLL for (int i = 0; i < R; i++) {
            HI_UNROLL for (int c = 0; c < C; c++) hi_tile_legacy_generic(qt, m, r + i, t + c);
        }
        return;
    }
#endif
    if (qt == HI_T_F32 || qt == HI_T_F16 || qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K) {
        HI_UNROLL for (int i = 0; i < R; i++) {
            HI_UNROLL for (int c = 0; c < C; c++) {
                if (qt == HI_T_F32 || qt == HI_T_F16) hi_tile_float(qt == HI_T_F16, m, r + i, t + c);
                else hi_tile_kquant(qt, m, r + i, t + c);
            }
        }
    } else {
        hi_tile_legacy(qt, R, C, m, r, t);
    }
}

/* the last te - t < HI_CG tokens of R rows at r: in GGML_DECODE_ROWS one tile of that width (a legacy tile's float
 * steps per row and token do not depend on its shape), else one token at a time as llama.cpp's shapes have them */
HI_INLINE void hi_tile_rest(const int qt, const int R, const hi_mm *m, int64_t r, int64_t t, int64_t te) {
#if HI_CG > 2
    if (m->rows1 && te - t == 3) {
        hi_tile(qt, R, 3, m, r, t);
        return;
    }
#endif
#if HI_CG > 1
    if (m->rows1 && te - t == 2) {
        hi_tile(qt, R, 2, m, r, t);
        return;
    }
#endif
    for (; t < te; t++) hi_tile(qt, R, 1, m, r, t);
}

HI_INLINE void hi_drive(const int qt, const hi_mm *m, int64_t r0, int64_t r1) {
    /* the float and K-quant tiles gain nothing from wide tiles: use 1 x 1 for them (and for every type below
     * AVX, where the legacy types take ggml's one-row generic loops) */
#if defined(HI_AVX2)
    const int legacy = !(qt == HI_T_F32 || qt == HI_T_F16 || qt == HI_T_Q4_K || qt == HI_T_Q5_K || qt == HI_T_Q6_K);
#else
    const int legacy = 0;
#endif
    for (int64_t tb = 0; tb < m->T; tb += HI_TB) {
        const int64_t te = tb + HI_TB < m->T ? tb + HI_TB : m->T;
        int64_t r = r0;
        if (!legacy && te - tb == 1 && m->pf > 0) {
            /* one token (decode): the chunk's rows are one linear stream; keep m->pf bytes of it requested
             * ahead, since the hardware prefetcher restarts at every 4 KiB page */
            hi_pfs pf;
            hi_pf_start(&pf, m, r0, r1);
            for (; r < r1; r++) {
                hi_pf_row(&pf);
                hi_tile(qt, 1, 1, m, r, tb);
            }
        } else if (!legacy) {
            /* GGML_DECODE_ROWS (and the AVX units' K-quants in every shape): tokens [tb, tg) in groups of G
             * against the rows (kernels_rows.h; the last group shorter), a last single token alone. Most types take each group over the chunk's rows: its
             * activations stay in L1 while the rows (in L2) pass; some a few rows at a time, every group in turn */
            const int G = m->rows1 || hi_rows_any_op(qt) ? hi_rows_group(qt, m) : 0, S = hi_rows_step(qt);
            /* the repacked gemm's shape covers the first T - T % 4 tokens; the rest (gemv) one at a time below */
            const int64_t gb = m->kshape == HI_KS_REPACK_GEMM ? m->T - m->T % 4 : te;
            const int64_t lim = gb < te ? (gb > tb ? gb : tb) : te;
            const int64_t tg = G < 2 ? tb : (lim - tb) % G == 1 ? lim - 1 : lim;
            if (S > 0) {
                for (r = r0; r < r1; r += S)
                    for (int64_t t = tb; t < tg; t += G)
                        hi_rows_call(qt, m, r, r + S < r1 ? r + S : r1, t, tg - t < G ? (int)(tg - t) : G);
            } else {
                for (int64_t t = tb; t < tg; t += G) hi_rows_call(qt, m, r0, r1, t, tg - t < G ? (int)(tg - t) : G);
            }
            for (r = r0; tg < te && r < r1; r++)
                for (int64_t t = tg; t < te; t++) hi_tile(qt, 1, 1, m, r, t);
        } else if (te - tb == 1) {
            for (; r + HI_RV <= r1; r += HI_RV) hi_tile(qt, HI_RV, 1, m, r, tb);
            for (; r < r1; r++) hi_tile(qt, 1, 1, m, r, tb);
        } else {
            for (; r + HI_RG <= r1; r += HI_RG) {
                int64_t t = tb;
                for (; t + HI_CG <= te; t += HI_CG) hi_tile(qt, HI_RG, HI_CG, m, r, t);
                hi_tile_rest(qt, HI_RG, m, r, t, te);
            }
            for (; r < r1; r++) {
                int64_t t = tb;
                for (; t + HI_CG <= te; t += HI_CG) hi_tile(qt, 1, HI_CG, m, r, t);
                hi_tile_rest(qt, 1, m, r, t, te);
            }
        }
    }
}

#define HI_DEF_MM(NAME, QT) \
    static __attribute__((noinline)) void NAME(const hi_mm *m, int64_t r0, int64_t r1) { hi_drive(QT, m, r0, r1); }
HI_DEF_MM(hi_mm_f32, HI_T_F32)
HI_DEF_MM(hi_mm_f16, HI_T_F16)
HI_DEF_MM(hi_mm_q4_0, HI_T_Q4_0)
HI_DEF_MM(hi_mm_q4_1, HI_T_Q4_1)
HI_DEF_MM(hi_mm_q5_0, HI_T_Q5_0)
HI_DEF_MM(hi_mm_q5_1, HI_T_Q5_1)
HI_DEF_MM(hi_mm_q8_0, HI_T_Q8_0)
HI_DEF_MM(hi_mm_q4_K, HI_T_Q4_K)
HI_DEF_MM(hi_mm_q5_K, HI_T_Q5_K)
HI_DEF_MM(hi_mm_q6_K, HI_T_Q6_K)

static void hi_mm_run(const hi_mm *m, int64_t r0, int64_t r1) {
    switch (m->qtype) {
    case HI_T_F32: hi_mm_f32(m, r0, r1); break;
    case HI_T_F16: hi_mm_f16(m, r0, r1); break;
    case HI_T_Q4_0: hi_mm_q4_0(m, r0, r1); break;
    case HI_T_Q4_1: hi_mm_q4_1(m, r0, r1); break;
    case HI_T_Q5_0: hi_mm_q5_0(m, r0, r1); break;
    case HI_T_Q5_1: hi_mm_q5_1(m, r0, r1); break;
    case HI_T_Q8_0: hi_mm_q8_0(m, r0, r1); break;
    case HI_T_Q4_K: hi_mm_q4_K(m, r0, r1); break;
    case HI_T_Q5_K: hi_mm_q5_K(m, r0, r1); break;
    case HI_T_Q6_K: hi_mm_q6_K(m, r0, r1); break;
    default: break;
    }
}

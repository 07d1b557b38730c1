/* ================================================================================================ */
/* F32 / F16 weights: each weight vector loaded (F16: converted) once for the group */

#if !defined(HI_SCALAR)
#if defined(HI_VNNI)
#define HI_FR 2 /* rows a tile: each activation vector loaded once for both (what bounds these products is the
                 * activations' stream from L2, which they read whole for every row) */
#define HI_FG 3 /* tokens: 24 accumulators */
#elif defined(HI_AVX2)
#define HI_FR 1
#define HI_FG 3 /* 12 of the 16 registers */
#else
#define HI_FR 1
#define HI_FG 2
#endif

/* R (<= HI_FR) weight rows from r against the cnt activation rows x (x32: in F32, for F16 weights their conversions,
 * hi_rows_f16x) */
HI_INLINE void hi_rows_float(const int f16, const int R, const hi_mm *m, int64_t r, int64_t t, const void *const *x,
                             const int cnt, const int x32) {
    const void *w[HI_FR];
    HI_UNROLL for (int u = 0; u < HI_FR; u++) w[u] = m->w + (size_t)(r + (u < R ? u : 0)) * m->w_row;
    const int64_t n = m->cols, np = n & ~(int64_t)(4 * HI_FW - 1);
    hi_f16v a[HI_FR][HI_FG][4];
    HI_UNROLL for (int u = 0; u < HI_FR; u++) {
        HI_UNROLL for (int g = 0; g < HI_FG; g++) {
            HI_UNROLL for (int k = 0; k < 4; k++) a[u][g][k] = hi_fv_zero();
        }
    }
    for (int64_t i = 0; i < np; i += 4 * HI_FW) {
        HI_UNROLL for (int k = 0; k < 4; k++) {
            hi_f16v wv[HI_FR];
            HI_UNROLL for (int u = 0; u < R; u++) wv[u] = hi_fv_load(f16, w[u], i + k * HI_FW);
            HI_UNROLL for (int g = 0; g < HI_FG; g++) {
                if (g >= cnt) break;
                const hi_f16v xv = hi_fv_load(!x32, x[g], i + k * HI_FW);
                HI_UNROLL for (int u = 0; u < R; u++) a[u][g][k] = hi_fv_fma(wv[u], xv, a[u][g][k]);
            }
        }
    }
    HI_UNROLL for (int u = 0; u < R; u++) {
        HI_UNROLL for (int g = 0; g < HI_FG; g++) {
            if (g >= cnt) break;
            m->out[(size_t)(t + g) * m->out_row + (size_t)(r + u)] =
                hi_float_end(f16, !x32, a[u][g][0], a[u][g][1], a[u][g][2], a[u][g][3], w[u], x[g], np, n);
        }
    }
}

/* n F16 values at h as F32 at f, as hi_fv_load converts them (exact) */
HI_INLINE void hi_rows_f16x(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#if defined(HI_AVX2)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = hi_h2f(h[i]);
}
#endif

/* ================================================================================================ */
/* legacy types below AVX: ggml's generic loops (and the SSSE3 Q4_0 / Q8_0 kernels), each block's values once */

#if !defined(HI_AVX2)
#define HI_LG 8

#if defined(HI_SSSE3)
/* hi_dot_q4_0_ssse3 for the group */
HI_INLINE void hi_rows_q4_0_ssse3(const uint8_t *w, const uint8_t *const *x, float *const *os, int64_t nb, const int cnt) {
    __m128 acc[HI_LG][4];
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        HI_UNROLL for (int k = 0; k < 4; k++) acc[g][k] = _mm_setzero_ps();
    }
    const __m128i ones = _mm_set1_epi16(1), m4 = _mm_set1_epi8(15), e8 = _mm_set1_epi8(8);
    int64_t ib = 0;
    for (; ib + 1 < nb; ib += 2) {
        HI_UNROLL for (int b = 0; b < 2; b++) {
            const uint8_t *wb = w + (ib + b) * 18;
            const float dw = hi_h2f_at(wb);
            const __m128i q = _mm_loadu_si128((const __m128i *)(wb + 2));
            __m128i bx[2], ax[2];
            HI_UNROLL for (int h = 0; h < 2; h++) {
                bx[h] = _mm_sub_epi8(_mm_and_si128(m4, h ? _mm_srli_epi64(q, 4) : q), e8);
                ax[h] = _mm_sign_epi8(bx[h], bx[h]);
            }
            HI_UNROLL for (int g = 0; g < HI_LG; g++) {
                if (g >= cnt) break;
                const uint8_t *xb = x[g] + (ib + b) * 34;
                const __m128 d = _mm_set1_ps(dw * hi_h2f_at(xb));
                HI_UNROLL for (int h = 0; h < 2; h++) {
                    const __m128i by = _mm_loadu_si128((const __m128i *)(xb + 2 + 16 * h));
                    const __m128i i32 = _mm_madd_epi16(ones, _mm_maddubs_epi16(ax[h], _mm_sign_epi8(by, bx[h])));
                    acc[g][2 * b + h] = _mm_add_ps(_mm_mul_ps(d, _mm_cvtepi32_ps(i32)), acc[g][2 * b + h]);
                }
            }
        }
    }
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        if (g >= cnt) break;
        __m128 r = _mm_hadd_ps(_mm_hadd_ps(acc[g][0], acc[g][1]), _mm_hadd_ps(acc[g][2], acc[g][3]));
        r = _mm_hadd_ps(r, r);
        r = _mm_hadd_ps(r, r);
        *os[g] = hi_legacy_generic_sum(HI_T_Q4_0, w, x[g], ib, nb, _mm_cvtss_f32(r));
    }
}

/* hi_dot_q8_0_ssse3 for the group: the weights' magnitudes and scales once per 4 blocks */
HI_INLINE void hi_rows_q8_0_ssse3(const uint8_t *w, const uint8_t *const *x, float *const *os, int64_t nb, const int cnt) {
    float sumf[HI_LG];
    HI_UNROLL for (int g = 0; g < HI_LG; g++) sumf[g] = 0.0f;
    const __m128i ones = _mm_set1_epi16(1);
    int64_t ib = 0;
    for (; ib + 3 < nb; ib += 4) {
        const uint8_t *wb = w + ib * 34;
        __m128i a[8], aa[8];
        HI_UNROLL for (int k = 0; k < 8; k++) {
            a[k] = _mm_loadu_si128((const __m128i *)(wb + (k / 2) * 34 + 2 + 16 * (k % 2)));
            aa[k] = _mm_sign_epi8(a[k], a[k]);
        }
        const __m128i hw = _mm_setr_epi16((short)hi_rd16(wb), (short)hi_rd16(wb + 34), (short)hi_rd16(wb + 68),
                                          (short)hi_rd16(wb + 102), 0, 0, 0, 0);
        __m128 dw;
        if (__builtin_expect(!hi_h2f4_normal(hw, &dw), 0))
            dw = _mm_setr_ps(hi_h2f_at(wb), hi_h2f_at(wb + 34), hi_h2f_at(wb + 68), hi_h2f_at(wb + 102));
        HI_UNROLL for (int g = 0; g < HI_LG; g++) {
            if (g >= cnt) break;
            const uint8_t *xb = x[g] + ib * 34;
            __m128i s[4];
            HI_UNROLL for (int b = 0; b < 4; b++) {
                s[b] = _mm_setzero_si128();
                HI_UNROLL for (int h = 0; h < 2; h++) {
                    const __m128i y = _mm_loadu_si128((const __m128i *)(xb + b * 34 + 2 + 16 * h));
                    s[b] = _mm_add_epi32(s[b], _mm_madd_epi16(ones, _mm_maddubs_epi16(aa[2 * b + h], _mm_sign_epi8(y, a[2 * b + h]))));
                }
            }
            const __m128 isum = _mm_cvtepi32_ps(_mm_hadd_epi32(_mm_hadd_epi32(s[0], s[1]), _mm_hadd_epi32(s[2], s[3])));
            const __m128i hx = _mm_setr_epi16((short)hi_rd16(xb), (short)hi_rd16(xb + 34), (short)hi_rd16(xb + 68),
                                              (short)hi_rd16(xb + 102), 0, 0, 0, 0);
            __m128 dx;
            if (__builtin_expect(!hi_h2f4_normal(hx, &dx), 0))
                dx = _mm_setr_ps(hi_h2f_at(xb), hi_h2f_at(xb + 34), hi_h2f_at(xb + 68), hi_h2f_at(xb + 102));
            float t4[4];
            _mm_storeu_ps(t4, _mm_mul_ps(isum, _mm_mul_ps(dw, dx)));
            sumf[g] += t4[0];
            sumf[g] += t4[1];
            sumf[g] += t4[2];
            sumf[g] += t4[3];
        }
    }
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        if (g >= cnt) break;
        *os[g] = hi_legacy_generic_sum(HI_T_Q8_0, w, x[g], ib, nb, sumf[g]);
    }
}
#endif

/* the generic loop for the group: each block's values and scales once */
HI_INLINE void hi_rows_legacy(const int qt, const hi_mm *m, int64_t r, int64_t t, const int cnt) {
    const uint8_t *w = m->w + (size_t)r * m->w_row;
    const uint8_t *x[HI_LG];
    float *os[HI_LG];
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        x[g] = m->x + (size_t)(t + (g < cnt ? g : 0)) * m->x_row;
        os[g] = &m->out[(size_t)(t + (g < cnt ? g : 0)) * m->out_row + (size_t)r];
    }
    const int64_t nb = m->cols / 32;
#if defined(HI_SSSE3)
    if (qt == HI_T_Q4_0) {
        hi_rows_q4_0_ssse3(w, x, os, nb, cnt);
        return;
    }
    if (qt == HI_T_Q8_0) {
        hi_rows_q8_0_ssse3(w, x, os, nb, cnt);
        return;
    }
#endif
    const int bs = hi_wbs(qt), ybs = (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) ? 36 : 34;
    float sumf[HI_LG];
    HI_UNROLL for (int g = 0; g < HI_LG; g++) sumf[g] = 0.0f;
    for (int64_t ib = 0; ib < nb; ib++) {
        const uint8_t *wb = w + ib * bs;
        int8_t v[32];
        if (qt == HI_T_Q8_0) memcpy(v, wb + 2, 32);
        else hi_legacy_values(qt, wb, v);
        const float dx = hi_h2f_at(wb), mx = (qt == HI_T_Q4_1 || qt == HI_T_Q5_1) ? hi_h2f_at(wb + 2) : 0.0f;
        HI_UNROLL for (int g = 0; g < HI_LG; g++) {
            if (g >= cnt) break;
            const uint8_t *xb = x[g] + ib * ybs;
            sumf[g] = hi_legacy_step(qt, sumf[g], (float)hi_isum32(v, (const int8_t *)(xb + ybs - 32)), dx, xb, mx);
        }
    }
    HI_UNROLL for (int g = 0; g < HI_LG; g++) {
        if (g >= cnt) break;
        *os[g] = sumf[g];
    }
}
#endif

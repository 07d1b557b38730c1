/* ================================================================================================ */
/* K-quants, SSSE3: ggml's generic kernels on the prepared activations (hi_q8Kz), each block's weights unpacked once */

#define HI_KG 8

/* Q4_K / Q5_K (hi_kq_dot_k4, layout kind) for the group: per block the weight vectors of its 4 steps, then per
 * token the integer lanes and hi_kq_k4_block_acc's float steps; the min terms two blocks at a time per token */
HI_INLINE void hi_rows_k4_z(const int64_t nb, const uint8_t *restrict vx, const hi_q8Kz *const *ys, const int kind,
                            const int wz, float *const *os, const int cnt) {
    const size_t bs = kind == HI_K4_Q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const __m128i m4 = _mm_set1_epi8(0x0f), m16 = _mm_set1_epi8(0x10);
    __m128 s0[HI_KG], s1[HI_KG];
    float sumf[HI_KG];
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        s0[g] = s1[g] = _mm_setzero_ps();
        sumf[g] = 0.0f;
    }
    for (int64_t i = 0; i < nb; i += 2) {
        __m128i v[2][HI_KG];
        float dmv[2][HI_KG];
        const int nbk = i + 1 < nb ? 2 : 1;
        for (int u = 0; u < nbk; u++) {
            const uint8_t *b = vx + (size_t)(i + u) * bs, *qs = b + (kind == HI_K4_Q5 ? 48 : 16);
            hi_half dd[2];
            memcpy(dd, b, 4);
            const __m128i sm = hi_kq_scales_mins_v(b + 4);
            const __m128i sc16 = _mm_unpacklo_epi8(sm, _mm_setzero_si128());
            __m128i W[16]; /* step j: Q4P: b0 & 15, b0 >> 4, b1 & 15, b1 >> 4; else hi_kq_k4_step_sse's w[4] */
            const __m128i qh0 = kind == HI_K4_Q5 ? hi_kq_load_z(b + 16, wz) : m4;
            const __m128i qh1 = kind == HI_K4_Q5 ? hi_kq_load_z(b + 32, wz) : m4;
            HI_UNROLL for (int j = 0; j < 4; j++) {
                const __m128i b0 = kind == HI_K4_Q4P ? _mm_loadu_si128((const __m128i *)(qs + 32 * j)) : hi_kq_load_z(qs + 32 * j, wz);
                const __m128i b1 = kind == HI_K4_Q4P ? _mm_loadu_si128((const __m128i *)(qs + 32 * j + 16)) : hi_kq_load_z(qs + 32 * j + 16, wz);
                const __m128i l0 = _mm_and_si128(b0, m4), h0 = _mm_and_si128(_mm_srli_epi16(b0, 4), m4);
                const __m128i l1 = _mm_and_si128(b1, m4), h1 = _mm_and_si128(_mm_srli_epi16(b1, 4), m4);
                if (kind == HI_K4_Q4P) {
                    W[4 * j] = l0, W[4 * j + 1] = h0, W[4 * j + 2] = l1, W[4 * j + 3] = h1;
                } else {
                    W[4 * j] = l0, W[4 * j + 1] = l1, W[4 * j + 2] = h0, W[4 * j + 3] = h1;
                    if (kind == HI_K4_Q5) { /* bit s of each qh byte to bit 4 (hi_kq_k4_block's HI_KQ_BIT4) */
#define HI_R_BIT4(v, s) _mm_and_si128((s) <= 4 ? _mm_slli_epi16(v, 4 - (s)) : _mm_srli_epi16(v, (s) - 4), m16)
                        W[4 * j] = _mm_or_si128(W[4 * j], HI_R_BIT4(qh0, 2 * j));
                        W[4 * j + 1] = _mm_or_si128(W[4 * j + 1], HI_R_BIT4(qh1, 2 * j));
                        W[4 * j + 2] = _mm_or_si128(W[4 * j + 2], HI_R_BIT4(qh0, 2 * j + 1));
                        W[4 * j + 3] = _mm_or_si128(W[4 * j + 3], HI_R_BIT4(qh1, 2 * j + 1));
#undef HI_R_BIT4
                    }
                }
            }
            HI_UNROLL for (int g = 0; g < HI_KG; g++) {
                if (g >= cnt) break;
                const hi_q8Kz *y = &ys[g][i + u];
                __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
                HI_UNROLL for (int j = 0; j < 4; j++) {
                    const __m128i scl = _mm_shuffle_epi32(sc16, j * 0x55);
                    if (kind == HI_K4_Q4P) {
                        const int8_t *q4 = y->q4 + 64 * j;
                        const __m128i pl = _mm_add_epi16(_mm_maddubs_epi16(W[4 * j], _mm_loadu_si128((const __m128i *)q4)),
                                                         _mm_maddubs_epi16(W[4 * j + 1], _mm_loadu_si128((const __m128i *)(q4 + 16))));
                        const __m128i ph = _mm_add_epi16(_mm_maddubs_epi16(W[4 * j + 2], _mm_loadu_si128((const __m128i *)(q4 + 32))),
                                                         _mm_maddubs_epi16(W[4 * j + 3], _mm_loadu_si128((const __m128i *)(q4 + 48))));
                        lo = _mm_add_epi32(lo, _mm_madd_epi16(pl, scl));
                        hi = _mm_add_epi32(hi, _mm_madd_epi16(ph, scl));
                    } else {
                        hi_kq_k4_step_sse(&W[4 * j], y->qs + 64 * j, scl, &lo, &hi);
                    }
                }
                v[u][g] = hi_kq_k4_block_acc(dd, y, sm, lo, hi, &s0[g], &s1[g], &dmv[u][g]);
            }
        }
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            if (g >= cnt) break;
            sumf[g] = nbk == 2 ? hi_kq_k4_min2(sumf[g], v[0][g], v[1][g], dmv[0][g], dmv[1][g])
                               : hi_kq_gen_sub(sumf[g], dmv[0][g], hi_kq_hsum4_epi32(v[0][g]));
        }
    }
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= cnt) break;
        *os[g] = hi_kq_gen_end_ps(sumf[g], s0[g], s1[g]);
    }
}

/* Q6_K (hi_kq_dot_q6; packed: the rows repacked) for the group: each block's 8 groups of pair-order weights once */
HI_INLINE void hi_rows_q6_z(const int64_t nb, const uint8_t *restrict vx, const hi_q8Kz *const *ys, const int packed,
                            float *const *os, const int cnt) {
    const block_q6_K *restrict x = (const block_q6_K *)vx;
    __m128 s0[HI_KG], s1[HI_KG];
    HI_UNROLL for (int g = 0; g < HI_KG; g++) s0[g] = s1[g] = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m128i sclo = _mm_srai_epi16(_mm_unpacklo_epi8(sc8, sc8), 8);
        const __m128i schi = _mm_srai_epi16(_mm_unpackhi_epi8(sc8, sc8), 8);
        __m128i W[16]; /* group gr: W[2gr], W[2gr+1] */
        if (packed) {
            HI_UNROLL for (int k = 0; k < 4; k++) hi_kq_q6_unpack3((const uint8_t *)&x[i] + 48 * k, W + 4 * k);
        } else {
            HI_UNROLL for (int h = 0; h < 2; h++) {
                __m128i a[4], qh[2];
                hi_kq_q6_step_load(&x[i], h, a, qh);
                HI_UNROLL for (int k = 0; k < 4; k++) hi_kq_q6_group_raw(a, qh, k, W + 8 * h + 2 * k);
            }
        }
        const float dx = hi_kq_f16_tab[x[i].d];
        HI_UNROLL for (int g = 0; g < HI_KG; g++) {
            if (g >= cnt) break;
            const hi_q8Kz *y = &ys[g][i];
            __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
            HI_UNROLL for (int gr = 0; gr < 8; gr++) {
                const __m128i p0 = _mm_sub_epi16(_mm_maddubs_epi16(W[2 * gr], _mm_loadu_si128((const __m128i *)(y->q6 + 32 * gr))),
                                                 _mm_loadu_si128((const __m128i *)(y->o6 + 16 * gr)));
                const __m128i p1 = _mm_sub_epi16(_mm_maddubs_epi16(W[2 * gr + 1], _mm_loadu_si128((const __m128i *)(y->q6 + 32 * gr + 16))),
                                                 _mm_loadu_si128((const __m128i *)(y->o6 + 16 * gr + 8)));
                const __m128i sc = _mm_shuffle_epi32(gr < 4 ? sclo : schi, (gr & 3) * 0x55);
                lo = _mm_add_epi32(lo, _mm_madd_epi16(p0, sc));
                hi = _mm_add_epi32(hi, _mm_madd_epi16(p1, sc));
            }
            hi_kq_gen_acc_ps(&s0[g], &s1[g], _mm_set1_ps(dx * y->d), lo, hi);
        }
    }
    HI_UNROLL for (int g = 0; g < HI_KG; g++) {
        if (g >= cnt) break;
        *os[g] = hi_kq_gen_end_ps(0.0f, s0[g], s1[g]);
    }
}

/* The tiled kernel of a long row's chunks (the table's attn_fa_tiled): a part of kernels_body.h, included by it once
 * per ISA unit after kernels_fa.h, whose K dots, V conversion and scratch layout it shares. */
#ifndef HI_INLINE
#error "kernels_fa_tiled.h is a part of kernels_body.h; include that"
#endif

/* ---- a chunk of a long row (attn.c splits rows over more than HI_FA_SPLIT positions; their bits follow llama.cpp's
 * split decode, not its one pass, already): tiles of HI_FA_TILE positions, every score of a tile first (each K row
 * converted or dotted once for the m rows), then per row one rescale by the tile's maximum, the tile's exps in
 * vectors, and VKQ += sum_s p[s] V[s] over the tile with the accumulators a vector register block at a time (V
 * converted to float once a tile for the m rows, HI_FA_SLAB values of its rows at a time); VKQ in float for every V
 * type. Writes each row's partial
 * (M, S, VKQ). The operations depend only on the unit's ISA, the tile and the rows' values. */

/* p[0..n) <- expf(p - M) (a vector at a time where the unit has ggml's vector exp); returns their sum in order */
HI_INLINE float hi_fa_exps(float *p, int64_t n, float M) {
    int64_t s = 0;
#if defined(HI_VNNI)
    for (; s + 16 <= n; s += 16)
        _mm512_storeu_ps(p + s, hi_ggml_v_expf(_mm512_sub_ps(_mm512_loadu_ps(p + s), _mm512_set1_ps(M))));
#elif defined(HI_AVX2)
    for (; s + 8 <= n; s += 8)
        _mm256_storeu_ps(p + s, hi_ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(p + s), _mm256_set1_ps(M))));
#elif defined(HI_SSE_EXP)
    for (; s + 4 <= n; s += 4) _mm_storeu_ps(p + s, hi_ggml_v_expf4(_mm_sub_ps(_mm_loadu_ps(p + s), _mm_set1_ps(M))));
#endif
    for (; s < n; s++) p[s] = expf(p[s] - M);
    float sum = 0.0f;
    for (s = 0; s < n; s++) sum += p[s];
    return sum;
}

/* acc[0..w) = acc * ms + sum_j p[j ps] v[j] over a tile's n V rows (row j at v + j * vs floats), a block of
 * accumulators held in registers while the rows go by (w a multiple of 32) */
HI_INLINE void hi_fa_tile_pv(float *acc, float ms, const float *p, int64_t ps, const float *v, int64_t vs, int64_t n,
                             int64_t w) {
#if defined(HI_VNNI)
    for (int64_t e0 = 0; e0 < w; e0 += 64) {
        const __m512 m = _mm512_set1_ps(ms);
        __m512 r0 = _mm512_mul_ps(_mm512_loadu_ps(acc + e0), m), r1 = _mm512_mul_ps(_mm512_loadu_ps(acc + e0 + 16), m);
        __m512 r2, r3;
        const int wide = e0 + 64 <= w;
        r2 = wide ? _mm512_mul_ps(_mm512_loadu_ps(acc + e0 + 32), m) : _mm512_setzero_ps();
        r3 = wide ? _mm512_mul_ps(_mm512_loadu_ps(acc + e0 + 48), m) : _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const __m512 pj = _mm512_set1_ps(p[j * ps]);
            const float *vj = v + j * vs + e0;
            r0 = _mm512_fmadd_ps(_mm512_loadu_ps(vj), pj, r0);
            r1 = _mm512_fmadd_ps(_mm512_loadu_ps(vj + 16), pj, r1);
            if (wide) {
                r2 = _mm512_fmadd_ps(_mm512_loadu_ps(vj + 32), pj, r2);
                r3 = _mm512_fmadd_ps(_mm512_loadu_ps(vj + 48), pj, r3);
            }
        }
        _mm512_storeu_ps(acc + e0, r0);
        _mm512_storeu_ps(acc + e0 + 16, r1);
        if (wide) {
            _mm512_storeu_ps(acc + e0 + 32, r2);
            _mm512_storeu_ps(acc + e0 + 48, r3);
        }
    }
#elif defined(HI_AVX2)
    for (int64_t e0 = 0; e0 < w; e0 += 32) {
        const __m256 m = _mm256_set1_ps(ms);
        __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0), m), r1 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0 + 8), m);
        __m256 r2 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0 + 16), m), r3 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0 + 24), m);
        for (int64_t j = 0; j < n; j++) {
            const __m256 pj = _mm256_set1_ps(p[j * ps]);
            const float *vj = v + j * vs + e0;
            r0 = _mm256_fmadd_ps(_mm256_loadu_ps(vj), pj, r0);
            r1 = _mm256_fmadd_ps(_mm256_loadu_ps(vj + 8), pj, r1);
            r2 = _mm256_fmadd_ps(_mm256_loadu_ps(vj + 16), pj, r2);
            r3 = _mm256_fmadd_ps(_mm256_loadu_ps(vj + 24), pj, r3);
        }
        _mm256_storeu_ps(acc + e0, r0);
        _mm256_storeu_ps(acc + e0 + 8, r1);
        _mm256_storeu_ps(acc + e0 + 16, r2);
        _mm256_storeu_ps(acc + e0 + 24, r3);
    }
#else
    for (int64_t e0 = 0; e0 < w; e0 += 32) {
        float r[32];
        for (int e = 0; e < 32; e++) r[e] = acc[e0 + e] * ms;
        for (int64_t j = 0; j < n; j++)
            for (int e = 0; e < 32; e++) r[e] = r[e] + v[j * vs + e0 + e] * p[j * ps];
        for (int e = 0; e < 32; e++) acc[e0 + e] = r[e];
    }
#endif
}


#if defined(HI_AVX2)
/* hi_fa_tile_pv of four rows at once (row r's acc at acc + r * rs floats, its p of position j at p[8 j + r]): each
 * V vector loaded once for the four rows, a block of 16 values (32 on the AVX-512 unit) of each row held in
 * registers; every value takes the same operations in the same order as in hi_fa_tile_pv */
HI_INLINE void hi_fa_tile_pv4(float *acc, int64_t rs, const float *ms, const float *p, const float *v, int64_t vs,
                              int64_t n, int64_t w) {
#if defined(HI_VNNI)
    for (int64_t e0 = 0; e0 < w; e0 += 32) {
        __m512 r[4][2];
        for (int h = 0; h < 4; h++) {
            const __m512 m = _mm512_set1_ps(ms[h]);
            r[h][0] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * rs + e0), m);
            r[h][1] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * rs + e0 + 16), m);
        }
        for (int64_t j = 0; j < n; j++) {
            const __m512 v0 = _mm512_loadu_ps(v + j * vs + e0), v1 = _mm512_loadu_ps(v + j * vs + e0 + 16);
            for (int h = 0; h < 4; h++) {
                const __m512 pj = _mm512_set1_ps(p[8 * j + h]);
                r[h][0] = _mm512_fmadd_ps(v0, pj, r[h][0]);
                r[h][1] = _mm512_fmadd_ps(v1, pj, r[h][1]);
            }
        }
        for (int h = 0; h < 4; h++) {
            _mm512_storeu_ps(acc + h * rs + e0, r[h][0]);
            _mm512_storeu_ps(acc + h * rs + e0 + 16, r[h][1]);
        }
    }
#else
    for (int64_t e0 = 0; e0 < w; e0 += 16) {
        __m256 r[4][2];
        for (int h = 0; h < 4; h++) {
            const __m256 m = _mm256_set1_ps(ms[h]);
            r[h][0] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * rs + e0), m);
            r[h][1] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * rs + e0 + 8), m);
        }
        for (int64_t j = 0; j < n; j++) {
            const __m256 v0 = _mm256_loadu_ps(v + j * vs + e0), v1 = _mm256_loadu_ps(v + j * vs + e0 + 8);
            for (int h = 0; h < 4; h++) {
                const __m256 pj = _mm256_broadcast_ss(p + 8 * j + h);
                r[h][0] = _mm256_fmadd_ps(v0, pj, r[h][0]);
                r[h][1] = _mm256_fmadd_ps(v1, pj, r[h][1]);
            }
        }
        for (int h = 0; h < 4; h++) {
            _mm256_storeu_ps(acc + h * rs + e0, r[h][0]);
            _mm256_storeu_ps(acc + h * rs + e0 + 8, r[h][1]);
        }
    }
#endif
}
#endif

/* the softmax part of a tile for 8 rows whose scores of position j are sc[8 j .. 8 j + 8): each row's tile maximum, its
 * new running maximum M, ms = expf(M_old - M), the scores turned into expf(score - M) and S = S * ms + their sum in
 * order; lane l takes exactly hi_fa_exps' operations for row l (the vector exp for the positions it takes a vector
 * at a time there, libm's expf for the rest), so the rows are computed together in vectors across rows */
HI_INLINE void hi_fa_tile_softmax8(float *sc, int64_t n, float *M, float *S, float *ms) {
#if defined(HI_AVX2)
    __m256 mt = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j++) { /* sc > mt ? sc : mt, in order */
        const __m256 x = _mm256_loadu_ps(sc + 8 * j);
        mt = _mm256_blendv_ps(mt, x, _mm256_cmp_ps(x, mt, _CMP_GT_OQ));
    }
    const __m256 Mo = _mm256_loadu_ps(M), Mn = _mm256_blendv_ps(Mo, mt, _mm256_cmp_ps(mt, Mo, _CMP_GT_OQ));
    float d[8];
    _mm256_storeu_ps(d, _mm256_sub_ps(Mo, Mn));
    for (int l = 0; l < 8; l++) ms[l] = expf(d[l]);
#if defined(HI_VNNI)
    const int64_t nv = n & ~(int64_t)15; /* hi_fa_exps' 16-lane steps */
    for (int64_t j = 0; j < nv; j++) {
        const __m512 x = _mm512_sub_ps(_mm512_zextps256_ps512(_mm256_loadu_ps(sc + 8 * j)), _mm512_zextps256_ps512(Mn));
        _mm256_storeu_ps(sc + 8 * j, _mm512_castps512_ps256(hi_ggml_v_expf(x)));
    }
#else
    const int64_t nv = n & ~(int64_t)7;
    for (int64_t j = 0; j < nv; j++)
        _mm256_storeu_ps(sc + 8 * j, hi_ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(sc + 8 * j), Mn)));
#endif
    float mn[8];
    _mm256_storeu_ps(mn, Mn);
    for (int64_t j = nv; j < n; j++)
        for (int l = 0; l < 8; l++) sc[8 * j + l] = expf(sc[8 * j + l] - mn[l]);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) sum = _mm256_add_ps(sum, _mm256_loadu_ps(sc + 8 * j));
    _mm256_storeu_ps(S, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(S), _mm256_loadu_ps(ms)), sum));
    _mm256_storeu_ps(M, Mn);
#else
    for (int l = 0; l < 8; l++) { /* each row alone through hi_fa_exps */
        float p[HI_FA_TILE], mt = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            p[j] = sc[8 * j + l];
            mt = p[j] > mt ? p[j] : mt;
        }
        const float Mn = mt > M[l] ? mt : M[l];
        ms[l] = expf(M[l] - Mn);
        S[l] = S[l] * ms[l] + hi_fa_exps(p, n, Mn);
        M[l] = Mn;
        for (int64_t j = 0; j < n; j++) sc[8 * j + l] = p[j];
    }
#endif
}

/* bytes of a V row of type vt before its value e0 (a multiple of 32: a block boundary of every type) */
HI_INLINE int64_t hi_fa_v_off(const int vt, int64_t e0) {
    switch (vt) {
    case HI_T_F32: return 4 * e0;
    case HI_T_F16: return 2 * e0;
    case HI_T_Q8_0: return e0 / 32 * 34;
    case HI_T_LM3: return e0 / 32 * HI_LM3_BYTES;
    default: return e0 / 32 * 18; /* q4_0, lm4 */
    }
}

static void hi_attn_fa_tiled(const hi_attn *a, int64_t t, int64_t h0, int64_t m, int64_t s0, int64_t s1,
                             float *scratch, float *part, int64_t part_row) {
    const int64_t hd = a->hd, G = a->H / a->Hkv, nb = hd / 32, g = h0 / G, row = 3 * hd + 8, m8 = (m + 7) / 8 * 8;
    const int kt = a->k_type, vt = a->v_type;
    const int64_t kh = a->k_bytes / a->Hkv, vh = a->v_bytes / a->Hkv;
    float *sct = scratch + m * row, *vtile = sct + m8 * HI_FA_TILE, *k32 = vtile + HI_FA_TILE * HI_FA_SLAB;
    float *dyt = k32 + hd;
#if defined(HI_VNNI) /* kernels_fa_vnni.h's paired K dots and V converted in registers */
    float *pairs = dyt + m / 8 * 8 * nb;
    const int kpairs = kt == HI_T_Q8_0 || kt == HI_T_Q4_0, vconv = vt == HI_T_Q8_0 || vt == HI_T_Q4_0 || vt == HI_T_F16;
#else
    const int kpairs = 0;
#endif
    float M[HI_FA_MAXG], S[HI_FA_MAXG], ms[HI_FA_MAXG], xs[HI_FA_MAXG];
    /* per row: acc [hd] | qv [hd] | dy [nb] | corr [hd / 4]; then the tile's scores of 8 rows at a time, the 8 rows'
     * scores of a position together (the softmax steps go across rows in vectors) */
#define HI_T_ACC(i) (scratch + (i) * row)
#define HI_T_QV(i) ((uint8_t *)(scratch + (i) * row + hd))
#define HI_T_DY(i) (scratch + (i) * row + 2 * hd)
#define HI_T_CORR(i) ((int32_t *)(scratch + (i) * row + 2 * hd + nb))
#define HI_T_SC(i) (sct + ((i) / 8) * 8 * HI_FA_TILE + (i) % 8) /* position j at + 8 * j */
    for (int64_t i = 0; i < m8; i++) { /* rows m .. m8 - 1: lanes computed and never read */
        M[i] = -INFINITY;
        S[i] = 0.0f;
        if (i < m) {
            hi_fa_query(kt, a->q + t * a->q_row + (h0 + i) * hd, hd, HI_T_QV(i), HI_T_CORR(i), HI_T_DY(i));
            memset(HI_T_ACC(i), 0, sizeof(float) * (size_t)hd);
        }
    }
    memset(sct, 0, sizeof(float) * (size_t)(m8 * HI_FA_TILE));
    if ((kt == HI_T_Q8_0 || kt == HI_T_Q4_0) && !kpairs) hi_fa_dyt(HI_T_DY(0), row, m, nb, dyt);
#if defined(HI_VNNI)
    if (kpairs) hi_fa_pairs(HI_T_QV(0), HI_T_CORR(0), HI_T_DY(0), row, m, nb, pairs); /* instead of dyt */
#endif
    const uint8_t *kb = (const uint8_t *)a->k + g * kh, *vb = (const uint8_t *)a->v + g * vh;
    for (int64_t p0 = s0; p0 < s1; p0 += HI_FA_TILE) {
        const int64_t n = s1 - p0 < HI_FA_TILE ? s1 - p0 : HI_FA_TILE;
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *ks = kb + (p0 + j) * a->k_bytes;
            if (p0 + j + HI_FA_PF < s1) {
                hi_fa_prefetch(ks + HI_FA_PF * a->k_bytes, kh);
                hi_fa_prefetch(vb + (p0 + j + HI_FA_PF) * a->v_bytes, vh);
            }
#if defined(HI_VNNI)
            if (kpairs) { /* K's type a constant in each call */
                if (kt == HI_T_Q8_0)
                    hi_fa_dots_pairs(HI_T_Q8_0, ks, pairs, HI_T_QV(0), HI_T_CORR(0), HI_T_DY(0), row, m, nb, xs);
                else
                    hi_fa_dots_pairs(HI_T_Q4_0, ks, pairs, HI_T_QV(0), HI_T_CORR(0), HI_T_DY(0), row, m, nb, xs);
            } else
#endif
            {
                if (hi_is_lm(kt)) hi_fa_v_float(kt, ks, k32, hd);
                hi_fa_dots(kt, ks, k32, a->q + t * a->q_row + h0 * hd, HI_T_QV(0), HI_T_CORR(0), HI_T_DY(0), dyt, row,
                           m, hd, xs);
            }
            for (int64_t i = 0; i < m; i++) HI_T_SC(i)[8 * j] = xs[i] * a->scale;
        }
        for (int64_t i = 0; i < m; i += 8) hi_fa_tile_softmax8(HI_T_SC(i), n, M + i, S + i, ms + i);
        for (int64_t e0 = 0; e0 < hd; e0 += HI_FA_SLAB) {
            int64_t i = 0;
#if defined(HI_VNNI)
            if (vconv) { /* rows 8 and 4 at a time with V converted in registers (VT a constant in each call) */
                const uint8_t *v0 = vb + p0 * a->v_bytes + hi_fa_v_off(vt, e0);
#define HI_T_PVQ(VT)                                                                                                  \
    do {                                                                                                              \
        for (; i + 8 <= m; i += 8) hi_fa_tile_pvq(8, HI_T_ACC(i) + e0, row, ms + i, HI_T_SC(i), VT, v0, a->v_bytes, n); \
        for (; i + 4 <= m; i += 4) hi_fa_tile_pvq(4, HI_T_ACC(i) + e0, row, ms + i, HI_T_SC(i), VT, v0, a->v_bytes, n); \
    } while (0)
                if (vt == HI_T_Q8_0) HI_T_PVQ(HI_T_Q8_0);
                else if (vt == HI_T_Q4_0) HI_T_PVQ(HI_T_Q4_0);
                else HI_T_PVQ(HI_T_F16);
#undef HI_T_PVQ
                if (i == m) continue;
            }
#endif
            const float *vf = vtile;
            int64_t vs = HI_FA_SLAB;
            if (vt == HI_T_F32) { /* read in place */
                vf = (const float *)(vb + p0 * a->v_bytes) + e0;
                vs = a->v_bytes / 4;
            } else {
                for (int64_t j = 0; j < n; j++)
                    hi_fa_v_float(vt, vb + (p0 + j) * a->v_bytes + hi_fa_v_off(vt, e0), vtile + j * HI_FA_SLAB,
                                  HI_FA_SLAB);
            }
#if defined(HI_AVX2)
            for (; i + 4 <= m; i += 4) hi_fa_tile_pv4(HI_T_ACC(i) + e0, row, ms + i, HI_T_SC(i), vf, vs, n, HI_FA_SLAB);
#endif
            for (; i < m; i++) hi_fa_tile_pv(HI_T_ACC(i) + e0, ms[i], HI_T_SC(i), 8, vf, vs, n, HI_FA_SLAB);
        }
    }
    for (int64_t i = 0; i < m; i++) {
        float *pr = part + i * part_row;
        pr[0] = M[i];
        pr[1] = S[i];
        memcpy(pr + 2, HI_T_ACC(i), sizeof(float) * (size_t)hd);
    }
#undef HI_T_ACC
#undef HI_T_QV
#undef HI_T_DY
#undef HI_T_CORR
#undef HI_T_SC
}

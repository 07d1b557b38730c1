/* The vision tower's full attention in one pass (vattn.c drives it): for a block of query rows of one head, each
 * block of HI_VATTN_KB keys takes S = Q Kᵀ with the unit's float block kernel (kernels_gemm.h) on K packed into its
 * panels, then per row an online softmax (running maximum M and sum L of its exps, its accumulator rescaled by
 * exp(M_old - M) when M grows), then O += P V with the same kernel on V packed as panels over head_dim; the rows
 * go by gemm_mr at a time so a strip of scores stays in L1, and the key block's K and V stay in L2 across the
 * task's rows. A part of kernels_body.h (after kernels_attn.h, whose ggml_v_expf it takes, and kernels_gemm.h);
 * the AVX2 and AVX-512 units have it, the others leave it NULL (the tower then keeps its numpy path).
 *
 * A row's operations depend only on its own values, the unit and HI_VATTN_KB: not on the rows beside it in its
 * block (the block kernel sums each row alone) nor on the split over threads. */
#ifndef HI_INLINE
#error "kernels_vattn.h is a part of kernels_body.h; include that"
#endif

#if HI_GEMM_NR
/* the largest of s[0..n) * scale */
HI_INLINE float hi_vattn_max(const float *s, int64_t n, float scale) {
    int64_t j = 0;
    float m = -INFINITY;
#if defined(HI_VNNI)
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_mul_ps(_mm512_loadu_ps(s + j), sc));
    if (j < n) {
        const __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        mv = _mm512_mask_max_ps(mv, k, mv, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), sc));
        j = n;
    }
    m = _mm512_reduce_max_ps(mv);
#else
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_mul_ps(_mm256_loadu_ps(s + j), sc));
    float t[8];
    _mm256_storeu_ps(t, mv);
    for (int i = 0; i < 8; i++) m = t[i] > m ? t[i] : m;
#endif
    for (; j < n; j++) m = s[j] * scale > m ? s[j] * scale : m;
    return m;
}

/* s[0..n) <- exp(s * scale - m) (ggml's vector exp, the tail padded to a whole vector); returns their sum (lane
 * sums, then the lanes in a fixed order) */
HI_INLINE float hi_vattn_exps(float *s, int64_t n, float scale, float m) {
    int64_t j = 0;
#if defined(HI_VNNI)
    const __m512 sc = _mm512_set1_ps(scale), mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        const __m512 e = hi_ggml_v_expf(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, mv));
        _mm512_storeu_ps(s + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (j < n) {
        const __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = hi_ggml_v_expf(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), sc, mv));
        _mm512_mask_storeu_ps(s + j, k, e);
        acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
#else
    const __m256 sc = _mm256_set1_ps(scale), mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 e = hi_ggml_v_expf(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), sc, mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (j < n) {
        float t[8] = {0};
        memcpy(t, s + j, (size_t)(n - j) * sizeof(float));
        __m256 e = hi_ggml_v_expf(_mm256_fmsub_ps(_mm256_loadu_ps(t), sc, mv));
        _mm256_storeu_ps(t, e);
        for (int64_t i = n - j; i < 8; i++) t[i] = 0.0f;
        memcpy(s + j, t, (size_t)(n - j) * sizeof(float));
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(t));
    }
    float t[8];
    _mm256_storeu_ps(t, acc);
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
#endif
}

/* query rows [i0, i1) of head h of job a, with scratch of hi_vattn_scratch(i1 - i0, hd) floats */
static void hi_vattn_task(const hi_vattn *a, int64_t h, int64_t i0, int64_t i1, float *w) {
    const int64_t n = a->n, hd = a->hd, nr = HI_GEMM_NR, npv = (hd + nr - 1) / nr, hdp = npv * nr, rows = i1 - i0;
    float *S = w, *O = S + HI_GEMM_MR * HI_VATTN_KB, *M = O + rows * hdp, *L = M + rows;
    const float *q = a->q + (h * n + i0) * hd, *kp = a->kp + h * a->k_head, *vp = a->vp + h * a->v_head;
    const float scale = a->scale;
    for (int64_t j0 = 0; j0 < n; j0 += HI_VATTN_KB) {
        const int64_t kn = n - j0 < HI_VATTN_KB ? n - j0 : HI_VATTN_KB;
        for (int64_t r0 = 0; r0 < rows; r0 += HI_GEMM_MR) {
            const int64_t mr = rows - r0 < HI_GEMM_MR ? rows - r0 : HI_GEMM_MR;
            for (int64_t p = 0; p * nr < kn; p++)
                hi_gemm_block(q + r0 * hd, hd, kp + (j0 / nr + p) * hd * nr, hd, S + p * nr, HI_VATTN_KB, mr,
                              kn - p * nr < nr ? kn - p * nr : nr, 0);
            for (int64_t r = 0; r < mr; r++) {
                float *s = S + r * HI_VATTN_KB, *o = O + (r0 + r) * hdp;
                const float mx = hi_vattn_max(s, kn, scale);
                if (j0 == 0) {
                    M[r0 + r] = mx;
                    L[r0 + r] = hi_vattn_exps(s, kn, scale, mx);
                    continue;
                }
                const float mo = M[r0 + r], mn = mx > mo ? mx : mo;
                const float sum = hi_vattn_exps(s, kn, scale, mn);
                if (mn > mo) { /* a larger maximum: what the row holds so far shrinks by exp(M_old - M) */
                    const float alpha = expf(mo - mn);
                    for (int64_t c = 0; c < hdp; c++) o[c] *= alpha;
                    L[r0 + r] *= alpha;
                    M[r0 + r] = mn;
                }
                L[r0 + r] += sum;
            }
            for (int64_t p = 0; p < npv; p++)
                hi_gemm_block(S, HI_VATTN_KB, vp + (p * n + j0) * nr, kn, O + r0 * hdp + p * nr, hdp, mr, nr, j0 > 0);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *y = a->out + ((i0 + r) * a->nh + h) * hd;
        const float *o = O + r * hdp, l = L[r];
        for (int64_t c = 0; c < hd; c++) y[c] = o[c] / l;
    }
}
#endif

/* The vision tower's full attention in one pass (vattn.c drives it), worked transposed so that every step is the
 * unit's float block kernel (kernels_gemm.h) or whole vectors: for a group of query panels (gemm_nr rows each) of
 * one head, each block of HI_VATTN_KB keys takes Sᵀ = K Qᵀ (K's rows broadcast against the panel's packed Q), which
 * is already the packed right operand P of Oᵀ += Vᵀ P; between the two, an online softmax down P's columns (a query
 * row a lane: its running maximum M and sum L of exps, its column of Oᵀ rescaled by exp(M_old - M)), ggml's vector
 * exp, no horizontal sums. The panel's Q stays in L1 over every key block, and a block's K and V in L2 over the
 * group's panels. A part of kernels_body.h (after kernels_attn.h, whose ggml_v_expf it takes, and kernels_gemm.h);
 * the AVX2 and AVX-512 units have it (gemm_nr is two of their vectors), the others leave it NULL.
 *
 * A query row's operations depend only on its own values, the unit and HI_VATTN_KB: it is one lane of its panel's
 * vectors (the block kernel sums each output alone, keys in order), whatever rows share its panel or task. */
#ifndef HI_INLINE
#error "kernels_vattn.h is a part of kernels_body.h; include that"
#endif

#if HI_GEMM_NR
#if defined(HI_VNNI)
typedef __m512 hi_vv;
#define HI_VV 16
#define hi_vv_load _mm512_loadu_ps
#define hi_vv_store _mm512_storeu_ps
#define hi_vv_set1 _mm512_set1_ps
#define hi_vv_mul _mm512_mul_ps
#define hi_vv_add _mm512_add_ps
#define hi_vv_sub _mm512_sub_ps
#define hi_vv_max _mm512_max_ps
#define hi_vv_fmsub _mm512_fmsub_ps
#define hi_vv_fmadd _mm512_fmadd_ps
#else
typedef __m256 hi_vv;
#define HI_VV 8
#define hi_vv_load _mm256_loadu_ps
#define hi_vv_store _mm256_storeu_ps
#define hi_vv_set1 _mm256_set1_ps
#define hi_vv_mul _mm256_mul_ps
#define hi_vv_add _mm256_add_ps
#define hi_vv_sub _mm256_sub_ps
#define hi_vv_max _mm256_max_ps
#define hi_vv_fmsub _mm256_fmsub_ps
#define hi_vv_fmadd _mm256_fmadd_ps
#endif
#if HI_GEMM_NR != 2 * HI_VV
#error "kernels_vattn.h takes a panel's row of gemm_nr values as two vectors"
#endif

/* the online softmax of one panel over one block: P [kn][gemm_nr] scores in, exp(scale * s - M) out; M, L the
 * panel's running maxima and sums, O its Oᵀ [hd][gemm_nr] (first: the block is the row's first, nothing to rescale) */
HI_INLINE void hi_vattn_softmax(float *P, int64_t kn, float scale, float *M, float *L, float *O, int64_t hd,
                                int first) {
    const hi_vv sc = hi_vv_set1(scale);
    hi_vv m0 = hi_vv_set1(-INFINITY), m1 = m0;
    for (int64_t k = 0; k < kn; k++) {
        m0 = hi_vv_max(m0, hi_vv_mul(hi_vv_load(P + k * HI_GEMM_NR), sc));
        m1 = hi_vv_max(m1, hi_vv_mul(hi_vv_load(P + k * HI_GEMM_NR + HI_VV), sc));
    }
    hi_vv a0 = hi_vv_set1(0.0f), a1 = a0;
    if (!first) { /* a larger maximum: what the row holds so far shrinks by exp(M_old - M) (exp(0) = 1 exactly) */
        const hi_vv o0 = hi_vv_load(M), o1 = hi_vv_load(M + HI_VV);
        m0 = hi_vv_max(m0, o0);
        m1 = hi_vv_max(m1, o1);
        a0 = hi_ggml_v_expf(hi_vv_sub(o0, m0));
        a1 = hi_ggml_v_expf(hi_vv_sub(o1, m1));
        for (int64_t c = 0; c < hd; c++) {
            hi_vv_store(O + c * HI_GEMM_NR, hi_vv_mul(hi_vv_load(O + c * HI_GEMM_NR), a0));
            hi_vv_store(O + c * HI_GEMM_NR + HI_VV, hi_vv_mul(hi_vv_load(O + c * HI_GEMM_NR + HI_VV), a1));
        }
    }
    hi_vv s0 = hi_vv_set1(0.0f), s1 = s0;
    for (int64_t k = 0; k < kn; k++) {
        const hi_vv e0 = hi_ggml_v_expf(hi_vv_fmsub(hi_vv_load(P + k * HI_GEMM_NR), sc, m0));
        const hi_vv e1 = hi_ggml_v_expf(hi_vv_fmsub(hi_vv_load(P + k * HI_GEMM_NR + HI_VV), sc, m1));
        hi_vv_store(P + k * HI_GEMM_NR, e0);
        hi_vv_store(P + k * HI_GEMM_NR + HI_VV, e1);
        s0 = hi_vv_add(s0, e0);
        s1 = hi_vv_add(s1, e1);
    }
    hi_vv_store(M, m0);
    hi_vv_store(M + HI_VV, m1);
    hi_vv_store(L, first ? s0 : hi_vv_fmadd(hi_vv_load(L), a0, s0));
    hi_vv_store(L + HI_VV, first ? s1 : hi_vv_fmadd(hi_vv_load(L + HI_VV), a1, s1));
}

/* query panels [p0, p1) of head h of job a (rows p * gemm_nr ..), with gemm_nr * (HI_VATTN_KB + (p1 - p0) *
 * (hd + 2)) floats of scratch */
static void hi_vattn_task(const hi_vattn *a, int64_t h, int64_t p0, int64_t p1, float *w) {
    const int64_t n = a->n, hd = a->hd, nr = HI_GEMM_NR, mr = HI_GEMM_MR, np = p1 - p0;
    float *P = w, *O = P + HI_VATTN_KB * nr, *M = O + np * hd * nr, *L = M + np * nr;
    const float *k = a->k + h * n * hd, *vt = a->vt + h * hd * n;
    for (int64_t j0 = 0; j0 < n; j0 += HI_VATTN_KB) {
        const int64_t kn = n - j0 < HI_VATTN_KB ? n - j0 : HI_VATTN_KB;
        for (int64_t g = 0; g < np; g++) {
            const float *qp = a->qp + h * a->q_head + (p0 + g) * hd * nr;
            float *o = O + g * hd * nr;
            for (int64_t r = 0; r < kn; r += mr) /* Sᵀ = K Qᵀ: key rows r.. of the block against the panel */
                hi_gemm_block(k + (j0 + r) * hd, hd, qp, hd, P + r * nr, nr, kn - r < mr ? kn - r : mr, nr, 0);
            hi_vattn_softmax(P, kn, a->scale, M + g * nr, L + g * nr, o, hd, j0 == 0);
            for (int64_t c = 0; c < hd; c += mr) /* Oᵀ += Vᵀ P: value dims c.. over the block's keys */
                hi_gemm_block(vt + c * n + j0, n, P, kn, o + c * nr, nr, hd - c < mr ? hd - c : mr, nr, j0 > 0);
        }
    }
    for (int64_t g = 0; g < np; g++) {
        const int64_t i0 = (p0 + g) * nr, rows = n - i0 < nr ? n - i0 : nr;
        const float *o = O + g * hd * nr, *l = L + g * nr;
        for (int64_t i = 0; i < rows; i++) {
            float *y = a->out + ((i0 + i) * a->nh + h) * hd;
            for (int64_t c = 0; c < hd; c++) y[c] = o[c * nr + i] / l[i];
        }
    }
}
#endif

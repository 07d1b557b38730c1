/* Float products of many rows for the vision tower (gemm.c): a block of up to HI_GEMM_MR rows of X against one
 * packed panel of HI_GEMM_NR weight rows, the panel's values of one k together (hi_gemm_pack's layout), so a step
 * loads NR weights once and broadcasts each row's x into fused multiply-adds held in registers. A part of
 * kernels_body.h, included by it once per ISA unit; the AVX2 and AVX-512 units have it, the others leave it NULL
 * (the tower then keeps numpy's BLAS).
 *
 * Why our own: at 16 threads on the GPU machine's Xeon, the tower's products split into one-thread OpenBLAS calls
 * ran at 0.56-0.9 TFLOP/s where one such call alone runs at 0.16 (the calls do not scale side by side), and OpenBLAS's
 * own threads keep spinning after each call, slowing the tower's other kernels (2026-11-28). Each output sums its k
 * in order within a block of HI_GEMM_KC and the blocks in order, the same on both units. */
#ifndef HI_INLINE
#error "kernels_gemm.h is a part of kernels_body.h; include that"
#endif

#if defined(HI_VNNI)
#define HI_GEMM_MR 12
#define HI_GEMM_NR 32
/* y[r][0..nc) (+)= sum_k x[r][k] p[k][0..nc) for r < mr over k < kc (x rows xs floats apart, y rows ys) */
static void hi_gemm_block(const float *x, int64_t xs, const float *p, int64_t kc, float *y, int64_t ys, int64_t mr,
                          int64_t nc, int acc) {
    __m512 c0[HI_GEMM_MR], c1[HI_GEMM_MR];
    const float *xr[HI_GEMM_MR];
    for (int r = 0; r < HI_GEMM_MR; r++) { /* rows past mr repeat the last one and are not stored */
        c0[r] = c1[r] = _mm512_setzero_ps();
        xr[r] = x + (r < mr ? r : mr - 1) * xs;
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_loadu_ps(p + HI_GEMM_NR * k), b1 = _mm512_loadu_ps(p + HI_GEMM_NR * k + 16);
        for (int r = 0; r < HI_GEMM_MR; r++) {
            const __m512 a = _mm512_set1_ps(xr[r][k]);
            c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
        }
    }
    const __mmask16 m0 = nc >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1);
    const __mmask16 m1 = nc >= 32 ? (__mmask16)0xFFFF : nc > 16 ? (__mmask16)((1u << (nc - 16)) - 1) : 0;
#pragma GCC unroll 16
    for (int r = 0; r < HI_GEMM_MR; r++) { /* constant indexes: the sums stay in registers through the k loop */
        if (r >= mr) break;
        float *yr = y + r * ys;
        if (acc) {
            c0[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, yr), c0[r]);
            c1[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, yr + 16), c1[r]);
        }
        _mm512_mask_storeu_ps(yr, m0, c0[r]);
        _mm512_mask_storeu_ps(yr + 16, m1, c1[r]);
    }
}
#elif defined(HI_AVX2)
#define HI_GEMM_MR 6
#define HI_GEMM_NR 16
/* the sums in named variables: as an array of vectors gcc stored them to the stack every step (a third the speed) */
#define HI_GEMM_ROW(r)                                                                                                \
    do {                                                                                                              \
        const __m256 a = _mm256_broadcast_ss(x##r + k);                                                               \
        s##r##0 = _mm256_fmadd_ps(a, b0, s##r##0);                                                                    \
        s##r##1 = _mm256_fmadd_ps(a, b1, s##r##1);                                                                    \
    } while (0)
#define HI_GEMM_OUT(r)                                                                                                \
    do {                                                                                                              \
        if (r < mr) {                                                                                                 \
            float *yr = y + r * ys;                                                                                   \
            if (acc) {                                                                                                \
                s##r##0 = _mm256_add_ps(_mm256_maskload_ps(yr, m0), s##r##0);                                         \
                s##r##1 = _mm256_add_ps(_mm256_maskload_ps(yr + 8, m1), s##r##1);                                     \
            }                                                                                                         \
            _mm256_maskstore_ps(yr, m0, s##r##0);                                                                     \
            _mm256_maskstore_ps(yr + 8, m1, s##r##1);                                                                 \
        }                                                                                                             \
    } while (0)
static void hi_gemm_block(const float *x, int64_t xs, const float *p, int64_t kc, float *y, int64_t ys, int64_t mr,
                          int64_t nc, int acc) {
    const float *x0 = x, *x1 = x + (mr > 1 ? 1 : 0) * xs, *x2 = x + (mr > 2 ? 2 : mr - 1) * xs;
    const float *x3 = x + (mr > 3 ? 3 : mr - 1) * xs, *x4 = x + (mr > 4 ? 4 : mr - 1) * xs;
    const float *x5 = x + (mr > 5 ? 5 : mr - 1) * xs;
    __m256 s00 = _mm256_setzero_ps(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
    __m256 s40 = s00, s41 = s00, s50 = s00, s51 = s00;
    for (int64_t k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(p + HI_GEMM_NR * k), b1 = _mm256_loadu_ps(p + HI_GEMM_NR * k + 8);
        HI_GEMM_ROW(0);
        HI_GEMM_ROW(1);
        HI_GEMM_ROW(2);
        HI_GEMM_ROW(3);
        HI_GEMM_ROW(4);
        HI_GEMM_ROW(5);
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nc), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nc - 8), lane);
    HI_GEMM_OUT(0);
    HI_GEMM_OUT(1);
    HI_GEMM_OUT(2);
    HI_GEMM_OUT(3);
    HI_GEMM_OUT(4);
    HI_GEMM_OUT(5);
}
#undef HI_GEMM_ROW
#undef HI_GEMM_OUT
#else
#define HI_GEMM_MR 0
#define HI_GEMM_NR 0
#endif

/* hi_gemm: Y[M, N] = X[M, K] W^T for the vision tower's float matrices, W packed once (hi_gemm_pack) into panels of
 * the unit's gemm_nr rows, on the context's pool; the unit's block kernel in kernels_gemm.h. A unit without one
 * (gemm_nr 0: scalar, SSSE3) reports a packed size of 0 and the caller keeps its BLAS. */

#include <stdlib.h>

#include "hi_internal.h"
#include "hi_simd.h"

/* values of k a block takes at a time: its X rows (gemm_mr x 256 floats) stay in L1 while the task's panels
 * (256 x gemm_nr floats each) go by, and the panels stay in L2 across the task's rows */
#define HI_GEMM_KC 256
#define HI_GEMM_PANELS 2   /* panels a task */
#define HI_GEMM_MBLOCKS 8  /* row blocks a task, at most: fewer where that leaves under HI_GEMM_TASKS tasks a thread */
#define HI_GEMM_TASKS 4

int64_t hi_gemm_packed_floats(const hi_ctx *c, int64_t N, int64_t K) {
    if (!c || N < 1 || K < 1) return -2;
    const int64_t nr = hi_ctx_kernels(c)->gemm_nr;
    return nr ? (N + nr - 1) / nr * K * nr : 0;
}

int hi_gemm_pack(const hi_ctx *c, const float *W, int64_t w_row, int64_t N, int64_t K, int kn, float *P) {
    if (!c || !W || !P || N < 1 || K < 1 || w_row < (kn ? N : K)) return -2;
    const int64_t nr = hi_ctx_kernels(c)->gemm_nr;
    if (!nr) return -3;
    /* W[n][k] at W + n * sn + k * sk: rows of W, or (kn) rows of Wᵀ, a matmul's right operand */
    const int64_t sn = kn ? 1 : w_row, sk = kn ? w_row : 1;
    for (int64_t p = 0; p < (N + nr - 1) / nr; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < nr; j++) {
                const int64_t n = p * nr + j;
                P[(p * K + k) * nr + j] = n < N ? W[n * sn + k * sk] : 0.0f;
            }
    return 0;
}

typedef struct {
    const hi_kernels *k;
    const float *X, *P, *bias, *R;
    float *Y;
    int64_t xs, ys, rs, M, N, K, mtasks, rows;
} gemm_job;

static void gemm_task(void *arg, int64_t t) {
    const gemm_job *j = (const gemm_job *)arg;
    const int64_t nr = j->k->gemm_nr, mr = j->k->gemm_mr, np = (j->N + nr - 1) / nr, rows = j->rows;
    const int64_t p0 = t / j->mtasks * HI_GEMM_PANELS, p1 = p0 + HI_GEMM_PANELS < np ? p0 + HI_GEMM_PANELS : np;
    const int64_t m0 = t % j->mtasks * rows, m1 = m0 + rows < j->M ? m0 + rows : j->M;
    for (int64_t k0 = 0; k0 < j->K; k0 += HI_GEMM_KC) {
        const int64_t kc = j->K - k0 < HI_GEMM_KC ? j->K - k0 : HI_GEMM_KC;
        for (int64_t i = m0; i < m1; i += mr)
            for (int64_t p = p0; p < p1; p++) {
                const int64_t nc = j->N - p * nr < nr ? j->N - p * nr : nr;
                float *y = j->Y + i * j->ys + p * nr;
                const int64_t rows_here = m1 - i < mr ? m1 - i : mr;
                j->k->gemm_block(j->X + i * j->xs + k0, j->xs, j->P + (p * j->K + k0) * nr, kc, y, j->ys, rows_here,
                                 nc, k0 > 0);
                if (k0 + kc < j->K) continue;
                /* the block's sums are final and still in L1 */
                if (j->bias)
                    for (int64_t r = 0; r < rows_here; r++)
                        for (int64_t q = 0; q < nc; q++) y[r * j->ys + q] += j->bias[p * nr + q];
                if (j->R) {
                    const float *res = j->R + i * j->rs + p * nr;
                    for (int64_t r = 0; r < rows_here; r++)
                        for (int64_t q = 0; q < nc; q++) y[r * j->ys + q] = res[r * j->rs + q] + y[r * j->ys + q];
                }
            }
    }
}

int hi_gemm(hi_ctx *c, const float *X, int64_t x_row, const float *P, int64_t N, int64_t K, float *Y, int64_t y_row,
            int64_t M, const float *bias, const float *R, int64_t r_row) {
    if (!c || !X || !P || !Y || M < 1 || N < 1 || K < 1 || x_row < K || y_row < N || (R && r_row < N)) return -2;
    const hi_kernels *k = hi_ctx_kernels(c);
    if (!k->gemm_nr || !k->gemm_block) return -3;
    const int64_t np = (N + k->gemm_nr - 1) / k->gemm_nr, groups = (np + HI_GEMM_PANELS - 1) / HI_GEMM_PANELS;
    const int64_t blocks = (M + k->gemm_mr - 1) / k->gemm_mr, want = (int64_t)HI_GEMM_TASKS * hi_ctx_threads(c);
    /* a narrow product (the attention's v: 72 columns, 2 panel groups) would leave threads idle at 8 row blocks a
     * task; each output is the same sum in the same order whatever the split */
    int64_t mb = HI_GEMM_MBLOCKS;
    while (mb > 1 && groups * ((blocks + mb - 1) / mb) < want) mb /= 2;
    const int64_t rows = k->gemm_mr * mb;
    gemm_job j = {k, X, P, bias, R, Y, x_row, y_row, r_row, M, N, K, (M + rows - 1) / rows, rows};
    const int64_t tasks = groups * j.mtasks;
    hi_ctx_lock(c);
    if (tasks == 1) gemm_task(&j, 0);
    else hi_ctx_run(c, gemm_task, &j, tasks);
    hi_ctx_unlock(c);
    return 0;
}

/* hi_vision_attention: the vision tower's full attention, every head, in one call on the context's pool: each
 * head's Q packed into the unit's float-product panels and its V transposed, a task a head and operand; then tasks of (head, group of query panels) run the unit's fused kernel
 * (kernels_vattn.h), each thread in its own slice of the caller's workspace. No score buffer: a panel's scores of a
 * block of keys live in L1. A unit without float products (scalar, SSSE3) reports a workspace of 0 and the caller
 * keeps its own path. */

#include <math.h>

#include "hi_internal.h"
#include "hi_pool.h"
#include "hi_simd.h"

#define HI_VATTN_GROUP 4 /* query panels a task at most: a key block's K and V, read from L2, serve them all */
#define HI_VATTN_TASKS 4 /* tasks a thread, at least, where smaller groups give that many */

typedef struct {
    int64_t q_head, v_head, thread; /* floats: a head's packed Q; its Vᵀ; one thread's scratch */
} vattn_sizes;

static int vattn_sizes_of(const hi_kernels *k, int64_t n, int64_t hd, vattn_sizes *z) {
    const int64_t nr = k->gemm_nr;
    if (!nr || !k->vattn) return 0;
    z->q_head = (n + nr - 1) / nr * hd * nr;
    z->v_head = n * hd;
    z->thread = (nr * (HI_VATTN_KB + HI_VATTN_GROUP * (hd + 2)) + 15) / 16 * 16; /* 64-byte slices */
    return 1;
}

/* the heads' Vᵀ, then their packed Q, then the threads' scratch */
int64_t hi_vision_attention_floats(const hi_ctx *c, int64_t n, int64_t nh, int64_t hd) {
    if (!c || n < 1 || nh < 1 || hd < 1) return -2;
    vattn_sizes z;
    if (!vattn_sizes_of(hi_ctx_kernels(c), n, hd, &z)) return 0;
    return nh * (z.v_head + z.q_head) + hi_ctx_threads(c) * z.thread;
}

typedef struct {
    const hi_ctx *c;
    hi_vattn a;
    const float *q, *v;
    float *vt, *qp, *scratch;
    vattn_sizes z;
    int64_t panels, group, groups;
} vattn_job;

/* dst[j][i] = src[i][j] for src [rows, cols] */
static void vattn_transpose(const float *src, int64_t rows, int64_t cols, float *dst) {
    for (int64_t i0 = 0; i0 < rows; i0 += 16)
        for (int64_t j = 0; j < cols; j++)
            for (int64_t i = i0; i < rows && i < i0 + 16; i++) dst[j * rows + i] = src[i * cols + j];
}

static void vattn_pack_task(void *arg, int64_t t) {
    const vattn_job *j = (const vattn_job *)arg;
    const int64_t h = t / 2, n = j->a.n, hd = j->a.hd;
    if (t % 2 == 0) /* Q [n, hd] in panels of the unit's gemm_nr rows over hd */
        hi_gemm_pack(j->c, j->q + h * n * hd, hd, n, hd, 0, j->qp + h * j->z.q_head);
    else /* Vᵀ [hd, n]: the left operand's rows of Oᵀ += Vᵀ P (K's rows, as given, are those of Sᵀ = K Qᵀ) */
        vattn_transpose(j->v + h * n * hd, n, hd, j->vt + h * n * hd);
}

static void vattn_task(void *arg, int64_t t) {
    const vattn_job *j = (const vattn_job *)arg;
    const int64_t h = t / j->groups, p0 = t % j->groups * j->group;
    const int64_t p1 = p0 + j->group < j->panels ? p0 + j->group : j->panels;
    hi_ctx_kernels(j->c)->vattn(&j->a, h, p0, p1, j->scratch + (int64_t)hi_pool_tls_tid * j->z.thread);
}

int hi_vision_attention(hi_ctx *c, const float *q, const float *k, const float *v, int64_t n, int64_t nh, int64_t hd,
                        float scale, float *out, float *ws, int64_t ws_len) {
    if (!c || !q || !k || !v || !out || !ws || n < 1 || nh < 1 || hd < 1 || !isfinite(scale)) return -2;
    const hi_kernels *kern = hi_ctx_kernels(c);
    vattn_job j = {.c = c, .q = q, .v = v};
    if (!vattn_sizes_of(kern, n, hd, &j.z)) return -3;
    if (ws_len < hi_vision_attention_floats(c, n, nh, hd)) return -2;
    j.vt = ws;
    j.qp = j.vt + nh * j.z.v_head;
    j.scratch = j.qp + nh * j.z.q_head;
    j.a = (hi_vattn){j.qp, k, j.vt, out, n, nh, hd, j.z.q_head, scale};
    /* the split never changes a row's bits: fewer panels a task where that gives every thread several */
    j.panels = (n + kern->gemm_nr - 1) / kern->gemm_nr;
    j.group = HI_VATTN_GROUP;
    while (j.group > 1 && nh * ((j.panels + j.group - 1) / j.group) < HI_VATTN_TASKS * hi_ctx_threads(c)) j.group /= 2;
    j.groups = (j.panels + j.group - 1) / j.group;
    hi_ctx_lock(c);
    hi_ctx_run(c, vattn_pack_task, &j, 2 * nh);
    hi_ctx_run(c, vattn_task, &j, nh * j.groups);
    hi_ctx_unlock(c);
    return 0;
}

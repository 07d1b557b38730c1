/* hi_vision_attention: the vision tower's full attention, every head, in one call on the context's pool: K and V
 * of each head packed into the unit's float-product panels (a task a head and operand), then tasks of (head, block
 * of query rows) run the unit's fused kernel (kernels_vattn.h), each thread in its own slice of the caller's
 * workspace. No score buffer: the scores of a strip of rows and a block of keys live in L1. A unit without float
 * products (scalar, SSSE3) reports a workspace of 0 and the caller keeps its own path. */

#include <math.h>

#include "hi_internal.h"
#include "hi_pool.h"
#include "hi_simd.h"

#define HI_VATTN_ROWS 4 /* gemm_mr row strips a task: the key block's K and V, read from L2, serve this many */

typedef struct {
    int64_t k_head, v_head, thread; /* floats: a head's packed K, packed V; one thread's scratch */
    int64_t rows;                   /* query rows a task */
} vattn_sizes;

static int vattn_sizes_of(const hi_kernels *k, int64_t n, int64_t hd, vattn_sizes *z) {
    const int64_t nr = k->gemm_nr;
    if (!nr || !k->vattn) return 0;
    const int64_t hdp = (hd + nr - 1) / nr * nr;
    z->rows = (int64_t)k->gemm_mr * HI_VATTN_ROWS;
    z->k_head = (n + nr - 1) / nr * hd * nr;
    z->v_head = n * hdp;
    z->thread = ((int64_t)k->gemm_mr * HI_VATTN_KB + z->rows * (hdp + 2) + 15) / 16 * 16; /* 64-byte slices */
    return 1;
}

int64_t hi_vision_attention_floats(const hi_ctx *c, int64_t n, int64_t nh, int64_t hd) {
    if (!c || n < 1 || nh < 1 || hd < 1) return -2;
    vattn_sizes z;
    if (!vattn_sizes_of(hi_ctx_kernels(c), n, hd, &z)) return 0;
    return nh * (z.k_head + z.v_head) + hi_ctx_threads(c) * z.thread;
}

typedef struct {
    const hi_ctx *c;
    hi_vattn a;
    const float *k, *v;
    int kt;
    vattn_sizes z;
    float *scratch;
    int64_t blocks;
} vattn_job;

static void vattn_pack_task(void *arg, int64_t t) {
    const vattn_job *j = (const vattn_job *)arg;
    const int64_t h = t / 2, n = j->a.n, hd = j->a.hd;
    if (t % 2 == 0) /* K [n, hd] as a product's W (or given as Kᵀ [hd, n]): panels of keys over hd */
        hi_gemm_pack(j->c, j->k + h * n * hd, j->kt ? n : hd, n, hd, j->kt, (float *)j->a.kp + h * j->z.k_head);
    else /* V [n, hd] as Wᵀ: panels over hd, k over the keys */
        hi_gemm_pack(j->c, j->v + h * n * hd, hd, hd, n, 1, (float *)j->a.vp + h * j->z.v_head);
}

static void vattn_task(void *arg, int64_t t) {
    const vattn_job *j = (const vattn_job *)arg;
    const int64_t h = t / j->blocks, i0 = t % j->blocks * j->z.rows;
    const int64_t i1 = i0 + j->z.rows < j->a.n ? i0 + j->z.rows : j->a.n;
    hi_ctx_kernels(j->c)->vattn(&j->a, h, i0, i1, j->scratch + (int64_t)hi_pool_tls_tid * j->z.thread);
}

int hi_vision_attention(hi_ctx *c, const float *q, const float *k, int kt, const float *v, int64_t n, int64_t nh,
                        int64_t hd, float scale, float *out, float *ws, int64_t ws_len) {
    if (!c || !q || !k || !v || !out || !ws || n < 1 || nh < 1 || hd < 1 || !isfinite(scale)) return -2;
    const hi_kernels *kern = hi_ctx_kernels(c);
    vattn_job j = {.c = c, .k = k, .v = v, .kt = kt != 0};
    if (!vattn_sizes_of(kern, n, hd, &j.z)) return -3;
    if (ws_len < hi_vision_attention_floats(c, n, nh, hd)) return -2;
    j.a = (hi_vattn){q, ws, ws + nh * j.z.k_head, out, n, nh, hd, j.z.k_head, j.z.v_head, scale};
    j.scratch = ws + nh * (j.z.k_head + j.z.v_head);
    j.blocks = (n + j.z.rows - 1) / j.z.rows;
    hi_ctx_lock(c);
    hi_ctx_run(c, vattn_pack_task, &j, 2 * nh);
    hi_ctx_run(c, vattn_task, &j, nh * j.blocks);
    hi_ctx_unlock(c);
    return 0;
}

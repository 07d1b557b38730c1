/* The CPU vision tower's row ops (hybridinfer/backends/cpu/vision.py) on the context's pool: LayerNorm, the tanh
 * and erf GELUs and the rotary layout, the C twins of the numba kernels in backends/cpu/vision_kernels.py and their
 * bits. Those ran on a Python thread pool whose dispatch (a future a thread, submitted one by one) cost 0.5-1 ms a
 * call on 16 threads, above the ops' own work; hi_ctx_run hands a call to the same threads in ~11 us.
 *
 * The loops are plain float C (vrows_body.h), compiled three times: baseline x86-64, AVX2 and AVX-512F, picked by
 * the context's unit. Without FMA contraction or fast-math every copy computes the same operations in the same
 * order, so the bits do not depend on the unit or on the split over threads. No allocation. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "hi_internal.h"
#include "hi_simd.h"

/* The exp clamp's selects are if-converted (and the GELU's loop vectorized) only where gcc may assume floating-point
 * exceptions are not observed: a select's value is the same either way, only the exception flags could differ */
#pragma GCC optimize("no-trapping-math")

/* chunks a thread, so that a thread the machine holds back takes fewer; each chunk at least HI_VR_MIN_ROWS rows
 * (a row is 1152 floats or more in the tower: a chunk is then tens of microseconds, well above the pool's
 * hand-over) */
#define HI_VR_TASKS 4
#define HI_VR_MIN_ROWS 16

/* np.float32(math.sqrt(2 / math.pi)) as numba rounds it: the double, then to float */
#define VR_GELU_C 0x1.988454p-1f

typedef struct {
    const float *x, *w, *b;
    float *out;
    int64_t x_row, out_row, n;
    double eps;
} vr_ln_job;

typedef struct {
    const float *x, *bias;
    float *out;
    int64_t x_row, out_row, n;
} vr_gelu_job;

typedef struct {
    const float *qkv, *cos, *sin;
    float *qh, *k, *vh;
    int64_t rows, heads, hd;
    int k_t;
} vr_rope_job;

#define VR(name) name##_base
#include "vrows_body.h"
#undef VR

#pragma GCC push_options
#pragma GCC target("avx2")
#define VR(name) name##_avx2
#include "vrows_body.h"
#undef VR
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,avx512f")
#define VR(name) name##_avx512
#include "vrows_body.h"
#undef VR
#pragma GCC pop_options

typedef void (*vr_fn)(const void *job, int64_t r0, int64_t r1);

/* the copy of an op for the context's unit */
#define VR_PICK(c, name) \
    (hi_ctx_kernels(c)->isa >= HI_ISA_AVX512VNNI ? name##_avx512 \
     : hi_ctx_kernels(c)->isa >= HI_ISA_AVX2     ? name##_avx2   \
                                                 : name##_base)

typedef struct {
    vr_fn fn;
    const void *job;
    int64_t rows, per;
} vr_task;

static void vr_chunk(void *arg, int64_t i) {
    const vr_task *t = (const vr_task *)arg;
    const int64_t r0 = i * t->per, r1 = r0 + t->per < t->rows ? r0 + t->per : t->rows;
    t->fn(t->job, r0, r1);
}

/* fn over [0, rows) in chunks of whole rows on the pool (on the caller alone where there is one chunk) */
static void vr_run(hi_ctx *c, vr_fn fn, const void *job, int64_t rows) {
    const int64_t threads = hi_ctx_threads(c);
    int64_t chunks = (rows + HI_VR_MIN_ROWS - 1) / HI_VR_MIN_ROWS;
    if (chunks > HI_VR_TASKS * threads) chunks = HI_VR_TASKS * threads;
    const int64_t per = (rows + chunks - 1) / chunks;
    vr_task t = {fn, job, rows, per};
    hi_ctx_lock(c);
    if (threads == 1 || per >= rows) fn(job, 0, rows);
    else hi_ctx_run(c, vr_chunk, &t, (rows + per - 1) / per);
    hi_ctx_unlock(c);
}

int hi_vrows_layer_norm(hi_ctx *c, const float *x, int64_t x_row, int64_t rows, int64_t n, const float *w,
                        const float *b, double eps, float *out, int64_t out_row) {
    if (!c || !x || !w || !b || !out || rows < 1 || n < 1 || x_row < n || out_row < n) return -2;
    vr_ln_job j = {x, w, b, out, x_row, out_row, n, eps};
    vr_run(c, VR_PICK(c, layer_norm_rows), &j, rows);
    return 0;
}

int hi_vrows_gelu(hi_ctx *c, int erf_kind, const float *x, int64_t x_row, int64_t rows, int64_t n,
                  const float *bias, float *out, int64_t out_row) {
    if (!c || !x || !out || rows < 1 || n < 1 || x_row < n || out_row < n || (erf_kind != 0 && erf_kind != 1))
        return -2;
    vr_gelu_job j = {x, bias, out, x_row, out_row, n};
    vr_run(c, erf_kind ? VR_PICK(c, gelu_erf_rows) : VR_PICK(c, gelu_tanh_rows), &j, rows);
    return 0;
}

int hi_vrows_rope_heads(hi_ctx *c, const float *qkv, const float *cos, const float *sin, int64_t rows, int64_t heads,
                        int64_t hd, float *qh, float *k, int k_transposed, float *vh) {
    if (!c || !qkv || !cos || !sin || !qh || !k || !vh || rows < 1 || heads < 1 || hd < 2 || hd % 2) return -2;
    vr_rope_job j = {qkv, cos, sin, qh, k, vh, rows, heads, hd, k_transposed != 0};
    vr_run(c, VR_PICK(c, rope_heads_rows), &j, rows);
    return 0;
}

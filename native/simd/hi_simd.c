/* The library's entry points: CPU detection, the persistent thread pool, and the drivers that split a
 * matrix product (or the k experts of a MoE layer) into row chunks for the pool.
 *
 * No arithmetic of the results happens here (kernels_body.h has the maths); this file only decides which
 * rows each thread computes. Rows are independent, so the result does not depend on the thread count.
 *
 * Thread pool: n-1 workers created once per context (no thread creation per call). A call publishes a
 * task of `total` chunks and bumps a generation counter; idle workers spin (pause) for spin_us after
 * their last task, then sleep on a condition variable. Every thread, the caller included, claims chunks
 * by a compare-and-swap on one (task id, next chunk) word, and the caller returns once every chunk is
 * done: a worker the OS has not scheduled yet is not waited for, and when it runs it finds the task over.
 * Compiled for the baseline target: it calls the per-ISA tables, it holds no SIMD code.
 */
#define _GNU_SOURCE
#include "hi_simd.h"

#include <cpuid.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "hi_internal.h"

/* ================================================================================================ */
/* CPU detection (cpuid + xgetbv: the CPU has the instructions and the OS saves their registers) */

static uint64_t hi_xgetbv0(void) {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static int hi_detect(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return HI_ISA_SCALAR;
    const int ssse3 = (c >> 9) & 1, fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1,
              f16c = (c >> 29) & 1;
    int level = ssse3 ? HI_ISA_SSSE3 : HI_ISA_SCALAR;
    if (!osxsave || !avx) return level;
    const uint64_t xcr0 = hi_xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return level; /* xmm, ymm state */
    if (__get_cpuid_max(0, NULL) < 7) return level;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1,
              vnni = (c >> 11) & 1;
    if (!(avx2 && fma && f16c)) return level;
    level = HI_ISA_AVX2;
    if (avx512f && avx512bw && avx512vl && vnni && (xcr0 & 0xe6) == 0xe6) level = HI_ISA_AVX512VNNI;
    return level;
}

static int hi_level = -1;

int hi_best_isa(void) {
    if (hi_level < 0) hi_level = hi_detect();
    return hi_level;
}

int hi_isa_supported(int isa) { return isa >= 0 && isa < HI_N_ISA && isa <= hi_best_isa(); }

static const hi_kernels *const hi_tables[HI_N_ISA] = {&hi_kernels_scalar, &hi_kernels_ssse3, &hi_kernels_avx2,
                                                      &hi_kernels_avx512vnni};

const char *hi_isa_name(int isa) { return isa >= 0 && isa < HI_N_ISA ? hi_tables[isa]->name : "?"; }

/* ================================================================================================ */
/* types */

int hi_act_kind(int qtype) {
    switch (qtype) {
    case HI_T_F32: return HI_ACT_F32;
    case HI_T_F16: return HI_ACT_F16;
    case HI_T_Q4_0: case HI_T_Q5_0: case HI_T_Q8_0: return HI_ACT_Q8_0;
    case HI_T_Q4_1: case HI_T_Q5_1: return HI_ACT_Q8_1;
    case HI_T_Q4_K: case HI_T_Q5_K: case HI_T_Q6_K: return HI_ACT_Q8_K;
    default: return HI_ACT_NONE;
    }
}

static int hi_is_legacy(int qtype) {
    return qtype == HI_T_Q4_0 || qtype == HI_T_Q4_1 || qtype == HI_T_Q5_0 || qtype == HI_T_Q5_1 ||
           qtype == HI_T_Q8_0;
}

int64_t hi_act_row_bytes(int qtype, int64_t n) {
    if (n <= 0) return -1;
    switch (hi_act_kind(qtype)) {
    case HI_ACT_F32: return 4 * n;
    case HI_ACT_F16: return 2 * n;
    case HI_ACT_Q8_0: return n % 32 ? -1 : n / 32 * (int64_t)sizeof(block_q8_0);
    case HI_ACT_Q8_1: return n % 32 ? -1 : n / 32 * (int64_t)sizeof(block_q8_1);
    case HI_ACT_Q8_K: return n % 256 ? -1 : n / 256 * (int64_t)sizeof(block_q8_K);
    default: return -1;
    }
}

int64_t hi_weight_row_bytes(int qtype, int64_t n) {
    if (n <= 0) return -1;
    int qk, bs;
    switch (qtype) {
    case HI_T_F32: return 4 * n;
    case HI_T_F16: return 2 * n;
    case HI_T_Q4_0: qk = 32; bs = sizeof(block_q4_0); break;
    case HI_T_Q4_1: qk = 32; bs = sizeof(block_q4_1); break;
    case HI_T_Q5_0: qk = 32; bs = sizeof(block_q5_0); break;
    case HI_T_Q5_1: qk = 32; bs = sizeof(block_q5_1); break;
    case HI_T_Q8_0: qk = 32; bs = sizeof(block_q8_0); break;
    case HI_T_Q4_K: qk = 256; bs = sizeof(block_q4_K); break;
    case HI_T_Q5_K: qk = 256; bs = sizeof(block_q5_K); break;
    case HI_T_Q6_K: qk = 256; bs = sizeof(block_q6_K); break;
    default: return -1;
    }
    return n % qk ? -1 : n / qk * (int64_t)bs;
}

/* ================================================================================================ */
/* thread pool */

/* a task is `total` chunks; chunk i runs fn(arg, i) on whichever thread claims it */
typedef void (*hi_chunk_fn)(void *arg, int64_t chunk);

typedef struct hi_pool hi_pool;
typedef struct {
    hi_pool *pool;
    int tid;
} hi_warg;

struct hi_pool {
    int n; /* threads, the caller included */
    int started;
    pthread_t *th;
    hi_warg *wargs;
    /* wake-up: workers wait for gen to change (spin, then sleep on cv) */
    atomic_uint gen;
    atomic_int n_sleeping;
    atomic_int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the current task: (task id << 32) | next unclaimed chunk; a chunk is claimed by a CAS on this word,
     * so a thread never runs a chunk of a task that has ended, and the caller waits only for `done` */
    _Atomic uint64_t state;
    _Atomic(hi_chunk_fn) fn;
    _Atomic(void *) arg;
    atomic_uint total;
    atomic_uint done;
    uint32_t task_id;
    int64_t spin_ns;
    pid_t pid;
};

static inline void hi_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t hi_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* claim and run chunks of the current task until none is left */
static void hi_pool_work(hi_pool *p) {
    for (;;) {
        uint64_t cur = atomic_load_explicit(&p->state, memory_order_acquire);
        const uint32_t i = (uint32_t)cur;
        const hi_chunk_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
        void *arg = atomic_load_explicit(&p->arg, memory_order_relaxed);
        const uint32_t total = atomic_load_explicit(&p->total, memory_order_relaxed);
        if (i >= total || !fn) return;
        /* success means chunk i of this very task was still free, so the task is live and fn/arg are its own
         * (the caller rewrites them only after every chunk is done) */
        if (!atomic_compare_exchange_weak_explicit(&p->state, &cur, cur + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        fn(arg, (int64_t)i);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

static void *hi_worker(void *v) {
    hi_warg *wa = (hi_warg *)v;
    hi_pool *p = wa->pool;
    unsigned seen = 0;
    for (;;) {
        unsigned g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g == seen) {
            const int64_t t0 = hi_now_ns();
            for (unsigned k = 1;; k++) {
                hi_relax();
                g = atomic_load_explicit(&p->gen, memory_order_acquire);
                if (g != seen) break;
                if ((k & 63) == 0 && hi_now_ns() - t0 > p->spin_ns) break;
            }
            if (g == seen) {
                pthread_mutex_lock(&p->mu);
                atomic_fetch_add(&p->n_sleeping, 1);
                while ((g = atomic_load(&p->gen)) == seen) pthread_cond_wait(&p->cv, &p->mu);
                atomic_fetch_sub(&p->n_sleeping, 1);
                pthread_mutex_unlock(&p->mu);
            }
        }
        seen = g;
        if (atomic_load(&p->stop)) break;
        hi_pool_work(p);
    }
    return NULL;
}

static int hi_pool_start(hi_pool *p) {
    atomic_store(&p->gen, 0);
    atomic_store(&p->n_sleeping, 0);
    atomic_store(&p->stop, 0);
    atomic_store(&p->state, 0);
    atomic_store(&p->fn, NULL);
    atomic_store(&p->arg, NULL);
    atomic_store(&p->total, 0);
    atomic_store(&p->done, 0);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->pid = getpid();
    p->started = 0;
    for (int i = 1; i < p->n; i++) {
        p->wargs[i].pool = p;
        p->wargs[i].tid = i;
        if (pthread_create(&p->th[i], NULL, hi_worker, &p->wargs[i]) != 0) return -1;
        p->started = i;
    }
    return 0;
}

static void hi_pool_stop(hi_pool *p) {
    if (p->started > 0) {
        atomic_store(&p->stop, 1);
        pthread_mutex_lock(&p->mu);
        atomic_fetch_add(&p->gen, 1);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (int i = 1; i <= p->started; i++) pthread_join(p->th[i], NULL);
    }
    p->started = 0;
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
}

static hi_pool *hi_pool_new(int n, int spin_us) {
    hi_pool *p = (hi_pool *)calloc(1, sizeof(hi_pool));
    if (!p) return NULL;
    p->n = n;
    p->spin_ns = (int64_t)(spin_us < 0 ? 0 : spin_us) * 1000;
    p->th = (pthread_t *)calloc((size_t)n, sizeof(pthread_t));
    p->wargs = (hi_warg *)calloc((size_t)n, sizeof(hi_warg));
    if (!p->th || !p->wargs || hi_pool_start(p) != 0) {
        if (p->th && p->wargs) hi_pool_stop(p);
        free(p->th);
        free(p->wargs);
        free(p);
        return NULL;
    }
    return p;
}

static void hi_pool_free(hi_pool *p) {
    if (!p) return;
    if (p->pid == getpid()) hi_pool_stop(p);
    free(p->th);
    free(p->wargs);
    free(p);
}

/* run fn(arg, i) for i < total on the pool and the caller; returns when every chunk is done (workers
 * that wake up late find nothing left and are not waited for) */
static void hi_pool_run(hi_pool *p, hi_chunk_fn fn, void *arg, int64_t total) {
    if (total <= 0) return;
    if (p->n == 1 || total == 1 || total >= (int64_t)UINT32_MAX) {
        for (int64_t i = 0; i < total; i++) fn(arg, i);
        return;
    }
    if (p->pid != getpid() && hi_pool_start(p) != 0) { /* forked child: the workers stayed in the parent */
        for (int64_t i = 0; i < total; i++) fn(arg, i);
        return;
    }
    /* publish: first a state whose next chunk exceeds any total, so that a thread still holding the old
     * state fails its CAS and a thread reading the new fields meanwhile finds nothing to claim; then the
     * fields; then the real state (release: whoever acquires it sees the fields) */
    p->task_id++;
    atomic_store_explicit(&p->state, ((uint64_t)p->task_id << 32) | UINT32_MAX, memory_order_seq_cst);
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->arg, arg, memory_order_relaxed);
    atomic_store_explicit(&p->total, (uint32_t)total, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->state, (uint64_t)p->task_id << 32, memory_order_release);
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->n_sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    hi_pool_work(p);
    for (unsigned k = 0; atomic_load_explicit(&p->done, memory_order_acquire) < (uint32_t)total; k++) {
        if (k < 4096) hi_relax();
        else sched_yield();
    }
}

/* ================================================================================================ */
/* context */

struct hi_ctx {
    const hi_kernels *k;
    hi_pool *pool;
    pthread_mutex_t mu;
    uint8_t *scratch;
    size_t scratch_cap;
};

hi_ctx *hi_ctx_new(int isa, int n_threads, int spin_us) {
    if (isa < 0) isa = hi_best_isa();
    if (!hi_isa_supported(isa) || n_threads < 1 || n_threads > 4096) return NULL;
    hi_ctx *c = (hi_ctx *)calloc(1, sizeof(hi_ctx));
    if (!c) return NULL;
    c->k = hi_tables[isa];
    c->pool = hi_pool_new(n_threads, spin_us);
    if (!c->pool) {
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    return c;
}

void hi_ctx_free(hi_ctx *c) {
    if (!c) return;
    hi_pool_free(c->pool);
    pthread_mutex_destroy(&c->mu);
    free(c->scratch);
    free(c);
}

int hi_ctx_isa(const hi_ctx *c) { return c->k->isa; }
int hi_ctx_threads(const hi_ctx *c) { return c->pool->n; }

static uint8_t *hi_scratch(hi_ctx *c, size_t n) {
    if (n > c->scratch_cap) {
        free(c->scratch);
        c->scratch = NULL;
        c->scratch_cap = 0;
        void *p = NULL;
        if (posix_memalign(&p, 64, n) != 0) return NULL;
        c->scratch = (uint8_t *)p;
        c->scratch_cap = n;
    }
    return c->scratch;
}

/* bytes of prepared data for T activation rows of nb blocks: corr (8 int32), dy, sy per block */
static size_t hi_prep_bytes(int64_t T, int64_t nb) { return (size_t)(T * nb) * (8 * sizeof(int32_t) + 2 * sizeof(float)); }

/* prepare T rows into scratch at `at`; sets m's corr/dy/sy for row 0 (rows follow at nb blocks) */
static void hi_prep_rows(const hi_kernels *k, int qtype, const uint8_t *xq, size_t xq_row, int64_t T, int64_t nb,
                         uint8_t *at, const int32_t **corr, const float **dy, const float **sy) {
    int32_t *cr = (int32_t *)at;
    float *d = (float *)(at + (size_t)(T * nb) * 8 * sizeof(int32_t));
    float *s = d + T * nb;
    const int need = k->needs_corr[qtype];
    for (int64_t t = 0; t < T; t++)
        k->prep(qtype, xq + (size_t)t * xq_row, nb, need ? cr + t * nb * 8 : NULL, d + t * nb, s + t * nb);
    *corr = need ? cr : NULL;
    *dy = d;
    *sy = s;
}

/* ---- batched products ---------------------------------------------------------------------------- */

typedef struct {
    const hi_kernels *k;
    const hi_mm *jobs;
    int njobs;
    int64_t chunk;
    int64_t *starts; /* njobs + 1 cumulative chunk counts */
} hi_batch;

static void hi_batch_chunk(void *a, int64_t i) {
    const hi_batch *b = (const hi_batch *)a;
    int lo = 0, hi = b->njobs - 1; /* the job j with starts[j] <= i < starts[j + 1] */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (b->starts[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    const hi_mm *m = &b->jobs[lo];
    const int64_t r0 = (i - b->starts[lo]) * b->chunk;
    const int64_t r1 = r0 + b->chunk < m->rows ? r0 + b->chunk : m->rows;
    b->k->mm(m, r0, r1);
}

/* bytes of weights below which a call runs on the calling thread alone (waking the pool costs more) */
#define HI_INLINE_BYTES (96 << 10)

static void hi_run_jobs(hi_ctx *c, const hi_mm *jobs, int njobs, int64_t *starts) {
    int64_t total_rows = 0, T = 1, bytes = 0;
    for (int j = 0; j < njobs; j++) {
        total_rows += jobs[j].rows;
        bytes += jobs[j].rows * (int64_t)jobs[j].w_row * jobs[j].T;
        if (jobs[j].T > T) T = jobs[j].T;
    }
    const int nth = bytes < HI_INLINE_BYTES ? 1 : c->pool->n;
    /* about 8 chunks per thread for balance; for several tokens at most 64 rows, so that a chunk's weight
     * rows stay in cache while the token blocks sweep over them */
    int64_t chunk = (total_rows + 8 * nth - 1) / (8 * nth);
    if (T > 1 && chunk > 64) chunk = 64;
    if (chunk < 4) chunk = 4;
    chunk = (chunk + 3) & ~(int64_t)3;
    starts[0] = 0;
    for (int j = 0; j < njobs; j++) starts[j + 1] = starts[j] + (jobs[j].rows + chunk - 1) / chunk;
    hi_batch b = {.k = c->k, .jobs = jobs, .njobs = njobs, .chunk = chunk, .starts = starts};
    if (nth == 1) {
        for (int64_t i = 0; i < starts[njobs]; i++) hi_batch_chunk(&b, i);
    } else {
        hi_pool_run(c->pool, hi_batch_chunk, &b, starts[njobs]);
    }
}

static int hi_check_type(int qtype, int64_t cols) {
    if (hi_act_kind(qtype) == HI_ACT_NONE) return -1;
    if (hi_weight_row_bytes(qtype, cols) < 0) return -2;
    if (cols > INT32_MAX) return -2;
    return 0;
}

int hi_matmul(hi_ctx *c, int qtype, const void *w, int64_t rows, int64_t cols, const void *xq, int64_t xq_row,
              int64_t T, float *out, int64_t out_row) {
    int e = hi_check_type(qtype, cols);
    if (e) return e;
    if (rows < 1 || T < 1 || !w || !xq || !out) return -2;
    if (T > 1 && (xq_row < hi_act_row_bytes(qtype, cols) || out_row < rows)) return -2;
    hi_mm m = {.qtype = qtype, .w = (const uint8_t *)w, .w_row = (size_t)hi_weight_row_bytes(qtype, cols),
               .rows = rows, .cols = cols, .x = (const uint8_t *)xq, .x_row = (size_t)xq_row, .T = T,
               .out = out, .out_row = (size_t)out_row};
    pthread_mutex_lock(&c->mu);
    if (hi_is_legacy(qtype)) {
        const int64_t nb = cols / 32;
        uint8_t *s = hi_scratch(c, hi_prep_bytes(T, nb));
        if (!s) {
            pthread_mutex_unlock(&c->mu);
            return -3;
        }
        hi_prep_rows(c->k, qtype, m.x, m.x_row, T, nb, s, &m.corr, &m.dy, &m.sy);
    }
    int64_t starts[2];
    hi_run_jobs(c, &m, 1, starts);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

#define HI_MAX_K 64

int hi_matmul_many(hi_ctx *c, int n, const int *qtypes, const void *const *ws, const int64_t *rows, int64_t cols,
                   const void *xq, int64_t xq_row, int64_t T, float *const *outs, const int64_t *out_rows) {
    if (n < 1 || n > HI_MAX_K || T < 1 || !xq) return -2;
    const int kind = hi_act_kind(qtypes[0]);
    for (int j = 0; j < n; j++) {
        const int e = hi_check_type(qtypes[j], cols);
        if (e) return e;
        if (hi_act_kind(qtypes[j]) != kind || rows[j] < 1 || !ws[j] || !outs[j]) return -2;
        if (T > 1 && out_rows[j] < rows[j]) return -2;
    }
    if (T > 1 && xq_row < hi_act_row_bytes(qtypes[0], cols)) return -2;
    hi_mm jobs[HI_MAX_K];
    int64_t starts[HI_MAX_K + 1];
    pthread_mutex_lock(&c->mu);
    const int64_t nb = cols / 32;
    const size_t pb = hi_prep_bytes(T, nb);
    uint8_t *s = NULL;
    if (hi_is_legacy(qtypes[0])) {
        s = hi_scratch(c, (size_t)n * pb);
        if (!s) {
            pthread_mutex_unlock(&c->mu);
            return -3;
        }
    }
    for (int j = 0; j < n; j++) {
        hi_mm m = {.qtype = qtypes[j], .w = (const uint8_t *)ws[j], .w_row = (size_t)hi_weight_row_bytes(qtypes[j], cols),
                   .rows = rows[j], .cols = cols, .x = (const uint8_t *)xq, .x_row = (size_t)xq_row, .T = T,
                   .out = outs[j], .out_row = (size_t)out_rows[j]};
        if (s) {
            /* one preparation per weight type (the lane correction depends on it) */
            int same = -1;
            for (int i = 0; i < j && same < 0; i++)
                if (qtypes[i] == qtypes[j]) same = i;
            if (same >= 0) {
                m.corr = jobs[same].corr;
                m.dy = jobs[same].dy;
                m.sy = jobs[same].sy;
            } else {
                hi_prep_rows(c->k, qtypes[j], m.x, m.x_row, T, nb, s + (size_t)j * pb, &m.corr, &m.dy, &m.sy);
            }
        }
        jobs[j] = m;
    }
    hi_run_jobs(c, jobs, n, starts);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

int hi_moe_gate_up(hi_ctx *c, int gate_qtype, const void *wg, int up_qtype, const void *wu, int64_t n_expert,
                   int64_t rows, int64_t cols, const void *xq, const int32_t *ids, int k, float *gate_out,
                   int64_t gate_row, float *up_out, int64_t up_row) {
    int e = hi_check_type(gate_qtype, cols);
    if (!e) e = hi_check_type(up_qtype, cols);
    if (e) return e;
    if (hi_act_kind(gate_qtype) != hi_act_kind(up_qtype)) return -2;
    if (k < 1 || k > HI_MAX_K || rows < 1 || n_expert < 1 || gate_row < rows || up_row < rows) return -2;
    for (int i = 0; i < k; i++)
        if (ids[i] < 0 || ids[i] >= n_expert) return -2;
    const size_t grb = (size_t)hi_weight_row_bytes(gate_qtype, cols), urb = (size_t)hi_weight_row_bytes(up_qtype, cols);
    hi_mm jobs[2 * HI_MAX_K];
    int64_t starts[2 * HI_MAX_K + 1];
    pthread_mutex_lock(&c->mu);
    const int32_t *cg = NULL, *cu = NULL;
    const float *dg = NULL, *du = NULL, *sg = NULL, *su = NULL;
    const int64_t nb = cols / 32;
    const size_t pb = hi_prep_bytes(1, nb);
    if (hi_is_legacy(gate_qtype)) {
        uint8_t *s = hi_scratch(c, 2 * pb);
        if (!s) {
            pthread_mutex_unlock(&c->mu);
            return -3;
        }
        hi_prep_rows(c->k, gate_qtype, (const uint8_t *)xq, 0, 1, nb, s, &cg, &dg, &sg);
        hi_prep_rows(c->k, up_qtype, (const uint8_t *)xq, 0, 1, nb, s + pb, &cu, &du, &su);
    }
    for (int i = 0; i < k; i++) {
        const int64_t ex = ids[i];
        hi_mm g = {.qtype = gate_qtype, .w = (const uint8_t *)wg + (size_t)ex * (size_t)rows * grb, .w_row = grb,
                   .rows = rows, .cols = cols, .x = (const uint8_t *)xq, .x_row = 0, .T = 1,
                   .out = gate_out + (size_t)i * (size_t)gate_row, .out_row = 0, .corr = cg, .dy = dg, .sy = sg};
        hi_mm u = {.qtype = up_qtype, .w = (const uint8_t *)wu + (size_t)ex * (size_t)rows * urb, .w_row = urb,
                   .rows = rows, .cols = cols, .x = (const uint8_t *)xq, .x_row = 0, .T = 1,
                   .out = up_out + (size_t)i * (size_t)up_row, .out_row = 0, .corr = cu, .dy = du, .sy = su};
        jobs[2 * i] = g;
        jobs[2 * i + 1] = u;
    }
    hi_run_jobs(c, jobs, 2 * k, starts);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

int hi_moe_down(hi_ctx *c, int qtype, const void *w, int64_t n_expert, int64_t rows, int64_t cols, const void *xq,
                int64_t xq_row, const int32_t *ids, int k, float *out, int64_t out_row) {
    int e = hi_check_type(qtype, cols);
    if (e) return e;
    if (k < 1 || k > HI_MAX_K || rows < 1 || n_expert < 1 || out_row < rows ||
        xq_row < hi_act_row_bytes(qtype, cols))
        return -2;
    for (int i = 0; i < k; i++)
        if (ids[i] < 0 || ids[i] >= n_expert) return -2;
    const size_t rb = (size_t)hi_weight_row_bytes(qtype, cols);
    hi_mm jobs[HI_MAX_K];
    int64_t starts[HI_MAX_K + 1];
    pthread_mutex_lock(&c->mu);
    const int32_t *cr = NULL;
    const float *dy = NULL, *sy = NULL;
    const int64_t nb = cols / 32;
    if (hi_is_legacy(qtype)) {
        uint8_t *s = hi_scratch(c, hi_prep_bytes(k, nb));
        if (!s) {
            pthread_mutex_unlock(&c->mu);
            return -3;
        }
        hi_prep_rows(c->k, qtype, (const uint8_t *)xq, (size_t)xq_row, k, nb, s, &cr, &dy, &sy);
    }
    for (int i = 0; i < k; i++) {
        hi_mm m = {.qtype = qtype, .w = (const uint8_t *)w + (size_t)ids[i] * (size_t)rows * rb, .w_row = rb,
                   .rows = rows, .cols = cols, .x = (const uint8_t *)xq + (size_t)i * (size_t)xq_row, .x_row = 0,
                   .T = 1, .out = out + (size_t)i * (size_t)out_row, .out_row = 0,
                   .corr = cr ? cr + (size_t)i * nb * 8 : NULL, .dy = dy ? dy + i * nb : NULL,
                   .sy = sy ? sy + i * nb : NULL};
        jobs[i] = m;
    }
    hi_run_jobs(c, jobs, k, starts);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* ---- activation quantization --------------------------------------------------------------------- */

typedef struct {
    const hi_kernels *k;
    int kind;
    const float *x;
    size_t x_row;
    int64_t T, cols;
    uint8_t *out;
    size_t out_row;
} hi_qjob;

static void hi_quant_chunk(void *a, int64_t t) {
    const hi_qjob *q = (const hi_qjob *)a;
    q->k->quantize(q->kind, q->x + (size_t)t * q->x_row, q->cols, q->out + (size_t)t * q->out_row);
}

int hi_quantize(hi_ctx *c, int qtype, const float *x, int64_t x_row, int64_t T, int64_t cols, void *out,
                int64_t out_row) {
    const int kind = hi_act_kind(qtype);
    if (kind == HI_ACT_NONE) return -1;
    const int64_t rb = hi_act_row_bytes(qtype, cols);
    if (rb < 0 || T < 1 || !x || !out) return -2;
    if (T > 1 && (x_row < cols || out_row < rb)) return -2;
    hi_qjob q = {.k = c->k, .kind = kind, .x = x, .x_row = (size_t)x_row, .T = T, .cols = cols,
                 .out = (uint8_t *)out, .out_row = (size_t)out_row};
    pthread_mutex_lock(&c->mu);
    if (c->pool->n == 1 || T < 2 || T * cols < (1 << 15)) {
        for (int64_t t = 0; t < T; t++) hi_quant_chunk(&q, t);
    } else {
        hi_pool_run(c->pool, hi_quant_chunk, &q, T);
    }
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* ---- read bandwidth -------------------------------------------------------------------------------- */

typedef struct {
    const hi_kernels *k;
    uint8_t *buf;
    size_t slice;
    int touch;
    uint64_t sums[64];
} hi_bwjob;

static void hi_bw_chunk(void *a, int64_t i) {
    hi_bwjob *b = (hi_bwjob *)a;
    uint8_t *p = b->buf + (size_t)i * b->slice;
    if (b->touch) memset(p, (int)(i & 0x7f) + 1, b->slice);
    else b->sums[i & 63] += b->k->read_sum(p, b->slice);
}

double hi_read_bandwidth(hi_ctx *c, int64_t nbytes, int reps) {
    const int nth = c->pool->n;
    if (nbytes < (int64_t)(1 << 20) || reps < 1) return -1.0;
    size_t slice = (size_t)nbytes / (size_t)nth;
    slice &= ~(size_t)4095; /* whole pages: a multiple of the kernels' 256-byte step */
    if (slice == 0) return -1.0;
    const size_t total = slice * (size_t)nth;
    void *buf = NULL;
    if (posix_memalign(&buf, 2 << 20, total) != 0) return -1.0;
#ifdef MADV_HUGEPAGE
    madvise(buf, total, MADV_HUGEPAGE);
#endif
    hi_bwjob b = {.k = c->k, .buf = (uint8_t *)buf, .slice = slice, .touch = 1};
    pthread_mutex_lock(&c->mu);
    hi_pool_run(c->pool, hi_bw_chunk, &b, nth); /* first touch, a slice per thread */
    b.touch = 0;
    hi_pool_run(c->pool, hi_bw_chunk, &b, nth); /* warm-up pass */
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        const int64_t t0 = hi_now_ns();
        hi_pool_run(c->pool, hi_bw_chunk, &b, nth);
        const int64_t dt = hi_now_ns() - t0;
        const double bw = dt > 0 ? (double)total * 1e9 / (double)dt : 0.0;
        if (bw > best) best = bw;
    }
    pthread_mutex_unlock(&c->mu);
    uint64_t chk = 0;
    for (int i = 0; i < 64; i++) chk += b.sums[i];
    free(buf);
    /* the checksum keeps the reads alive; it is never 0 for a buffer of non-zero bytes */
    return chk == 0 ? -1.0 : best;
}

/* ================================================================================================ */
/* for the library's other drivers (gdn.c): the context's mutex and its pool */

void hi_ctx_lock(hi_ctx *c) { pthread_mutex_lock(&c->mu); }
void hi_ctx_unlock(hi_ctx *c) { pthread_mutex_unlock(&c->mu); }
void hi_ctx_run(hi_ctx *c, void (*fn)(void *arg, int64_t chunk), void *arg, int64_t total) {
    hi_pool_run(c->pool, fn, arg, total);
}

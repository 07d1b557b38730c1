/* The context: its kernel table (the ISA unit), thread pool, mutex, scratch and weight copies; its tuning; and the
 * pool and mutex as the library's other drivers (gdn.c, attn.c, ops.c) use them. hi_simd.c has the products. */
#define _GNU_SOURCE
#include "hi_simd.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "hi_ctx.h"

hi_ctx *hi_ctx_new(int isa, int n_threads, int spin_us) {
    if (isa < 0) isa = hi_best_isa();
    if (!hi_isa_supported(isa) || n_threads < 1 || n_threads > 4096) return NULL;
    hi_ctx *c = (hi_ctx *)calloc(1, sizeof(hi_ctx));
    if (!c) return NULL;
    c->k = hi_isa_table(isa);
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
    hi_reps_free(c->reps);
    free(c->scratch);
    free(c);
}

int hi_ctx_isa(const hi_ctx *c) { return c->k->isa; }
int hi_ctx_threads(const hi_ctx *c) { return hi_pool_size(c->pool); }

/* ---- tuning -------------------------------------------------------------------------------------- */

void hi_ctx_set_prefetch(hi_ctx *c, int bytes) { c->pf_bytes = bytes < 0 ? 0 : bytes; }
int hi_ctx_prefetch(const hi_ctx *c) { return c->pf_bytes; }

_Static_assert(sizeof(hi_pool_acc) == 7 * sizeof(double), "hi_pool_acc: 7 doubles");
void hi_ctx_pool_stats(hi_ctx *c, int on, double *out) {
    hi_pool_acc acc[2];
    pthread_mutex_lock(&c->mu);
    hi_pool_stats(c->pool, on, out ? acc : NULL);
    pthread_mutex_unlock(&c->mu);
    if (out) memcpy(out, acc, sizeof(acc));
}

/* ================================================================================================ */
/* for the library's other drivers (gdn.c): the context's mutex and its pool */

void hi_ctx_lock(hi_ctx *c) { pthread_mutex_lock(&c->mu); }
void hi_ctx_unlock(hi_ctx *c) { pthread_mutex_unlock(&c->mu); }
void hi_ctx_run(hi_ctx *c, void (*fn)(void *arg, int64_t chunk), void *arg, int64_t total) {
    hi_pool_run(c->pool, fn, arg, total);
}
const hi_kernels *hi_ctx_kernels(const hi_ctx *c) { return c->k; }
hi_pool *hi_ctx_pool(hi_ctx *c) { return c->pool; }
hi_reps **hi_ctx_reps(hi_ctx *c) { return &c->reps; }

typedef struct {
    void (*fn)(void *arg, int64_t t, int64_t e0, int64_t e1);
    void *arg;
    int64_t n, seg, per_row;
} hi_rows_job;

static void hi_rows_chunk(void *a, int64_t i) {
    const hi_rows_job *j = (const hi_rows_job *)a;
    const int64_t t = i / j->per_row, e0 = (i % j->per_row) * j->seg;
    j->fn(j->arg, t, e0, e0 + j->seg < j->n ? e0 + j->seg : j->n);
}

void hi_ctx_run_rows(hi_ctx *c, void (*fn)(void *arg, int64_t t, int64_t e0, int64_t e1), void *arg, int64_t T,
                     int64_t n, int64_t seg) {
    hi_rows_job j = {fn, arg, n, seg, (n + seg - 1) / seg};
    pthread_mutex_lock(&c->mu);
    if (T * n < 2 * seg || hi_pool_size(c->pool) == 1) {
        for (int64_t t = 0; t < T; t++) fn(arg, t, 0, n);
    } else {
        hi_pool_run(c->pool, hi_rows_chunk, &j, T * j.per_row);
    }
    pthread_mutex_unlock(&c->mu);
}

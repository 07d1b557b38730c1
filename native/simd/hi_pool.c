/* The persistent thread pool of a context (hi_pool.h has its interface).
 *
 * n-1 workers created once per context (no thread creation per call). A call publishes a task of `total`
 * chunks and bumps a generation counter; idle workers spin (pause) for spin_us after their last task, then
 * sleep on a condition variable. Every thread, the caller included, claims chunks by a compare-and-swap on
 * one (task id, next chunk) word, and the caller returns once every chunk is done: a worker the OS has not
 * scheduled yet is not waited for, and when it runs it finds the task over. A forked child, whose workers
 * stayed in the parent, starts its own on its first task. Compiled for the baseline target.
 */
#define _GNU_SOURCE
#include "hi_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ================================================================================================ */
/* thread pool */

typedef struct {
    hi_pool *pool;
    int tid;
} hi_warg;

/* fields written by different parties sit on separate cache lines: the task (written once per call, read by
 * every claim), the claim word (a CAS per chunk), the completion count (an add per chunk) and the wake-up */
#define HI_LINE _Alignas(64)

struct hi_pool {
    int n; /* threads, the caller included */
    int started;
    pthread_t *th;
    hi_warg *wargs;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t task_id;
    int64_t spin_ns;
    pid_t pid;
    /* wake-up: workers wait for gen to change (spin, then sleep on cv) */
    HI_LINE atomic_uint gen;
    atomic_int n_sleeping;
    atomic_int stop;
    /* the current task: (task id << 32) | next unclaimed chunk; a chunk is claimed by a CAS on this word,
     * so a thread never runs a chunk of a task that has ended, and the caller waits only for `done` */
    HI_LINE _Atomic uint64_t state;
    HI_LINE _Atomic(hi_chunk_fn) fn;
    _Atomic(void *) arg;
    atomic_uint total;
    HI_LINE atomic_uint done;
    char pad_[60];
};

static inline void hi_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

int64_t hi_now_ns(void) {
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

hi_pool *hi_pool_new(int n, int spin_us) {
    hi_pool *p = NULL;
    if (posix_memalign((void **)&p, 64, sizeof(hi_pool)) != 0) return NULL;
    memset(p, 0, sizeof(hi_pool));
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

void hi_pool_free(hi_pool *p) {
    if (!p) return;
    if (p->pid == getpid()) hi_pool_stop(p);
    free(p->th);
    free(p->wargs);
    free(p);
}

int hi_pool_size(const hi_pool *p) { return p->n; }

void hi_pool_run(hi_pool *p, hi_chunk_fn fn, void *arg, int64_t total) {
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

/* The persistent thread pool of a context (hi_pool.h has its interface).
 *
 * n-1 workers created once per context (no thread creation per call). A call publishes a task of `total`
 * chunks and bumps a generation counter; idle workers spin (pause) for spin_us after their last task, then
 * sleep on a condition variable. Every thread, the caller included, claims chunks by one fetch-and-add on a
 * word holding (task id, total, next chunk) - no compare-and-swap retries, which with 16 threads made a
 * task of 128 small chunks cost ~17 us - after a plain load finds some left, and when none is left it writes
 * the count of chunks it ran to its own cache line, which the caller sums. The caller returns once every
 * chunk is done: a worker the OS has not scheduled yet is
 * not waited for, and when it runs it finds the task over. A forked child, whose workers stayed in the parent,
 * starts its own on its first task. Compiled for the baseline target.
 * Measured on the 16-core host with hi_pool_stats: a decode product spends ~92% of its wall time in its chunks
 * (threads start ~1.4 us late on average, finish ~6 us apart); a reserved first chunk per thread and per-thread
 * queues with stealing each gave back at the end what they saved at the start, so the one claim word stays.
 * Placement (hi_pool_place, for per-node weight copies): each thread's replica index, which it copies into thread-local
 * storage when it enters a task so that a chunk learns it with one load, and optionally a worker's CPU set.
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

/* a thread's report of the chunks it ran of one task: `ran` is written before `task` (release), so a reader
 * that finds `task` equal to the task it waits for reads that task's count */
typedef struct {
    hi_pool *pool;
    int tid;
    _Alignas(64) _Atomic uint32_t ran;
    _Atomic uint64_t task;
    char pad_[48];
    /* stats (hi_pool_stats), on a line of their own: this thread's first chunk start, last chunk end, and the
     * chunks' time in the current task */
    _Alignas(64) int64_t t_first, t_last, busy;
    char pad2_[40];
} hi_warg;

/* fields written by different parties sit on separate cache lines: the claim word (an add per claim), the
 * task slots, the wake-up, each thread's report (hi_warg) */
#define HI_LINE _Alignas(64)

/* the claim word: task id (16 bits, selects the slot) | total chunks (24) | next unclaimed chunk (24); a
 * thread reads all three from its own fetch-and-add, so it never pairs a chunk with another task's total */
#define HI_NEXT_BITS 24
#define HI_MAX_CHUNKS ((1u << (HI_NEXT_BITS - 1)) - 1) /* next may pass total by one add per thread */

typedef struct {
    HI_LINE hi_chunk_fn fn;
    void *arg;
    uint64_t task; /* its number among the pool's tasks */
} hi_task;

struct hi_pool {
    int n; /* threads, the caller included */
    int started;
    pthread_t *th;
    hi_warg *wargs;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t task_id;
    int64_t spin_ns;
    pid_t pid;
    /* wake-up: workers wait for gen to change (spin, then sleep on cv) */
    HI_LINE atomic_uint gen;
    atomic_int n_sleeping;
    atomic_int stop;
    HI_LINE _Atomic uint64_t word;
    /* task id & 1: a task's slot is rewritten only two tasks later, when no thread can still be running
     * one of its chunks (each of them is reported before the task ends) */
    hi_task slot[2];
    _Atomic int stats;   /* hi_pool_stats: clock the chunks */
    hi_pool_acc acc[2];  /* small, big tasks */
    int *rep;            /* hi_pool_place: each thread's replica, -1 none */
    char pad_[64];
};

_Thread_local int hi_pool_tls_replica = -1, hi_pool_tls_tid = 0;

/* the calling thread takes its identity in p for the chunks it is about to run (w NULL: the caller) */
static inline void hi_pool_enter(const hi_pool *p, const hi_warg *w) {
    hi_pool_tls_tid = w ? w->tid : 0;
    hi_pool_tls_replica = p->rep[hi_pool_tls_tid];
}

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

/* claim and run chunks of the current task until none is left; returns how many this thread ran (and
 * writes that to its report, w, unless w is NULL: the caller) */
static uint32_t hi_pool_work(hi_pool *p, hi_warg *w) {
    const uint64_t m24 = (1u << HI_NEXT_BITS) - 1;
    uint32_t ran = 0, id = 0;
    hi_pool_enter(p, w);
    for (;;) {
        const uint64_t seen = atomic_load_explicit(&p->word, memory_order_relaxed);
        if ((seen & m24) >= ((seen >> HI_NEXT_BITS) & m24)) break; /* none left: no add */
        const uint64_t v = atomic_fetch_add_explicit(&p->word, 1, memory_order_acq_rel);
        const uint32_t i = (uint32_t)(v & m24), total = (uint32_t)((v >> HI_NEXT_BITS) & m24);
        if (i >= total) break;
        /* chunk i < total of task `id` is ours: that task cannot end before we report it, so its slot holds it */
        id = (uint32_t)(v >> (2 * HI_NEXT_BITS));
        const hi_task *t = &p->slot[id & 1];
        if (atomic_load_explicit(&p->stats, memory_order_relaxed)) {
            hi_warg *sw = w ? w : &p->wargs[0]; /* the caller's stats in the unused slot 0 */
            const int64_t tb = hi_now_ns();
            if (!sw->t_first) sw->t_first = tb;
            t->fn(t->arg, (int64_t)i);
            sw->t_last = hi_now_ns();
            sw->busy += sw->t_last - tb;
        } else {
            t->fn(t->arg, (int64_t)i);
        }
        ran++;
    }
    if (ran && w) {
        atomic_store_explicit(&w->ran, ran, memory_order_relaxed);
        atomic_store_explicit(&w->task, p->slot[id & 1].task, memory_order_release);
    }
    return ran;
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
        hi_pool_work(p, wa);
    }
    return NULL;
}

static int hi_pool_start(hi_pool *p) {
    atomic_store(&p->gen, 0);
    atomic_store(&p->n_sleeping, 0);
    atomic_store(&p->stop, 0);
    atomic_store(&p->word, 0); /* task 0 of 0 chunks */
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
    p->rep = (int *)malloc((size_t)n * sizeof(int));
    for (int i = 0; p->rep && i < n; i++) p->rep[i] = -1;
    if (posix_memalign((void **)&p->wargs, 64, (size_t)n * sizeof(hi_warg)) == 0)
        memset(p->wargs, 0, (size_t)n * sizeof(hi_warg));
    else
        p->wargs = NULL;
    if (!p->th || !p->wargs || !p->rep || hi_pool_start(p) != 0) {
        if (p->th && p->wargs && p->rep) hi_pool_stop(p);
        free(p->rep);
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
    free(p->rep);
    free(p->th);
    free(p->wargs);
    free(p);
}

int hi_pool_size(const hi_pool *p) { return p->n; }

typedef struct {
    hi_chunk_fn fn;
    void *arg;
    int64_t base;
} hi_offset;

static void hi_offset_chunk(void *a, int64_t i) {
    const hi_offset *o = (const hi_offset *)a;
    o->fn(o->arg, o->base + i);
}

/* adds the task that began at t0 (its threads' clocks reported with their counts) to the stats */
static void hi_pool_account(hi_pool *p, int64_t t0, uint32_t n) {
    const int64_t t1 = hi_now_ns();
    hi_pool_acc *a = &p->acc[n >= HI_POOL_BIG];
    int64_t smax = 0, ssum = 0, lmin = INT64_MAX, lmax = 0, busy = 0;
    int cnt = 0;
    for (int i = 0; i < p->n; i++) {
        hi_warg *w = &p->wargs[i];
        if (w->t_first) {
            const int64_t d = w->t_first - t0;
            smax = d > smax ? d : smax;
            ssum += d;
            lmin = w->t_last < lmin ? w->t_last : lmin;
            lmax = w->t_last > lmax ? w->t_last : lmax;
            busy += w->busy;
            cnt++;
        }
        w->t_first = w->t_last = w->busy = 0;
    }
    a->tasks += 1;
    a->chunks += n;
    a->wall_ns += (double)(t1 - t0);
    a->busy_ns += (double)busy / p->n;
    if (cnt) {
        a->start_ns += (double)ssum / cnt;
        a->start_max_ns += (double)smax;
        a->spread_ns += (double)(lmax - lmin);
    }
}

void hi_pool_stats(hi_pool *p, int on, hi_pool_acc *acc) {
    if (acc) {
        memcpy(acc, p->acc, sizeof(p->acc));
        memset(p->acc, 0, sizeof(p->acc));
    }
    for (int i = 0; i < p->n; i++) p->wargs[i].t_first = p->wargs[i].t_last = p->wargs[i].busy = 0;
    atomic_store_explicit(&p->stats, on != 0, memory_order_relaxed);
}

/* one task of n chunks (base > 0: chunks base.. of a larger one) */
static void hi_pool_task(hi_pool *p, hi_chunk_fn fn, void *arg, int64_t base, uint32_t n) {
    hi_offset off = {fn, arg, base};
    const int stats = atomic_load_explicit(&p->stats, memory_order_relaxed);
    const int64_t t0 = stats ? hi_now_ns() : 0;
    const uint64_t task = ++p->task_id;
    hi_task *t = &p->slot[task & 1];
    t->fn = base ? hi_offset_chunk : fn;
    t->arg = base ? (void *)&off : arg;
    t->task = task;
    const uint64_t id = task & 0xffffu;
    atomic_store_explicit(&p->word, (id << (2 * HI_NEXT_BITS)) | ((uint64_t)n << HI_NEXT_BITS), memory_order_release);
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->n_sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    const uint32_t mine = hi_pool_work(p, NULL);
    for (unsigned k = 0;; k++) {
        uint32_t done = mine;
        for (int i = 1; i < p->n; i++) {
            hi_warg *w = &p->wargs[i];
            if (atomic_load_explicit(&w->task, memory_order_acquire) == task)
                done += atomic_load_explicit(&w->ran, memory_order_relaxed);
        }
        if (done >= n) break;
        if (k < 4096) hi_relax();
        else sched_yield();
    }
    /* every chunk is reported: the threads' clocks (written before their reports) are final */
    if (stats) hi_pool_account(p, t0, n);
}

void hi_pool_run_here(hi_pool *p, hi_chunk_fn fn, void *arg, int64_t total) {
    hi_pool_enter(p, NULL);
    for (int64_t i = 0; i < total; i++) fn(arg, i);
}

void hi_pool_run(hi_pool *p, hi_chunk_fn fn, void *arg, int64_t total) {
    if (total <= 0) return;
    if (p->n == 1 || total == 1) {
        hi_pool_run_here(p, fn, arg, total);
        return;
    }
    if (p->pid != getpid() && hi_pool_start(p) != 0) { /* forked child: the workers stayed in the parent */
        hi_pool_run_here(p, fn, arg, total);
        return;
    }
    for (int64_t base = 0; base < total; base += HI_MAX_CHUNKS) {
        /* a task of more chunks than the word holds runs as several (no caller has that many) */
        const uint32_t n = (uint32_t)(total - base < HI_MAX_CHUNKS ? total - base : HI_MAX_CHUNKS);
        hi_pool_task(p, fn, arg, base, n);
    }
}

int hi_pool_place(hi_pool *p, int tid, int replica, const int *cpus, int ncpus) {
    if (tid < 0 || tid >= p->n || replica < -1 || ncpus < 0 || (ncpus && (!cpus || tid == 0))) return -2;
    if (ncpus) {
        int hi = 0;
        for (int i = 0; i < ncpus; i++) {
            if (cpus[i] < 0) return -2;
            hi = cpus[i] > hi ? cpus[i] : hi;
        }
        cpu_set_t *set = CPU_ALLOC((size_t)hi + 1);
        if (!set) return -4;
        const size_t sz = CPU_ALLOC_SIZE((size_t)hi + 1);
        CPU_ZERO_S(sz, set);
        for (int i = 0; i < ncpus; i++) CPU_SET_S((size_t)cpus[i], sz, set);
        /* a worker of a forked child not yet restarted has no thread here to pin */
        const int rc = tid <= p->started && p->pid == getpid() ? pthread_setaffinity_np(p->th[tid], sz, set) : 0;
        CPU_FREE(set);
        if (rc) return -4;
    }
    p->rep[tid] = replica;
    return 0;
}

int hi_pool_replica_of(const hi_pool *p, int tid) { return tid >= 0 && tid < p->n ? p->rep[tid] : -1; }

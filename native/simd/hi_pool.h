/* The persistent thread pool of a context (hi_pool.c): n threads, the caller included, run the chunks of
 * one task at a time. Internal to the library (hi_simd.c, through hi_ctx_run also gdn.c).
 */
#ifndef HI_POOL_H
#define HI_POOL_H

#include <stdint.h>

/* a task is `total` chunks; chunk i runs fn(arg, i) on whichever thread claims it */
typedef void (*hi_chunk_fn)(void *arg, int64_t chunk);

typedef struct hi_pool hi_pool;

/* n threads including the caller (n - 1 workers started now); idle workers spin spin_us, then sleep.
 * NULL if the threads or memory cannot be had. */
hi_pool *hi_pool_new(int n, int spin_us);
/* stops and joins the workers (in the process that started them), frees the pool; NULL is a no-op */
void hi_pool_free(hi_pool *p);
/* the thread count n, the caller included */
int hi_pool_size(const hi_pool *p);
/* run fn(arg, i) for i < total on the pool and the caller; returns when every chunk is done (workers
 * that wake up late find nothing left and are not waited for). One task at a time: the caller serializes. */
void hi_pool_run(hi_pool *p, hi_chunk_fn fn, void *arg, int64_t total);

/* Where a pooled task's wall time goes, summed over the tasks run while stats are on (hi_pool_stats):
 * the chunks' own time (busy: summed over the threads, divided by their count), how late each thread began its
 * first chunk after the task was published (start: mean over the threads that ran one; start_max: the latest),
 * and the time between the first and the last thread to finish its last chunk (spread). Tasks of fewer than
 * HI_POOL_BIG chunks (small: the GDN layer's, attention's) are kept apart from the products'. */
#define HI_POOL_BIG 24
typedef struct {
    double tasks, chunks, wall_ns, busy_ns, start_ns, start_max_ns, spread_ns;
} hi_pool_acc;

/* on: clock every chunk from now on (two clock reads per chunk); off: stop. acc[0] small tasks, acc[1] big:
 * copied out and reset when acc is not NULL */
void hi_pool_stats(hi_pool *p, int on, hi_pool_acc *acc);

/* Per-thread placement for per-node weight copies (replica.c). Thread tid (0: the caller, whichever thread calls
 * hi_pool_run; 1..n-1: the workers) reads replica rep[tid] (-1: none, the registered weights themselves): while a
 * thread runs a chunk of this pool's task, hi_pool_tls_replica holds its entry and hi_pool_tls_tid its tid (set
 * once per task on entry, so a chunk function reads them for nothing). ncpus > 0 also pins worker tid to those
 * CPUs (a worker started again in a forked child is not pinned); the caller is never pinned here (it is the
 * application's thread). 0 ok, -2 bad argument (tid out of range, CPUs given for tid 0, a CPU < 0), -4 the
 * kernel refused the CPU set. Call it while no task runs (the context's mutex held). */
int hi_pool_place(hi_pool *p, int tid, int replica, const int *cpus, int ncpus);
int hi_pool_replica_of(const hi_pool *p, int tid);
extern _Thread_local int hi_pool_tls_replica, hi_pool_tls_tid;
/* run fn(arg, i) for i < total on the calling thread alone, as the pool's caller (tid 0, its replica) */
void hi_pool_run_here(hi_pool *p, hi_chunk_fn fn, void *arg, int64_t total);

/* CLOCK_MONOTONIC in nanoseconds */
int64_t hi_now_ns(void);

#endif

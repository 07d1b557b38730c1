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

/* CLOCK_MONOTONIC in nanoseconds */
int64_t hi_now_ns(void);

#endif

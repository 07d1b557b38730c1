/* The library's self-measurements: the pool's self-check (every chunk of every task run exactly once) and the
 * read-bandwidth probe that the decode benchmark takes as its floor. Through the context's lock, pool and kernel
 * table (hi_internal.h); compiled for the baseline target (the probe's loop is the ISA table's read_sum).
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "hi_internal.h"
#include "hi_pool.h"
#include "hi_simd.h"

/* ---- pool self-check ------------------------------------------------------------------------------ */

typedef struct {
    _Atomic int32_t *count;
} hi_countjob;

static void hi_count_chunk(void *a, int64_t i) {
    atomic_fetch_add_explicit(&((hi_countjob *)a)->count[i], 1, memory_order_relaxed);
}

int64_t hi_pool_check(hi_ctx *c, int64_t total, int reps) {
    if (total < 1 || reps < 1) return -1;
    _Atomic int32_t *count = (_Atomic int32_t *)calloc((size_t)total, sizeof(*count));
    if (!count) return -1;
    hi_countjob j = {count};
    int64_t bad = 0;
    hi_ctx_lock(c);
    for (int r = 0; r < reps; r++) {
        hi_ctx_run(c, hi_count_chunk, &j, total);
        for (int64_t i = 0; i < total; i++) bad += atomic_load(&count[i]) != r + 1;
    }
    hi_ctx_unlock(c);
    free(count);
    return bad;
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

/* best of reps timed passes of all threads over their slices of b->buf (warm-up pass first); bytes/s */
static double hi_bw_passes(hi_ctx *c, hi_bwjob *b, int reps) {
    const int nth = hi_ctx_threads(c);
    const size_t total = b->slice * (size_t)nth;
    b->touch = 0;
    hi_ctx_run(c, hi_bw_chunk, b, nth); /* warm-up pass */
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        const int64_t t0 = hi_now_ns();
        hi_ctx_run(c, hi_bw_chunk, b, nth);
        const int64_t dt = hi_now_ns() - t0;
        const double bw = dt > 0 ? (double)total * 1e9 / (double)dt : 0.0;
        if (bw > best) best = bw;
    }
    uint64_t chk = 0;
    for (int i = 0; i < 64; i++) chk += b->sums[i];
    /* the checksum keeps the reads alive; only a buffer of zero bytes reads 0 */
    return chk == 0 ? -1.0 : best;
}

double hi_read_bandwidth(hi_ctx *c, int64_t nbytes, int reps) {
    const int nth = hi_ctx_threads(c);
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
    hi_bwjob b = {.k = hi_ctx_kernels(c), .buf = (uint8_t *)buf, .slice = slice, .touch = 1};
    hi_ctx_lock(c);
    hi_ctx_run(c, hi_bw_chunk, &b, nth); /* first touch, a slice per thread */
    const double bw = hi_bw_passes(c, &b, reps);
    hi_ctx_unlock(c);
    free(buf);
    return bw;
}

double hi_read_bandwidth_at(hi_ctx *c, const void *p, int64_t nbytes, int reps) {
    const int nth = hi_ctx_threads(c);
    if (!p || nbytes < (int64_t)(1 << 20) || reps < 1) return -1.0;
    const uintptr_t a = (uintptr_t)p, start = (a + 4095) & ~(uintptr_t)4095;
    if ((int64_t)(start - a) >= nbytes) return -1.0;
    size_t slice = ((size_t)nbytes - (size_t)(start - a)) / (size_t)nth;
    slice &= ~(size_t)4095;
    if (slice == 0) return -1.0;
    hi_bwjob b = {.k = hi_ctx_kernels(c), .buf = (uint8_t *)start, .slice = slice};
    hi_ctx_lock(c);
    const double bw = hi_bw_passes(c, &b, reps);
    hi_ctx_unlock(c);
    return bw;
}

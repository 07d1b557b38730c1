/* The replica table of a context (replica.c): byte ranges of weights that have per-node copies, and the lookup a
 * product's chunk makes to read its own node's copy. Internal to the library (hi_simd.c, replica.c). */
#ifndef HI_REPLICA_H
#define HI_REPLICA_H

#include <stddef.h>
#include <stdint.h>

#include "hi_pool.h"
#include "hi_simd.h"

typedef struct hi_reps {
    int n_spans, n_copies, n_threads;
    uintptr_t base[HI_MAX_SPANS];
    size_t len[HI_MAX_SPANS];
    const uint8_t *copy[HI_MAX_SPANS][HI_MAX_REPLICAS];
    /* chunks translated, [tid][replica]: each thread writes only its own row (HI_MAX_REPLICAS * 8 bytes, a
     * multiple of the cache line), so counting costs one plain add per chunk and no line moves between threads */
    uint64_t *hits;
} hi_reps;

void hi_reps_free(hi_reps *r);

/* The address a chunk reads `bytes` of weights at `w` from on the calling pool thread: the same offset in its
 * replica's copy when the whole extent lies in a registered span, else w itself. Once per chunk: at most
 * HI_MAX_SPANS compares, against the chunk's microseconds of reading. */
static inline const uint8_t *hi_reps_map(hi_reps *r, const uint8_t *w, size_t bytes) {
    const int rep = hi_pool_tls_replica;
    if (!r || rep < 0 || rep >= r->n_copies) return w;
    const uintptr_t a = (uintptr_t)w;
    for (int s = 0; s < r->n_spans; s++) {
        const size_t off = (size_t)(a - r->base[s]);
        if (a >= r->base[s] && off < r->len[s] && bytes <= r->len[s] - off) {
            r->hits[(size_t)hi_pool_tls_tid * HI_MAX_REPLICAS + (size_t)rep]++;
            return r->copy[s][rep] + off;
        }
    }
    return w;
}

#endif

/* Per-node weight copies: a context's replica table and its threads' placement (hi_simd.h declares the calls).
 *
 * Why: a decode step reads every active weight byte once and is bound by memory bandwidth. On a machine of several
 * NUMA nodes, a thread reading another node's memory crosses the interconnect, whose bandwidth is a fraction of
 * a node's own; interleaving the pages spreads the traffic but still sends (nodes - 1) / nodes of it across. With
 * one copy of the weights on each node and each pool thread reading the copy of the node it is pinned to, every
 * read is local, at the price of the weights' bytes once per node.
 *
 * How: the application registers spans [base, base + len) of the weights it passes to the products (the GGUF's
 * mapping, or the one buffer the weights were copied into) and, for each, n_copies copies of the same bytes (each
 * bound to its node's memory by the caller). Each pool thread has a replica index (hi_pool_place). Where a product
 * hands a chunk of rows to a thread (hi_batch_chunk: every matrix product, the MoE expert products, grouped MoE, the
 * output head), the job's weight pointer w, with the job's whole extent in span s, becomes copy[s][r] + (w - base)
 * for the thread's replica r. The copies hold the same bytes, so every result is bit for bit what the original
 * gives; only where the bytes come from changes.
 */
#define _GNU_SOURCE
#include "hi_replica.h"

#include <stdlib.h>
#include <string.h>

#include "hi_internal.h"

void hi_reps_free(hi_reps *r) {
    if (!r) return;
    free(r->hits);
    free(r);
}

int hi_ctx_set_replicas(hi_ctx *c, int n_spans, const void *const *bases, const int64_t *lens, int n_copies,
                        const void *const *copies) {
    if (!c || n_spans < 0 || n_spans > HI_MAX_SPANS) return -2;
    if (n_spans && (!bases || !lens || !copies || n_copies < 1 || n_copies > HI_MAX_REPLICAS)) return -2;
    for (int s = 0; s < n_spans; s++) {
        if (!bases[s] || lens[s] < 1) return -2;
        for (int k = 0; k < n_copies; k++)
            if (!copies[(size_t)s * (size_t)n_copies + (size_t)k]) return -2;
        const uintptr_t a = (uintptr_t)bases[s], e = a + (uintptr_t)lens[s];
        for (int t = 0; t < s; t++) { /* overlapping spans would make a pointer's copy ambiguous */
            const uintptr_t b = (uintptr_t)bases[t];
            if (a < b + (uintptr_t)lens[t] && b < e) return -2;
        }
    }
    const int nth = hi_ctx_threads(c);
    hi_reps *r = NULL;
    if (n_spans) {
        r = (hi_reps *)calloc(1, sizeof(hi_reps));
        void *h = NULL;
        const size_t hb = (size_t)nth * HI_MAX_REPLICAS * sizeof(uint64_t);
        if (!r || posix_memalign(&h, 64, hb) != 0) {
            free(r);
            return -3;
        }
        memset(h, 0, hb);
        r->hits = (uint64_t *)h;
        r->n_spans = n_spans;
        r->n_copies = n_copies;
        r->n_threads = nth;
        for (int s = 0; s < n_spans; s++) {
            r->base[s] = (uintptr_t)bases[s];
            r->len[s] = (size_t)lens[s];
            for (int k = 0; k < n_copies; k++) r->copy[s][k] = (const uint8_t *)copies[(size_t)s * (size_t)n_copies + (size_t)k];
        }
    }
    hi_ctx_lock(c); /* no product runs while the table changes */
    hi_reps **slot = hi_ctx_reps(c);
    hi_reps *old = *slot;
    *slot = r;
    hi_ctx_unlock(c);
    hi_reps_free(old);
    return 0;
}

int hi_ctx_place_thread(hi_ctx *c, int tid, int replica, const int *cpus, int ncpus) {
    if (!c || replica >= HI_MAX_REPLICAS) return -2;
    hi_ctx_lock(c);
    const int rc = hi_pool_place(hi_ctx_pool(c), tid, replica, cpus, ncpus);
    hi_ctx_unlock(c);
    return rc;
}

int hi_ctx_thread_replica(hi_ctx *c, int tid) {
    hi_ctx_lock(c);
    const int r = hi_pool_replica_of(hi_ctx_pool(c), tid);
    hi_ctx_unlock(c);
    return r;
}

int hi_ctx_replica_hits(hi_ctx *c, int64_t *out, int reset) {
    if (!c || !out) return -2;
    const int nth = hi_ctx_threads(c);
    hi_ctx_lock(c);
    hi_reps *r = *hi_ctx_reps(c);
    for (size_t i = 0; i < (size_t)nth * HI_MAX_REPLICAS; i++) out[i] = r ? (int64_t)r->hits[i] : 0;
    if (r && reset) memset(r->hits, 0, (size_t)nth * HI_MAX_REPLICAS * sizeof(uint64_t));
    hi_ctx_unlock(c);
    return 0;
}

/* The context (hi_ctx) as the library's C files see it: private to them, opaque to callers (hi_simd.h). */
#ifndef HI_CTX_H
#define HI_CTX_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "hi_internal.h"
#include "hi_pool.h"
#include "hi_replica.h"

struct hi_ctx {
    const hi_kernels *k;
    hi_pool *pool;
    pthread_mutex_t mu;
    uint8_t *scratch;
    size_t scratch_cap;
    int pf_bytes; /* hi_ctx_set_prefetch */
    hi_reps *reps; /* per-node weight copies (replica.c), NULL: none */
};

#endif

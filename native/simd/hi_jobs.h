/* The product drivers' shared pieces (hi_simd.c defines them; moe_rows.c uses them too): a product as a job of rows
 * for the pool, its activation rows' per-ISA preparation, and the context's scratch. Internal to the library. */
#ifndef HI_JOBS_H
#define HI_JOBS_H

#include "hi_ctx.h"
#include "hi_internal.h"

#define HI_MAX_K 64
#define HI_MAX_JOBS (2 * HI_MAX_K + 2) /* the MoE gate/up call: k experts x 2 and the shared expert's two */

/* the context's scratch of at least n bytes (grown as needed; NULL if that fails) */
uint8_t *hi_scratch(hi_ctx *c, size_t n);
/* whether activation rows for weight type qtype take a per-call preparation on this context's unit, and its bytes
 * for T rows of nb 32-value blocks */
int hi_needs_prep(const hi_ctx *c, int qtype);
size_t hi_prep_bytes(int64_t T, int64_t nb);
/* m's prepared rows: those of `from` from its row t on, or shared with a job of the same rows among jobs[0..n), else
 * made at `at` */
void hi_prep_share(hi_mm *m, const hi_mm *from, int64_t t, int64_t nb);
void hi_prep_job(const hi_ctx *c, hi_mm *m, const hi_mm *jobs, int n, const uint8_t *xq, size_t xq_row, int64_t T,
                 int64_t nb, uint8_t *at);
/* the job of one product (its K-quant float shape from ggml_op) and the checks of its weight type */
hi_mm hi_job(const hi_ctx *c, int ggml_op, int qtype, const void *w, int64_t rows, int64_t cols,
             const uint8_t *x, size_t x_row, int64_t T, float *out, size_t out_row);
int hi_check_type(const hi_ctx *c, int qtype, int64_t cols);
/* jobs[0..njobs) as one pool task, their rows in chunks (the caller holds c->mu) */
void hi_run_jobs(hi_ctx *c, hi_mm *jobs, int njobs);

#endif

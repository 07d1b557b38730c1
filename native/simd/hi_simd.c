/* The library's entry points on a context: the drivers that split a matrix product (or the k experts of a
 * MoE layer) into row chunks for the context's thread pool (hi_pool.c), activation quantization and weight
 * repacking (the context itself: hi_ctx.c). CPU detection, the kernel tables and the row sizes are in hi_cpu.c; the read-bandwidth probe and
 * the pool's self-check in probe.c.
 *
 * No arithmetic of the results happens here (kernels_body.h has the maths); this file only decides which
 * rows each thread computes. Rows are independent, so the result does not depend on the thread count.
 * Compiled for the baseline target: it calls the per-ISA tables, it holds no SIMD code.
 */
#define _GNU_SOURCE
#include "hi_simd.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "hi_ctx.h"
#include "hi_jobs.h"

/* the legacy 32-element types, whose activation rows are prepared per call (hi_prep_rows) */
static int hi_is_legacy(int qtype) {
    return qtype == HI_T_Q4_0 || qtype == HI_T_Q4_1 || qtype == HI_T_Q5_0 || qtype == HI_T_Q5_1 ||
           qtype == HI_T_Q8_0;
}

static int hi_is_kquant(int qtype) { return qtype == HI_T_Q4_K || qtype == HI_T_Q5_K || qtype == HI_T_Q6_K; }

/* ================================================================================================ */
/* context: hi_ctx.c; its scratch here */

uint8_t *hi_scratch(hi_ctx *c, size_t n) {
    if (n > c->scratch_cap) {
        free(c->scratch);
        c->scratch = NULL;
        c->scratch_cap = 0;
        void *p = NULL;
        if (posix_memalign(&p, 64, n) != 0) return NULL;
        c->scratch = (uint8_t *)p;
        c->scratch_cap = n;
    }
    return c->scratch;
}

/* whether products of weight type qtype prepare their activation rows first (hi_prep_rows): the legacy types
 * always, the K-quants on a unit with `kprep` */
int hi_needs_prep(const hi_ctx *c, int qtype) {
    qtype = hi_base_type(qtype);
    return hi_is_legacy(qtype) || (hi_is_kquant(qtype) && c->k->kprep);
}

/* bytes of prepared data for T activation rows of nb blocks of 32: legacy types corr (8 int32), dy, sy per
 * block; K-quants HI_KPREP_BYTES per 8 blocks (the larger: 132 bytes per block) */
size_t hi_prep_bytes(int64_t T, int64_t nb) { return (size_t)(T * nb) * (HI_KPREP_BYTES / 8); }

/* prepare T activation rows (xq, xq_row bytes apart; nb blocks of 32 each) for m's weight type into scratch at
 * `at`, and point m at them: a legacy type's corr/dy/sy (rows at nb blocks), a K-quant's xk/xk_row */
static void hi_prep_rows(const hi_kernels *k, hi_mm *m, const uint8_t *xq, size_t xq_row, int64_t T, int64_t nb,
                         uint8_t *at) {
    if (hi_is_kquant(m->qtype)) {
        m->xk_row = (size_t)(nb / 8) * HI_KPREP_BYTES;
        for (int64_t t = 0; t < T; t++) k->kprep(xq + (size_t)t * xq_row, nb / 8, at + (size_t)t * m->xk_row);
        m->xk = at;
        return;
    }
    int32_t *cr = (int32_t *)at;
    float *d = (float *)(at + (size_t)(T * nb) * 8 * sizeof(int32_t));
    float *s = d + T * nb;
    const int need = k->needs_corr[m->qtype];
    for (int64_t t = 0; t < T; t++)
        k->prep(m->qtype, xq + (size_t)t * xq_row, nb, need ? cr + t * nb * 8 : NULL, d + t * nb, s + t * nb);
    m->corr = need ? cr : NULL;
    m->dy = d;
    m->sy = s;
}

/* m reads the prepared rows of `from` starting at its row t (nb blocks of 32 per row) */
void hi_prep_share(hi_mm *m, const hi_mm *from, int64_t t, int64_t nb) {
    m->corr = from->corr ? from->corr + (size_t)(t * nb) * 8 : NULL;
    m->dy = from->dy ? from->dy + t * nb : NULL;
    m->sy = from->sy ? from->sy + t * nb : NULL;
    m->xk = from->xk ? from->xk + (size_t)t * from->xk_row : NULL;
    m->xk_row = from->xk_row;
}

/* m's preparation, if its type needs one, of its activation rows: shared with the first of jobs[0..n) with the
 * same rows (x) and weight type (a legacy type's lane correction depends on it; the K-quants share theirs), else made
 * at `at` */
void hi_prep_job(const hi_ctx *c, hi_mm *m, const hi_mm *jobs, int n, const uint8_t *xq, size_t xq_row, int64_t T,
                 int64_t nb, uint8_t *at) {
    if (!hi_needs_prep(c, m->qtype)) return;
    for (int i = 0; i < n; i++)
        if (jobs[i].x == m->x &&
            (jobs[i].qtype == m->qtype || (hi_is_kquant(jobs[i].qtype) && hi_is_kquant(m->qtype)))) {
            hi_prep_share(m, &jobs[i], 0, nb);
            return;
        }
    hi_prep_rows(c->k, m, xq, xq_row, T, nb, at);
}

/* ---- batched products ---------------------------------------------------------------------------- */


/* A call's rows in chunks for the pool, in tiers of shrinking chunks: first each job's leading 3/4 of rows in big
 * chunks, then 3/4 of the rest of every job in chunks a quarter as big, then the last rows in chunks a quarter
 * as big again, so that the threads that finish first pick up ever smaller pieces and all of them finish close
 * together (decode calls last 20-200 us; a thread idle for half a chunk at the end was ~6% of such a call with
 * one tier, and a small chunk of the second tier of a 10 MB call still takes ~14 us at one thread's share of
 * the bandwidth). Tier t of job j covers its rows [bound[t][j], bound[t + 1][j]); chunks are numbered tier by
 * tier (tier t's from first[t]), within a tier job by job (job j's from starts[t][j]). */
#define HI_TIERS 3
typedef struct {
    const hi_kernels *k;
    hi_reps *reps; /* the context's replica table: each chunk reads its thread's copy of the weights */
    const hi_mm *jobs;
    int njobs;
    int64_t chunk[HI_TIERS];                  /* rows per chunk of each tier */
    int64_t bound[HI_TIERS + 1][HI_MAX_JOBS]; /* job j: tier t's rows start at bound[t][j] */
    int64_t starts[HI_TIERS][HI_MAX_JOBS + 1]; /* per tier: cumulative chunk counts, counted from first[t] */
    int64_t first[HI_TIERS + 1];              /* the first chunk index of each tier */
} hi_batch;

static void hi_batch_chunk(void *a, int64_t i) {
    const hi_batch *b = (const hi_batch *)a;
    int tier = 0;
    while (tier + 1 < HI_TIERS && i >= b->first[tier + 1]) tier++;
    const int64_t *st = b->starts[tier];
    i -= b->first[tier];
    int lo = 0, hi = b->njobs - 1; /* the job j with st[j] <= i < st[j + 1] */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (st[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    const hi_mm *m = &b->jobs[lo];
    const int64_t from = b->bound[tier][lo], to = b->bound[tier + 1][lo];
    const int64_t r0 = from + (i - st[lo]) * b->chunk[tier];
    const int64_t r1 = r0 + b->chunk[tier] < to ? r0 + b->chunk[tier] : to;
    const uint8_t *w = hi_reps_map(b->reps, m->w, (size_t)m->rows * m->w_row);
    if (w != m->w) {
        hi_mm at = *m;
        at.w = w;
        b->k->mm(&at, r0, r1);
        return;
    }
    b->k->mm(m, r0, r1);
}

/* bytes of weights below which a call runs on the calling thread alone (waking the pool costs more) */
#define HI_INLINE_BYTES (96 << 10)

void hi_run_jobs(hi_ctx *c, hi_mm *jobs, int njobs) {
    for (int j = 0; j < njobs; j++) jobs[j].pf = c->pf_bytes;
    int64_t total_rows = 0, T = 1, bytes = 0;
    for (int j = 0; j < njobs; j++) {
        total_rows += jobs[j].rows;
        bytes += jobs[j].rows * (int64_t)jobs[j].w_row * jobs[j].T;
        if (jobs[j].T > T) T = jobs[j].T;
    }
    const int nth = bytes < HI_INLINE_BYTES ? 1 : hi_pool_size(c->pool);
    hi_batch b = {.k = c->k, .reps = c->reps, .jobs = jobs, .njobs = njobs};
    /* about 8 chunks per thread for balance; for several tokens at most 64 rows, so that a chunk's weight
     * rows stay in cache while the token blocks sweep over them; one token: the shrinking tiers, the big
     * chunks 4 per thread; rows in multiples of 4 */
    int64_t chunk = (total_rows + 8 * nth - 1) / (8 * nth);
    const int tiers = T == 1 && nth > 1 ? HI_TIERS : 1;
    if (tiers > 1) chunk = (3 * total_rows + 16 * nth - 1) / (16 * nth);
    if (T > 1 && chunk > 64) chunk = 64;
    for (int t = 0; t < HI_TIERS; t++) {
        if (chunk < 4) chunk = 4;
        b.chunk[t] = (chunk + 3) & ~(int64_t)3;
        chunk = b.chunk[t] / 4;
    }
    b.first[0] = 0;
    for (int t = 0; t < HI_TIERS; t++) {
        b.starts[t][0] = 0;
        for (int j = 0; j < njobs; j++) {
            const int64_t from = t ? b.bound[t][j] : 0, rows = jobs[j].rows - from, c_t = b.chunk[t];
            if (t == 0) b.bound[0][j] = 0;
            /* the last tier (or the only one) takes every row left; the others 3/4 of them in whole chunks */
            const int64_t take = t + 1 >= tiers ? rows : (rows * 3 / 4) / c_t * c_t;
            b.bound[t + 1][j] = from + take;
            b.starts[t][j + 1] = b.starts[t][j] + (take + c_t - 1) / c_t;
        }
        b.first[t + 1] = b.first[t] + b.starts[t][njobs];
    }
    const int64_t n = b.first[HI_TIERS];
    if (nth == 1) {
        hi_pool_run_here(c->pool, hi_batch_chunk, &b, n);
    } else {
        hi_pool_run(c->pool, hi_batch_chunk, &b, n);
    }
}

/* the float shape llama.cpp's CPU backend gives a K-quant product (see dot_kq_shapes.h for the rules) */
static int hi_kshape(const hi_ctx *c, int ggml_op, int qtype, int64_t rows, int64_t T) {
    if (ggml_op == HI_GGML_NONE || c->k->isa < HI_ISA_AVX2) return HI_KS_VEC;
    if (ggml_op == HI_GGML_DECODE_ROWS) return qtype == HI_T_Q4_K && rows % 8 == 0 ? HI_KS_REPACK : HI_KS_VEC;
    if (qtype == HI_T_Q4_K && rows % 8 == 0) return ggml_op == HI_GGML_MUL_MAT ? HI_KS_REPACK_GEMM : HI_KS_REPACK;
    if ((qtype == HI_T_Q4_K || qtype == HI_T_Q5_K || qtype == HI_T_Q6_K) && T >= 8) return HI_KS_TILED;
    return HI_KS_VEC;
}

/* the job of one product (its K-quant preparation, if any, set by the caller) */
hi_mm hi_job(const hi_ctx *c, int ggml_op, int qtype, const void *w, int64_t rows, int64_t cols,
             const uint8_t *x, size_t x_row, int64_t T, float *out, size_t out_row) {
    const int base = hi_base_type(qtype);
    hi_mm m = {.qtype = base, .w = (const uint8_t *)w, .w_row = (size_t)hi_weight_row_bytes(base, cols), .rows = rows,
               .cols = cols, .x = x, .x_row = x_row, .T = T, .out = out, .out_row = out_row,
               .wz = (qtype & HI_T_ZIPPED) != 0, .kshape = hi_kshape(c, ggml_op, base, rows, T),
               .rows1 = ggml_op == HI_GGML_DECODE_ROWS};
    return m;
}

int hi_check_type(const hi_ctx *c, int qtype, int64_t cols) {
    if (hi_act_kind(qtype) == HI_ACT_NONE) return -1;
    if ((qtype & HI_T_ZIPPED) && !c->k->krepack) return -1; /* zipped rows, a unit without their kernels */
    if (hi_weight_row_bytes(qtype, cols) < 0) return -2;
    if (cols > INT32_MAX) return -2;
    return 0;
}

int hi_matmul(hi_ctx *c, int qtype, const void *w, int64_t rows, int64_t cols, const void *xq, int64_t xq_row,
              int64_t T, float *out, int64_t out_row, int ggml_op) {
    int e = hi_check_type(c, qtype, cols);
    if (e) return e;
    if (rows < 1 || T < 1 || !w || !xq || !out || ggml_op < 0 || ggml_op > HI_GGML_DECODE_ROWS) return -2;
    if (T > 1 && (xq_row < hi_act_row_bytes(qtype, cols) || out_row < rows)) return -2;
    hi_mm m = hi_job(c, ggml_op, qtype, w, rows, cols, (const uint8_t *)xq, (size_t)xq_row, T, out, (size_t)out_row);
    pthread_mutex_lock(&c->mu);
    if (hi_needs_prep(c, qtype)) {
        const int64_t nb = cols / 32;
        uint8_t *s = hi_scratch(c, hi_prep_bytes(T, nb));
        if (!s) {
            pthread_mutex_unlock(&c->mu);
            return -3;
        }
        hi_prep_rows(c->k, &m, m.x, T > 1 ? m.x_row : 0, T, nb, s);
    }
    hi_run_jobs(c, &m, 1);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

int hi_matmul_many(hi_ctx *c, int n, const int *qtypes, const void *const *ws, const int64_t *rows, int64_t cols,
                   const void *const *xqs, const int64_t *xq_rows, int64_t T, float *const *outs,
                   const int64_t *out_rows, int ggml_op) {
    if (n < 1 || n > HI_MAX_K || T < 1 || !xqs || !xq_rows || ggml_op < 0 || ggml_op > HI_GGML_DECODE_ROWS) return -2;
    int prep = 0;
    for (int j = 0; j < n; j++) {
        const int e = hi_check_type(c, qtypes[j], cols);
        if (e) return e;
        if (rows[j] < 1 || !ws[j] || !outs[j] || !xqs[j]) return -2;
        if (T > 1 && (out_rows[j] < rows[j] || xq_rows[j] < hi_act_row_bytes(qtypes[j], cols))) return -2;
        prep |= hi_needs_prep(c, qtypes[j]);
    }
    hi_mm jobs[HI_MAX_K];
    pthread_mutex_lock(&c->mu);
    const int64_t nb = cols / 32;
    const size_t pb = hi_prep_bytes(T, nb);
    uint8_t *s = NULL;
    if (prep) {
        s = hi_scratch(c, (size_t)n * pb);
        if (!s) {
            pthread_mutex_unlock(&c->mu);
            return -3;
        }
    }
    for (int j = 0; j < n; j++) {
        hi_mm m = hi_job(c, ggml_op, qtypes[j], ws[j], rows[j], cols, (const uint8_t *)xqs[j], (size_t)xq_rows[j], T,
                         outs[j], (size_t)out_rows[j]);
        if (s) hi_prep_job(c, &m, jobs, j, m.x, T > 1 ? m.x_row : 0, T, nb, s + (size_t)j * pb);
        jobs[j] = m;
    }
    hi_run_jobs(c, jobs, n);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* one matrix (rows x cols at w) times one activation row xq into out, as llama.cpp's ggml_op shapes it; the
 * caller sets a legacy type's preparation (corr, dy, sy) */
static hi_mm hi_vec_job(hi_ctx *c, int ggml_op, int qtype, const void *w, int64_t rows, int64_t cols,
                        const uint8_t *xq, float *out) {
    return hi_job(c, ggml_op, qtype, w, rows, cols, xq, 0, 1, out, 0);
}

/* a dense product of one activation row (the shared expert beside the routed ones: a MUL_MAT where the routed
 * ones are a MUL_MAT_ID); its preparation shared with jobs[0..n) of the same row (hi_prep_job), else made at
 * `prep` (hi_prep_bytes(1, cols / 32) bytes) */
static hi_mm hi_row_job(hi_ctx *c, int ggml_op, int qtype, const void *w, int64_t rows, int64_t cols,
                        const uint8_t *xq, float *out, const hi_mm *jobs, int n, uint8_t *prep) {
    hi_mm m = hi_vec_job(c, ggml_op ? HI_GGML_MUL_MAT : HI_GGML_NONE, qtype, w, rows, cols, xq, out);
    hi_prep_job(c, &m, jobs, n, xq, 0, 1, cols / 32, prep);
    return m;
}

int hi_moe_gate_up(hi_ctx *c, int gate_qtype, const void *wg, int up_qtype, const void *wu, int64_t n_expert,
                   int64_t rows, int64_t cols, const void *xq, const int32_t *ids, int k, float *gate_out,
                   int64_t gate_row, float *up_out, int64_t up_row, int ggml_op, int s_gate_qtype, const void *sg,
                   int s_up_qtype, const void *su, int64_t s_rows, float *s_gate_out, float *s_up_out) {
    int e = hi_check_type(c, gate_qtype, cols);
    if (!e) e = hi_check_type(c, up_qtype, cols);
    if (!e && sg) e = hi_check_type(c, s_gate_qtype, cols);
    if (!e && sg) e = hi_check_type(c, s_up_qtype, cols);
    if (e) return e;
    const int kind = hi_act_kind(gate_qtype);
    if (hi_act_kind(up_qtype) != kind) return -2;
    if (sg && (!su || !s_gate_out || !s_up_out || s_rows < 1 || hi_act_kind(s_gate_qtype) != kind ||
               hi_act_kind(s_up_qtype) != kind))
        return -2;
    if (k < 1 || k > HI_MAX_K || rows < 1 || n_expert < 1 || gate_row < rows || up_row < rows || ggml_op < 0 ||
        ggml_op > HI_GGML_DECODE_ROWS)
        return -2;
    for (int i = 0; i < k; i++)
        if (ids[i] < 0 || ids[i] >= n_expert) return -2;
    const size_t grb = (size_t)hi_weight_row_bytes(gate_qtype, cols), urb = (size_t)hi_weight_row_bytes(up_qtype, cols);
    hi_mm jobs[2 * HI_MAX_K + 2];
    pthread_mutex_lock(&c->mu);
    const int64_t nb = cols / 32;
    const size_t pb = hi_prep_bytes(1, nb);
    uint8_t *s = NULL;
    if (hi_needs_prep(c, gate_qtype) || hi_needs_prep(c, up_qtype) || (sg && hi_needs_prep(c, s_gate_qtype)) ||
        (sg && hi_needs_prep(c, s_up_qtype))) {
        s = hi_scratch(c, 4 * pb);
        if (!s) {
            pthread_mutex_unlock(&c->mu);
            return -3;
        }
    }
    for (int i = 0; i < k; i++) {
        const size_t ex = (size_t)ids[i] * (size_t)rows;
        hi_mm g = hi_vec_job(c, ggml_op, gate_qtype, (const uint8_t *)wg + ex * grb, rows, cols, (const uint8_t *)xq,
                             gate_out + (size_t)i * (size_t)gate_row);
        hi_mm u = hi_vec_job(c, ggml_op, up_qtype, (const uint8_t *)wu + ex * urb, rows, cols, (const uint8_t *)xq,
                             up_out + (size_t)i * (size_t)up_row);
        if (i == 0) { /* one preparation per weight type, for all k experts */
            hi_prep_job(c, &g, NULL, 0, (const uint8_t *)xq, 0, 1, nb, s);
            hi_prep_job(c, &u, &g, 1, (const uint8_t *)xq, 0, 1, nb, s + pb);
        } else {
            hi_prep_share(&g, &jobs[0], 0, nb);
            hi_prep_share(&u, &jobs[1], 0, nb);
        }
        jobs[2 * i] = g;
        jobs[2 * i + 1] = u;
    }
    int n = 2 * k;
    if (sg) {
        const uint8_t *x1 = (const uint8_t *)xq;
        jobs[n] = hi_row_job(c, ggml_op, s_gate_qtype, sg, s_rows, cols, x1, s_gate_out, jobs, n, s ? s + 2 * pb : NULL);
        n++;
        jobs[n] = hi_row_job(c, ggml_op, s_up_qtype, su, s_rows, cols, x1, s_up_out, jobs, n, s ? s + 3 * pb : NULL);
        n++;
    }
    hi_run_jobs(c, jobs, n);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

int hi_moe_down(hi_ctx *c, int qtype, const void *w, int64_t n_expert, int64_t rows, int64_t cols, const void *xq,
                int64_t xq_row, const int32_t *ids, int k, float *out, int64_t out_row, int ggml_op, int s_qtype,
                const void *sw, int64_t s_cols, const void *s_xq, float *s_out) {
    int e = hi_check_type(c, qtype, cols);
    if (!e && sw) e = hi_check_type(c, s_qtype, s_cols);
    if (e) return e;
    if (k < 1 || k > HI_MAX_K || rows < 1 || n_expert < 1 || out_row < rows ||
        xq_row < hi_act_row_bytes(qtype, cols) || ggml_op < 0 || ggml_op > HI_GGML_DECODE_ROWS)
        return -2;
    if (sw && (!s_xq || !s_out || hi_act_kind(s_qtype) != hi_act_kind(qtype))) return -2;
    for (int i = 0; i < k; i++)
        if (ids[i] < 0 || ids[i] >= n_expert) return -2;
    const size_t rb = (size_t)hi_weight_row_bytes(qtype, cols);
    hi_mm jobs[HI_MAX_K + 1];
    pthread_mutex_lock(&c->mu);
    const int64_t nb = cols / 32;
    uint8_t *s = NULL;
    if (hi_needs_prep(c, qtype) || (sw && hi_needs_prep(c, s_qtype))) {
        s = hi_scratch(c, hi_prep_bytes(k, nb) + hi_prep_bytes(1, s_cols / 32));
        if (!s) {
            pthread_mutex_unlock(&c->mu);
            return -3;
        }
    }
    hi_mm prep = {.qtype = hi_base_type(qtype)}; /* the k rows' preparation, one per expert's input row */
    if (hi_needs_prep(c, qtype)) hi_prep_rows(c->k, &prep, (const uint8_t *)xq, (size_t)xq_row, k, nb, s);
    for (int i = 0; i < k; i++) {
        hi_mm m = hi_vec_job(c, ggml_op, qtype, (const uint8_t *)w + (size_t)ids[i] * (size_t)rows * rb, rows, cols,
                             (const uint8_t *)xq + (size_t)i * (size_t)xq_row, out + (size_t)i * (size_t)out_row);
        hi_prep_share(&m, &prep, i, nb);
        jobs[i] = m;
    }
    int n = k;
    if (sw)
        jobs[n++] = hi_row_job(c, ggml_op, s_qtype, sw, rows, s_cols, (const uint8_t *)s_xq, s_out, NULL, 0,
                               s ? s + hi_prep_bytes(k, nb) : NULL);
    hi_run_jobs(c, jobs, n);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* ---- activation quantization --------------------------------------------------------------------- */

typedef struct {
    const hi_kernels *k;
    int kind;
    const float *x;
    size_t x_row;
    int64_t T, cols;
    uint8_t *out;
    size_t out_row;
} hi_qjob;

static void hi_quant_chunk(void *a, int64_t t) {
    const hi_qjob *q = (const hi_qjob *)a;
    q->k->quantize(q->kind, q->x + (size_t)t * q->x_row, q->cols, q->out + (size_t)t * q->out_row);
}

int hi_quantize(hi_ctx *c, int qtype, const float *x, int64_t x_row, int64_t T, int64_t cols, void *out,
                int64_t out_row) {
    const int kind = hi_act_kind(qtype);
    if (kind == HI_ACT_NONE) return -1;
    const int64_t rb = hi_act_row_bytes(qtype, cols);
    if (rb < 0 || T < 1 || !x || !out) return -2;
    if (T > 1 && (x_row < cols || out_row < rb)) return -2;
    hi_qjob q = {.k = c->k, .kind = kind, .x = x, .x_row = (size_t)x_row, .T = T, .cols = cols,
                 .out = (uint8_t *)out, .out_row = (size_t)out_row};
    pthread_mutex_lock(&c->mu);
    if (hi_pool_size(c->pool) == 1 || T < 2 || T * cols < (1 << 15)) {
        for (int64_t t = 0; t < T; t++) hi_quant_chunk(&q, t);
    } else {
        hi_pool_run(c->pool, hi_quant_chunk, &q, T);
    }
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* ---- weight layout --------------------------------------------------------------------------------- */

int hi_repack_rows(hi_ctx *c, int qtype, void *data, int64_t nbytes) {
    if (hi_act_kind(qtype) == HI_ACT_NONE || (qtype & HI_T_ZIPPED)) return -1;
    if (!hi_is_kquant(qtype) || !c->k->krepack) return qtype; /* this unit reads ggml's layout */
    const int64_t bs = hi_weight_row_bytes(qtype, 256);
    if (nbytes < 0 || nbytes % bs || (nbytes && !data)) return -2;
    c->k->krepack(qtype, (uint8_t *)data, nbytes / bs);
    return qtype | HI_T_ZIPPED;
}

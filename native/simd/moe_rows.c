/* hi_moe_rows: the routed experts of T tokens as one call, grouped by expert so that each selected expert's rows are
 * read once for all the tokens routed to it. For pair p = t*k + j (expert e = idx[p]):
 *   ys[p] = Wd[e] . q_d(swiglu(Wg[e] . x_t, Wu[e] . x_t))
 * with x_t the token's row already quantized for the gate/up format (xq) and q_d the down format's quantization.
 * The pairs are ordered by expert with a stable counting sort (the order numpy's stable argsort gives), their input
 * rows gathered in that order, then: gate and up over every group (hi_moe_grouped), SwiGLU, one quantization of the
 * n = T*k rows, down over every group, and each result row written back to its pair's place. Each product row is
 * computed as hi_moe_grouped computes it whatever the other groups hold, so the results do not depend on which
 * tokens share the call (with GGML_DECODE_ROWS: each pair in its one-token float shape).
 * Scratch (hi_moe_rows_scratch bytes): the gathered rows, the down outputs in group order, the order and groups.
 * hi_moe_grouped, the grouped products themselves, is here too (hi_simd.c's drivers split each job's rows).
 */
#include <pthread.h>
#include <string.h>

#include "hi_jobs.h"
#include "hi_simd.h"

/* MoE over several tokens, grouped by expert: the n routed (token, slot) pairs' input rows xq (npairs rows,
 * xq_row bytes apart) sorted so that group g (expert experts[g]) holds pairs starts[g] .. starts[g+1]-1; for each of
 * the nw (1 or 2: gate and up) stacked expert tensors ws[w] and each group,
 *     outs[w][p] = W_w[experts[g]] . x[p]    for p in the group,
 * the groups in pool tasks of up to HI_MAX_JOBS jobs, each selected expert's rows read once for all its pairs. The
 * activation rows are prepared once per weight type and shared by the groups. */
int hi_moe_grouped(hi_ctx *c, int nw, const int *qtypes, const void *const *ws, int64_t n_expert, int64_t rows,
                   int64_t cols, const void *xq, int64_t xq_row, int64_t npairs, int ngroups, const int32_t *experts,
                   const int64_t *starts, float *const *outs, int64_t out_row, int ggml_op, const void *const *xws,
                   int64_t xT, float *const *xouts, int xop) {
    if (nw < 1 || nw > 2 || ngroups < 1 || rows < 1 || n_expert < 1 || npairs < 1 ||
        !xq || !ws || !outs || !experts || !starts || out_row < rows || ggml_op < 0 || ggml_op > HI_GGML_DECODE_ROWS)
        return -2;
    if (xws && (xT < 1 || xT >= npairs || !xouts || xop < 0 || xop > HI_GGML_DECODE_ROWS)) return -2;
    if (xws)
        for (int w = 0; w < nw; w++)
            if (!xws[w] || !xouts[w]) return -2;
    const int64_t routed = xws ? npairs - xT : npairs; /* the groups' pairs; the extra group's follow them */
    for (int w = 0; w < nw; w++) {
        const int e = hi_check_type(c, qtypes[w], cols);
        if (e) return e;
        if (!ws[w] || !outs[w] || hi_act_kind(qtypes[w]) != hi_act_kind(qtypes[0])) return -2;
    }
    if (xq_row < hi_act_row_bytes(qtypes[0], cols) || starts[0] != 0 || starts[ngroups] != routed) return -2;
    for (int g = 0; g < ngroups; g++)
        if (starts[g + 1] <= starts[g] || experts[g] < 0 || experts[g] >= n_expert) return -2;
    hi_mm jobs[HI_MAX_JOBS], prep[2];
    pthread_mutex_lock(&c->mu);
    const int64_t nb = cols / 32;
    const size_t pb = hi_prep_bytes(npairs, nb);
    uint8_t *s = NULL;
    if (hi_needs_prep(c, qtypes[0]) || (nw > 1 && hi_needs_prep(c, qtypes[nw - 1]))) {
        s = hi_scratch(c, (size_t)nw * pb);
        if (!s) {
            pthread_mutex_unlock(&c->mu);
            return -3;
        }
    }
    for (int w = 0; w < nw; w++) { /* every pair's row prepared once per weight type (shared where the types allow) */
        prep[w] = hi_job(c, ggml_op, qtypes[w], ws[w], rows, cols, (const uint8_t *)xq, (size_t)xq_row, npairs,
                         outs[w], (size_t)out_row);
        if (s) hi_prep_job(c, &prep[w], prep, w, (const uint8_t *)xq, (size_t)xq_row, npairs, nb, s + (size_t)w * pb);
    }
    int n = 0;
    for (int g = 0; g < ngroups; g++) {
        const int64_t p0 = starts[g], T = starts[g + 1] - p0;
        for (int w = 0; w < nw; w++) {
            const size_t rb = (size_t)hi_weight_row_bytes(qtypes[w], cols);
            hi_mm m = hi_job(c, ggml_op, qtypes[w], (const uint8_t *)ws[w] + (size_t)experts[g] * (size_t)rows * rb,
                             rows, cols, (const uint8_t *)xq + (size_t)p0 * (size_t)xq_row, (size_t)xq_row, T,
                             outs[w] + (size_t)p0 * (size_t)out_row, (size_t)out_row);
            if (s) hi_prep_share(&m, &prep[w], p0, nb);
            jobs[n++] = m;
        }
        if (n + nw > HI_MAX_JOBS) { /* a pool task holds at most HI_MAX_JOBS jobs: the next groups in the next */
            hi_run_jobs(c, jobs, n);
            n = 0;
        }
    }
    if (xws) { /* the extra group (a shared expert): its own matrices over the last xT pairs, in its own shape */
        if (n + nw > HI_MAX_JOBS) {
            hi_run_jobs(c, jobs, n);
            n = 0;
        }
        for (int w = 0; w < nw; w++) {
            hi_mm m = hi_job(c, xop, qtypes[w], xws[w], rows, cols, (const uint8_t *)xq + (size_t)routed * (size_t)xq_row,
                             (size_t)xq_row, xT, xouts[w], (size_t)out_row);
            if (s) hi_prep_share(&m, &prep[w], routed, nb);
            jobs[n++] = m;
        }
    }
    if (n) hi_run_jobs(c, jobs, n);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

static size_t al64(size_t n) { return (n + 63) & ~(size_t)63; }

int64_t hi_moe_rows_scratch(int64_t n_pairs, int64_t n_expert, int64_t x_bytes, int64_t n_embd) {
    if (n_pairs < 1 || n_expert < 1 || x_bytes < 1 || n_embd < 1) return -1;
    return (int64_t)(al64((size_t)n_pairs * (size_t)x_bytes) + al64((size_t)n_pairs * (size_t)n_embd * 4) +
                     al64((size_t)n_pairs * 4) + al64((size_t)n_expert * 4) + al64((size_t)(n_expert + 1) * 8) +
                     al64((size_t)(n_expert + 1) * 8));
}

int hi_moe_rows(hi_ctx *c, int gate_qt, const void *wg, int up_qt, const void *wu, int down_qt, const void *wd,
                int64_t n_expert, int64_t n_ff, int64_t n_embd, const void *xq, int64_t xq_row, int64_t T,
                const int32_t *idx, int k, float *eg, float *eu, int64_t e_row, void *hq, int64_t hq_row, float *ys,
                int64_t ys_row, void *scratch, int64_t scratch_bytes, int ggml_op, const void *sg, const void *su,
                const void *sd, float *s_out, int64_t s_out_row) {
    if (!c || !wg || !wu || !wd || !xq || !idx || !eg || !eu || !hq || !ys || !scratch || T < 1 || k < 1 ||
        n_expert < 1 || n_ff < 1 || n_embd < 1 || e_row < n_ff || ys_row < n_embd)
        return -2;
    if (sg && (!su || !sd || !s_out || s_out_row != n_embd)) return -2; /* its down rows n_embd apart, as the pairs' */
    const int64_t n = T * (int64_t)k, ns = sg ? T : 0; /* the routed pairs, then the shared expert's rows */
    const int sop = ggml_op == HI_GGML_MUL_MAT_ID ? HI_GGML_MUL_MAT : ggml_op;
    if (hi_act_row_bytes(gate_qt, n_embd) <= 0 || hi_act_row_bytes(gate_qt, n_embd) != hi_act_row_bytes(up_qt, n_embd) ||
        xq_row < hi_act_row_bytes(gate_qt, n_embd) || hi_act_row_bytes(down_qt, n_ff) <= 0 ||
        hq_row < hi_act_row_bytes(down_qt, n_ff))
        return -2;
    const int64_t xr = hi_act_row_bytes(gate_qt, n_embd); /* the gathered rows, packed */
    const int64_t need = hi_moe_rows_scratch(n + ns, n_expert, xr, n_embd);
    if (need < 0 || scratch_bytes < need) return -2;
    uint8_t *s = (uint8_t *)scratch;
    uint8_t *xs = s;
    s += al64((size_t)(n + ns) * (size_t)xr);
    float *out = (float *)s;
    s += al64((size_t)(n + ns) * (size_t)n_embd * 4);
    int32_t *order = (int32_t *)s;
    s += al64((size_t)(n + ns) * 4);
    int32_t *experts = (int32_t *)s;
    s += al64((size_t)n_expert * 4);
    int64_t *count = (int64_t *)s; /* pairs per expert, then each expert's next slot */
    s += al64((size_t)(n_expert + 1) * 8);
    int64_t *starts = (int64_t *)s;
    memset(count, 0, (size_t)(n_expert + 1) * 8);
    for (int64_t p = 0; p < n; p++) {
        if (idx[p] < 0 || idx[p] >= n_expert) return -2;
        count[idx[p]]++;
    }
    int ng = 0;
    int64_t at = 0;
    for (int64_t e = 0; e < n_expert; e++) {
        if (!count[e]) continue;
        experts[ng] = (int32_t)e;
        starts[ng++] = at;
        const int64_t m = count[e];
        count[e] = at; /* where expert e's next pair goes */
        at += m;
    }
    starts[ng] = n;
    for (int64_t p = 0; p < n; p++) order[count[idx[p]]++] = (int32_t)p; /* stable: pairs in token order */
    for (int64_t q = 0; q < n; q++)
        memcpy(xs + (size_t)q * (size_t)xr, (const uint8_t *)xq + (size_t)(order[q] / k) * (size_t)xq_row, (size_t)xr);
    for (int64_t t = 0; t < ns; t++) /* the shared expert's rows: every token, in order */
        memcpy(xs + (size_t)(n + t) * (size_t)xr, (const uint8_t *)xq + (size_t)t * (size_t)xq_row, (size_t)xr);
    const int gu_qt[2] = {gate_qt, up_qt}, d_qt[1] = {down_qt};
    const void *gu_w[2] = {wg, wu}, *d_w[1] = {wd}, *sgu_w[2] = {sg, su}, *sd_w[1] = {sd};
    float *gu_out[2] = {eg, eu}, *d_out[1] = {out};
    float *sgu_out[2] = {eg + (size_t)n * (size_t)e_row, eu + (size_t)n * (size_t)e_row}, *sd_out[1] = {s_out};
    int rc = hi_moe_grouped(c, 2, gu_qt, gu_w, n_expert, n_ff, n_embd, xs, xr, n + ns, ng, experts, starts, gu_out,
                            e_row, ggml_op, sg ? sgu_w : NULL, ns, sgu_out, sop);
    if (!rc) rc = hi_swiglu(c, eg, e_row, eu, e_row, eg, e_row, n + ns, n_ff);
    if (!rc) rc = hi_quantize(c, down_qt, eg, e_row, n + ns, n_ff, hq, hq_row);
    if (!rc) rc = hi_moe_grouped(c, 1, d_qt, d_w, n_expert, n_embd, n_ff, hq, hq_row, n + ns, ng, experts, starts,
                                 d_out, n_embd, ggml_op, sg ? sd_w : NULL, ns, sd_out, sop);
    if (rc) return rc;
    for (int64_t q = 0; q < n; q++)
        memcpy(ys + (size_t)order[q] * (size_t)ys_row, out + q * n_embd, (size_t)n_embd * 4);
    return 0;
}

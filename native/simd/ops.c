/* The small ops between the matrix products, on the calling thread (sigmoid_gate, one scalar
 * expf per value, in segments on the pool): the C twins of the numba ops in tests/oracles/numba_ops.py, bit-identical
 * to them (tests/test_simd_ops.py). Plain float code compiled with -ffp-contract=off: each product, sum and
 * narrowing happens as written (ggml's order where ops.py says so), and only element-wise loops may vectorize (a
 * vectorized element-wise loop rounds as the scalar one).
 *
 *   rms_norm:     s = 1.0f / sqrtf((float)(sum_i (double)(x_i * x_i) / n) + (float)eps);  out_i = (x_i * s) * w_i
 *   sigmoid_gate: o_i = o_i * (1.0f / (1.0f + expf(-g_i)))
 *   moe_route:    p_e = exp(l_e - max l) / sum_e exp(l_e - max l) in double; top k (ties: lower e);
 *                 w_j = (float)(p_j / max(sum_j p_j, 2^-14))
 *   moe_combine:  out = y_0 * w_0; out += y_j * w_j (j = 1..k-1); shared: out += s * (1.0f / (1.0f +
 *                 expf(-(float)(sum_i (double)x_i * (double)w_i))))
 * These cost microseconds; what they save is the return to Python between the products (replay.c). SwiGLU
 * (attn.c) and the combine's sums run in segments on the pool: element-wise, so any split gives the same bits;
 * rms_norm over a prompt's rows, a row a task.
 */
#include <math.h>
#include <string.h>

#include "hi_internal.h"
#include "hi_simd.h"

#define HI_ROUTE_DENOM_MIN 6.103515625e-5 /* llama.cpp clamps the top-k weight sum (2^-14) */

typedef struct {
    float *h, *out;
    const float *y, *w;
    int64_t h_row, y_row, out_row, H, n;
    float e;
} rn_job;

/* token t's row: the residual added, then each of its H norms (a row is one task: no sum is split) */
static void rn_row(void *arg, int64_t t, int64_t e0, int64_t e1) {
    (void)e0;
    (void)e1;
    const rn_job *j = (const rn_job *)arg;
    float *ht = j->h + t * j->h_row;
    if (j->y) {
        const float *yt = j->y + t * j->y_row;
        for (int64_t i = 0; i < j->H * j->n; i++) ht[i] += yt[i];
    }
    if (!j->w) return;
    for (int64_t hh = 0; hh < j->H; hh++) {
        const float *x = ht + hh * j->n;
        float *o = j->out + t * j->out_row + hh * j->n;
        const float s = hi_rms_scale(x, j->n, j->e);
        for (int64_t i = 0; i < j->n; i++) o[i] = (x[i] * s) * j->w[i];
    }
}

/* a prompt's rows on the pool (a decode token's one row on the calling thread) */
int hi_rms_norm(hi_ctx *c, float *h, int64_t h_row, const float *y, int64_t y_row, int64_t T, int64_t H, int64_t n,
                const float *w, double eps, float *out, int64_t out_row) {
    if (!c || !h || T < 1 || H < 1 || n < 1 || h_row < H * n || (y && y_row < H * n) || (w && (!out || out_row < H * n)))
        return -2;
    rn_job j = {h, out, y, w, h_row, y_row, out_row, H, n, (float)eps};
    hi_ctx_run_rows(c, rn_row, &j, T, H * n, H * n);
    return 0;
}

int hi_split_qgate(hi_ctx *c, const float *qg, int64_t qg_row, int64_t T, int64_t H, int64_t hd, float *q,
                   float *gate, int64_t gate_row) {
    const int64_t w = gate ? 2 * hd : hd;
    if (!c || !qg || !q || T < 1 || H < 1 || hd < 1 || qg_row < H * w || (gate && gate_row < H * hd)) return -2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *src = qg + t * qg_row + h * w;
            memcpy(q + (t * H + h) * hd, src, (size_t)hd * sizeof(float));
            if (gate) memcpy(gate + t * gate_row + h * hd, src + hd, (size_t)hd * sizeof(float));
        }
    return 0;
}

typedef struct {
    float *o;
    const float *g;
    int64_t o_row, g_row;
} sg_job;

static void sg_seg(void *arg, int64_t t, int64_t e0, int64_t e1) {
    const sg_job *j = (const sg_job *)arg;
    float *o = j->o + t * j->o_row;
    const float *g = j->g + t * j->g_row;
    for (int64_t i = e0; i < e1; i++) o[i] = o[i] * hi_sigmoidf(g[i]);
}

/* libm's expf is scalar (~10-20 ns): segments of 256 values on the pool */
int hi_sigmoid_gate(hi_ctx *c, float *o, int64_t o_row, const float *g, int64_t g_row, int64_t T, int64_t n) {
    if (!c || !o || !g || T < 1 || n < 1 || o_row < n || g_row < n) return -2;
    sg_job j = {o, g, o_row, g_row};
    hi_ctx_run_rows(c, sg_seg, &j, T, n, 256);
    return 0;
}

/* p_e of one row: exp(l_e - m) / tot, each computed once when the row fits (the same bits as computed again) */
#define HI_ROUTE_MAX_CACHED 4096

int hi_moe_route(hi_ctx *c, const float *logits, int64_t l_row, int64_t T, int64_t E, int k, int32_t *idx,
                 float *w) {
    if (!c || !logits || !idx || !w || T < 1 || E < 1 || k < 1 || k > E || l_row < E) return -2;
    double pc[HI_ROUTE_MAX_CACHED];
    const int cached = E <= HI_ROUTE_MAX_CACHED;
    for (int64_t t = 0; t < T; t++) {
        const float *lg = logits + t * l_row;
        int32_t *ids = idx + t * k;
        double m = lg[0];
        for (int64_t e = 1; e < E; e++)
            if (lg[e] > m) m = lg[e];
        double tot = 0.0;
        for (int64_t e = 0; e < E; e++) {
            const double x = exp((double)lg[e] - m);
            if (cached) pc[e] = x;
            tot += x;
        }
#define HI_P(e) ((cached ? pc[e] : exp((double)lg[e] - m)) / tot)
        int n = 0; /* ids[0..n) sorted by p, best first; strict > keeps the lower id ahead on ties */
        double p_last = 0.0;
        for (int64_t e = 0; e < E; e++) {
            const double pe = HI_P(e);
            if (n == k && pe <= p_last) continue;
            int pos = n < k ? n : k - 1;
            while (pos > 0 && pe > HI_P(ids[pos - 1])) {
                if (pos < k) ids[pos] = ids[pos - 1];
                pos--;
            }
            ids[pos] = (int32_t)e;
            if (n < k) n++;
            p_last = HI_P(ids[n - 1]);
        }
        double den = 0.0;
        for (int j = 0; j < k; j++) den += HI_P(ids[j]);
        if (den < HI_ROUTE_DENOM_MIN) den = HI_ROUTE_DENOM_MIN;
        for (int j = 0; j < k; j++) w[t * k + j] = (float)(HI_P(ids[j]) / den);
#undef HI_P
    }
    return 0;
}

typedef struct {
    const float *ys, *w, *s;
    const float *gates; /* per token: the shared expert's gate (s non-NULL) */
    int k;
    int64_t n;
    float *out;
} combine_job;

static void combine_seg(void *arg, int64_t t, int64_t e0, int64_t e1) {
    const combine_job *j = (const combine_job *)arg;
    const int k = j->k;
    const int64_t n = j->n;
    float *o = j->out + t * n;
    const float *y = j->ys + t * k * n;
    const float w0 = j->w[t * k];
    for (int64_t i = e0; i < e1; i++) o[i] = y[i] * w0;
    for (int jj = 1; jj < k; jj++) {
        const float *yj = j->ys + (t * k + jj) * n;
        const float wj = j->w[t * k + jj];
        for (int64_t i = e0; i < e1; i++) o[i] += yj[i] * wj;
    }
    if (!j->s) return;
    const float *st = j->s + t * n, g = j->gates[t];
    for (int64_t i = e0; i < e1; i++) o[i] += st[i] * g;
}

/* tokens whose gates fit on the stack run in segments of HI_COMBINE_SEG values on the pool, more in groups */
#define HI_COMBINE_MAX_T 64
#define HI_COMBINE_SEG 512

int hi_moe_combine(hi_ctx *c, const float *ys, const float *w, int64_t T, int k, int64_t n, float *out,
                   const float *s, const float *x, const float *w_shg) {
    if (!c || !ys || !w || !out || T < 1 || k < 1 || n < 1 || (s && (!x || !w_shg))) return -2;
    float gates[HI_COMBINE_MAX_T];
    for (int64_t t0 = 0; t0 < T; t0 += HI_COMBINE_MAX_T) {
        const int64_t nt = T - t0 < HI_COMBINE_MAX_T ? T - t0 : HI_COMBINE_MAX_T;
        for (int64_t t = 0; s && t < nt; t++) {
            const float *xt = x + (t0 + t) * n;
            double acc = 0.0;
            for (int64_t i = 0; i < n; i++) acc += (double)xt[i] * (double)w_shg[i];
            gates[t] = hi_sigmoidf((float)acc);
        }
        combine_job j = {ys + t0 * k * n, w + t0 * k, s ? s + t0 * n : NULL, gates, k, n, out + t0 * n};
        hi_ctx_run_rows(c, combine_seg, &j, nt, n, HI_COMBINE_SEG);
    }
    return 0;
}

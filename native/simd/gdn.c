/* The Gated DeltaNet layer after its projections (docs/gguf-qwen35.md §3 steps 2-8) on the context's thread
 * pool: the C twin of tests/oracles/numba_gdn.py:gdn_layer, bit-identical to it.
 *
 * Same float operations in the same order as the numba code (fastmath=False; this file is compiled with
 * -ffp-contract=off and without -ffast-math, so no fused or reordered arithmetic):
 *   conv + SiLU: float32 accumulation acc += conv * w over the K-1 state rows then u * w_{K-1};
 *                c = acc / (1 + expf(-acc))
 *   L2 norm of a q/k head: float64 sum of squares, c = (float)((double)c / sqrt(s + eps)); query heads then
 *                c / (float)sqrt((double)d_k)
 *   gates: x = a + dt_bias; sp = x > 20 ? x : log1pf(expf(x)); alpha = expf(ssm_a * sp);
 *          beta = 1 / (1 + expf(-b))          (numba's float32 math.exp / math.log1p call expf / log1pf)
 *   delta rule, float32: S *= alpha, delta += k_i S_i (i ascending); delta = beta (v - delta);
 *                S += k_i delta, o += q_i S_i
 *   gated RMSNorm (ggml's rounding): float32 squares summed in float64, mean narrowed to float32,
 *                sc = 1 / sqrtf(mean + (float)eps); o = ((o sc) w) (z / (1 + expf(-z)))
 * The delta rule runs on column blocks of GDN_EB lanes of S[j] (lane accumulators in registers, the block
 * in L1, whole rows prefetched ahead while the first block streams S[j] in): every lane still sums over i
 * ascending, so the blocking, and the vectorization of the loops over lanes (elementwise: no sum is split),
 * change no result; the avx2 copies of the loops give the same bits as the baseline ones.
 *
 * Work split: per chunk of tokens (as many as the scratch holds, like the numba op), first the conv channels
 * in blocks (a block is a whole number of d_k heads, so it also L2-normalises the q/k heads inside it),
 * then the value heads, one pool chunk per head running all tokens of the chunk in order. Each value is
 * computed by one thread in a fixed order, so the result does not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>

#include "hi_internal.h"
#include "hi_simd.h"

#define GDN_CONV_BLOCK 512 /* channels per conv task (rounded to whole d_k heads) */
#define GDN_EB 32          /* lanes of d_v per register block of the delta rule */
#define GDN_PF 16          /* rows of S[j] prefetched ahead by the first block */

typedef struct {
    const float *u, *z, *b, *a, *conv_w, *ssm_a, *dt_bias, *norm_w;
    float *conv, *S, *y, *dbuf, *c;
    const float *conv_in, *S_in; /* NULL: in place; else the state before token 0, never written */
    int64_t u_row, z_row, b_row, a_row, y_row;
    int64_t t0, nt, C, K, Hv, dk, dv, Hk, block;
    int head_map_mod, avx2;
    double eps;
} gdn_args;

/* ------------------------------------------------------------------------------------------------ */
/* conv + SiLU of channels [ch0, ch1) for the chunk's tokens, then the L2 norms of the q/k heads inside */

static inline __attribute__((always_inline)) void gdn_conv_body(const gdn_args *g, int64_t ch0, int64_t ch1) {
    const int64_t C = g->C, K = g->K, dk = g->dk;
    float *conv = g->conv;
    const float *conv_w = g->conv_w;
    const float *cin = g->t0 == 0 && g->conv_in ? g->conv_in : conv; /* the window before this token */
    for (int64_t t = 0; t < g->nt; t++) {
        const float *ut = g->u + (g->t0 + t) * g->u_row;
        float *ct = g->c + t * C;
        for (int64_t ch = ch0; ch < ch1; ch++) {
            float acc = 0.0f;
            for (int64_t tau = 0; tau < K - 1; tau++) acc += cin[tau * C + ch] * conv_w[ch * K + tau];
            acc += ut[ch] * conv_w[ch * K + K - 1];
            ct[ch] = acc / (1.0f + expf(-acc));
        }
        for (int64_t tau = 0; tau < K - 2; tau++) /* ascending: in place each row is read before it is written */
            for (int64_t ch = ch0; ch < ch1; ch++) conv[tau * C + ch] = cin[(tau + 1) * C + ch];
        if (K > 1)
            for (int64_t ch = ch0; ch < ch1; ch++) conv[(K - 2) * C + ch] = ut[ch];
        cin = conv;
    }
    const int64_t nqk = 2 * g->Hk;
    for (int64_t t = 0; t < g->nt; t++) {
        float *ct = g->c + t * C;
        for (int64_t i = ch0 / dk; i < nqk && (i + 1) * dk <= ch1; i++) {
            float *h = ct + i * dk;
            double s = 0.0;
            for (int64_t d = 0; d < dk; d++) s += (double)h[d] * (double)h[d];
            const double den = sqrt(s + g->eps);
            for (int64_t d = 0; d < dk; d++) h[d] = (float)((double)h[d] / den);
            if (i < g->Hk) {
                const float qdiv = (float)sqrt((double)dk);
                for (int64_t d = 0; d < dk; d++) h[d] = h[d] / qdiv;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------ */
/* value head j of the chunk's tokens, in token order */

static inline __attribute__((always_inline)) void gdn_head_body(const gdn_args *g, int64_t j) {
    const int64_t Hv = g->Hv, dk = g->dk, dv = g->dv, Hk = g->Hk, C = g->C;
    const int64_t kh = g->head_map_mod ? j % Hk : j / (Hv / Hk);
    float *restrict Sj = g->S + j * dk * dv;
    /* out of place (a verify step): token 0 reads S_in's head j, writes S's; every later token works on S */
    const float *Sin = g->t0 == 0 && g->S_in && g->S_in != g->S ? g->S_in + j * dk * dv : NULL;
    float *restrict delta = g->dbuf + j * dv;
    const float *restrict nw = g->norm_w;
    for (int64_t t = 0; t < g->nt; t++) {
        const int64_t tt = g->t0 + t;
        const float *ct = g->c + t * C;
        const float *restrict q = ct + kh * dk;
        const float *restrict k = ct + (Hk + kh) * dk;
        const float *restrict v = ct + 2 * Hk * dk + j * dv;
        const float x = g->a[tt * g->a_row + j] + g->dt_bias[j];
        const float sp = x > 20.0f ? x : log1pf(expf(x));
        const float alpha = expf(g->ssm_a[j] * sp);
        const float beta = hi_sigmoidf(g->b[tt * g->b_row + j]);
        float *restrict o = g->y + tt * g->y_row + j * dv;
        /* the delta rule on column blocks of S[j] (GDN_EB lanes, held in registers, the block in L1): pass 1
         * S <- alpha S, delta <- S^T k, delta <- beta (v - delta); pass 2 S <- S + k delta^T, o <- S^T q.
         * Lane e of delta and o sums over i ascending as in numba_gdn, so blocking changes no result. */
        const float *restrict src = t == 0 ? Sin : NULL; /* non-NULL: pass 1 reads the old S there */
        int64_t e0 = 0;
        for (; e0 + GDN_EB <= dv; e0 += GDN_EB) {
            float d[GDN_EB], acc[GDN_EB];
            for (int ee = 0; ee < GDN_EB; ee++) d[ee] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                const float ki = k[i];
                if (e0 == 0 && t == 0 && i + GDN_PF < dk) /* S[j] from memory: fetch whole rows ahead */
                    for (int64_t p = GDN_EB; p < dv; p += 16) {
                        __builtin_prefetch(Sj + (i + GDN_PF) * dv + p, 1, 3);
                        if (src) __builtin_prefetch(src + (i + GDN_PF) * dv + p, 0, 3);
                    }
                float *restrict row = Sj + i * dv + e0;
                if (src) {
                    const float *restrict in = src + i * dv + e0;
                    for (int ee = 0; ee < GDN_EB; ee++) {
                        const float s = in[ee] * alpha;
                        row[ee] = s;
                        d[ee] += ki * s;
                    }
                } else {
                    for (int ee = 0; ee < GDN_EB; ee++) {
                        const float s = row[ee] * alpha;
                        row[ee] = s;
                        d[ee] += ki * s;
                    }
                }
            }
            for (int ee = 0; ee < GDN_EB; ee++) {
                d[ee] = beta * (v[e0 + ee] - d[ee]);
                acc[ee] = 0.0f;
            }
            for (int64_t i = 0; i < dk; i++) {
                const float ki = k[i], qi = q[i];
                float *restrict row = Sj + i * dv + e0;
                for (int ee = 0; ee < GDN_EB; ee++) {
                    const float s = row[ee] + ki * d[ee];
                    row[ee] = s;
                    acc[ee] += qi * s;
                }
            }
            for (int ee = 0; ee < GDN_EB; ee++) o[e0 + ee] = acc[ee];
        }
        if (e0 < dv) { /* the last dv % GDN_EB lanes, the same operations through memory */
            for (int64_t e = e0; e < dv; e++) delta[e] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                const float ki = k[i];
                float *restrict row = Sj + i * dv;
                if (src) {
                    const float *restrict in = src + i * dv;
                    for (int64_t e = e0; e < dv; e++) {
                        const float s = in[e] * alpha;
                        row[e] = s;
                        delta[e] += ki * s;
                    }
                } else {
                    for (int64_t e = e0; e < dv; e++) {
                        const float s = row[e] * alpha;
                        row[e] = s;
                        delta[e] += ki * s;
                    }
                }
            }
            for (int64_t e = e0; e < dv; e++) delta[e] = beta * (v[e] - delta[e]);
            for (int64_t e = e0; e < dv; e++) o[e] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                const float ki = k[i], qi = q[i];
                float *restrict row = Sj + i * dv;
                for (int64_t e = e0; e < dv; e++) {
                    const float s = row[e] + ki * delta[e];
                    row[e] = s;
                    o[e] += qi * s;
                }
            }
        }
        /* gated RMSNorm: ((o * scale) * w) * silu(z), scale as ggml's rms_norm (ops.rms_scale) */
        const float sc = hi_rms_scale(o, dv, (float)g->eps);
        const float *zj = g->z + tt * g->z_row + j * dv;
        for (int64_t e = 0; e < dv; e++) {
            const float zz = zj[e];
            o[e] = ((o[e] * sc) * nw[e]) * (zz / (1.0f + expf(-zz)));
        }
    }
}

static void gdn_conv_base(const gdn_args *g, int64_t ch0, int64_t ch1) { gdn_conv_body(g, ch0, ch1); }
static void gdn_head_base(const gdn_args *g, int64_t j) { gdn_head_body(g, j); }
__attribute__((target("avx2"))) static void gdn_conv_avx2(const gdn_args *g, int64_t ch0, int64_t ch1) {
    gdn_conv_body(g, ch0, ch1);
}
__attribute__((target("avx2"))) static void gdn_head_avx2(const gdn_args *g, int64_t j) { gdn_head_body(g, j); }

static void gdn_conv_chunk(void *arg, int64_t blk) {
    const gdn_args *g = (const gdn_args *)arg;
    const int64_t ch0 = blk * g->block;
    const int64_t ch1 = ch0 + g->block < g->C ? ch0 + g->block : g->C;
    if (g->avx2) gdn_conv_avx2(g, ch0, ch1);
    else gdn_conv_base(g, ch0, ch1);
}

static void gdn_head_chunk(void *arg, int64_t j) {
    const gdn_args *g = (const gdn_args *)arg;
    if (g->avx2) gdn_head_avx2(g, j);
    else gdn_head_base(g, j);
}

/* the shared checks and the arguments of one sequence's call (the conv state and S set by the caller) */
static int gdn_init(gdn_args *g, hi_ctx *ctx, const float *u, int64_t u_row, const float *z, int64_t z_row,
                    const float *b, int64_t b_row, const float *a, int64_t a_row, const float *conv_w,
                    const float *ssm_a, const float *dt_bias, const float *norm_w, int64_t C, int64_t K, int64_t Hv,
                    int64_t d_k, int64_t d_v, int64_t Hk, int head_map_mod, double eps, float *y, int64_t y_row,
                    float *scratch, int64_t scratch_len) {
    if (!ctx || !u || !z || !b || !a || !conv_w || !ssm_a || !dt_bias || !norm_w || !y || !scratch) return -2;
    if (K < 1 || Hv < 1 || Hk < 1 || d_k < 1 || d_v < 1 || Hv % Hk) return -2;
    if (C != 2 * Hk * d_k + Hv * d_v) return -2;
    if (u_row < C || z_row < Hv * d_v || b_row < Hv || a_row < Hv || y_row < Hv * d_v) return -2;
    if (scratch_len < Hv * d_v + C) return -2;
    int64_t block = (GDN_CONV_BLOCK / d_k) * d_k;
    if (block < d_k) block = d_k;
    *g = (gdn_args){.u = u, .z = z, .b = b, .a = a, .conv_w = conv_w, .ssm_a = ssm_a, .dt_bias = dt_bias,
                    .norm_w = norm_w, .y = y, .dbuf = scratch, .c = scratch + Hv * d_v, .u_row = u_row,
                    .z_row = z_row, .b_row = b_row, .a_row = a_row, .y_row = y_row, .C = C, .K = K, .Hv = Hv,
                    .dk = d_k, .dv = d_v, .Hk = Hk, .block = block, .head_map_mod = head_map_mod != 0,
                    .avx2 = hi_ctx_isa(ctx) >= HI_ISA_AVX2, .eps = eps};
    return 0;
}

int hi_gdn_layer(hi_ctx *ctx, const float *u, int64_t u_row, const float *z, int64_t z_row, const float *b,
                 int64_t b_row, const float *a, int64_t a_row, const float *conv_w, const float *ssm_a,
                 const float *dt_bias, const float *norm_w, float *conv, float *S, int64_t T, int64_t C, int64_t K,
                 int64_t n_v_heads, int64_t d_k, int64_t d_v, int64_t n_k_heads, int head_map_mod, double eps,
                 float *y, int64_t y_row, float *scratch, int64_t scratch_len, const float *conv_in,
                 const float *S_in) {
    gdn_args g;
    const int rc = gdn_init(&g, ctx, u, u_row, z, z_row, b, b_row, a, a_row, conv_w, ssm_a, dt_bias, norm_w, C, K,
                            n_v_heads, d_k, d_v, n_k_heads, head_map_mod, eps, y, y_row, scratch, scratch_len);
    if (rc) return rc;
    if (T < 1 || !S || (K > 1 && !conv)) return -2;
    g.conv = conv;
    g.S = S;
    g.conv_in = conv_in;
    g.S_in = S_in;
    const int64_t Tc = (scratch_len - n_v_heads * d_v) / C;
    const int64_t nblk = (C + g.block - 1) / g.block;
    hi_ctx_lock(ctx);
    for (int64_t t0 = 0; t0 < T; t0 += Tc) {
        g.t0 = t0;
        g.nt = T - t0 < Tc ? T - t0 : Tc;
        hi_ctx_run(ctx, gdn_conv_chunk, &g, nblk);
        hi_ctx_run(ctx, gdn_head_chunk, &g, n_v_heads);
    }
    hi_ctx_unlock(ctx);
    return 0;
}

/* ---- one token of each of B sequences (decode_batch): every sequence's conv blocks, then every (sequence, value
 * head), each a task of one pool run, so the pool wakes twice for all of them */

#define GDN_ROWS_MAX 64 /* sequences per pair of pool runs (their arguments on the stack) */

typedef struct {
    const gdn_args *g;
    int64_t per;
} gdn_many;

static void gdn_conv_many(void *arg, int64_t i) {
    const gdn_many *m = (const gdn_many *)arg;
    gdn_conv_chunk((void *)&m->g[i / m->per], i % m->per);
}

static void gdn_head_many(void *arg, int64_t i) {
    const gdn_many *m = (const gdn_many *)arg;
    gdn_head_chunk((void *)&m->g[i / m->per], i % m->per);
}

int hi_gdn_rows(hi_ctx *ctx, int64_t B, const float *u, int64_t u_row, const float *z, int64_t z_row, const float *b,
                int64_t b_row, const float *a, int64_t a_row, const float *conv_w, const float *ssm_a,
                const float *dt_bias, const float *norm_w, float *const *conv, float *const *S, int64_t C, int64_t K,
                int64_t n_v_heads, int64_t d_k, int64_t d_v, int64_t n_k_heads, int head_map_mod, double eps,
                float *y, int64_t y_row, float *scratch, int64_t scratch_len) {
    const int64_t per = n_v_heads * d_v + C; /* scratch floats of one sequence */
    if (B < 1 || !conv || !S || scratch_len < B * per) return -2;
    gdn_args g[GDN_ROWS_MAX];
    for (int64_t j0 = 0; j0 < B; j0 += GDN_ROWS_MAX) {
        const int64_t nb = B - j0 < GDN_ROWS_MAX ? B - j0 : GDN_ROWS_MAX;
        for (int64_t i = 0; i < nb; i++) {
            const int64_t j = j0 + i;
            const int rc = gdn_init(&g[i], ctx, u + j * u_row, u_row, z + j * z_row, z_row, b + j * b_row, b_row,
                                    a + j * a_row, a_row, conv_w, ssm_a, dt_bias, norm_w, C, K, n_v_heads, d_k, d_v,
                                    n_k_heads, head_map_mod, eps, y + j * y_row, y_row, scratch + j * per, per);
            if (rc) return rc;
            if (!S[j] || (K > 1 && !conv[j])) return -2;
            g[i].conv = conv[j];
            g[i].S = S[j];
            g[i].t0 = 0;
            g[i].nt = 1;
        }
        const int64_t nblk = (C + g[0].block - 1) / g[0].block;
        gdn_many mc = {g, nblk}, mh = {g, n_v_heads};
        hi_ctx_lock(ctx);
        hi_ctx_run(ctx, gdn_conv_many, &mc, nb * nblk);
        hi_ctx_run(ctx, gdn_head_many, &mh, nb * n_v_heads);
        hi_ctx_unlock(ctx);
    }
    return 0;
}

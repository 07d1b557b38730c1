/* hi_swiglu and hi_rope: row ops on the context's thread pool (hi_rope_rows also ropes attention's q and new K
 * rows, attn.c). Split from attn.c, whose attention they stand beside in a layer. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "hi_internal.h"
#include "hi_simd.h"

typedef struct {
    const hi_kernels *k;
    const float *g, *u;
    float *out;
    int64_t g_row, u_row, out_row;
} swiglu_job;

static void swiglu_seg(void *arg, int64_t t, int64_t e0, int64_t e1) {
    const swiglu_job *j = (const swiglu_job *)arg;
    j->k->swiglu(j->g + t * j->g_row + e0, j->u + t * j->u_row + e0, j->out + t * j->out_row + e0, e1 - e0);
}

/* segments of HI_SWIGLU_SEG values on the pool: a multiple of every unit's vector width, so each value takes the
 * vector or the scalar tail path it takes in a whole row (the same bits) */
#define HI_SWIGLU_SEG 512

int hi_swiglu(hi_ctx *c, const float *g, int64_t g_row, const float *u, int64_t u_row, float *out, int64_t out_row,
              int64_t T, int64_t n) {
    if (!c || !g || !u || !out || T < 1 || n < 1 || g_row < n || u_row < n || out_row < n) return -2;
    swiglu_job j = {hi_ctx_kernels(c), g, u, out, g_row, u_row, out_row};
    hi_ctx_run_rows(c, swiglu_seg, &j, T, n, HI_SWIGLU_SEG);
    return 0;
}

/* ggml's rope (ggml_rope_cache_init + rotate_pairs, no YaRN scaling): theta_scale = powf(base, -2/n_rot);
 * theta starts at (float)pos and is multiplied by theta_scale once per pair; cosf / sinf of theta / ff; the
 * rotation as the llama.cpp build compiles x0 * c - x1 * s and x0 * s + x1 * c: contracted where it has FMA (the
 * AVX2 and AVX-512 units: x0' = fmaf(x0, c, -(x1 * s)), x1' = fmaf(x0, s, x1 * c)), two products and a sum
 * below AVX2 (ggml built for SSE4.2 or baseline x86-64 has no FMA). */
#define HI_ROPE_MAX_PAIRS 1024

/* mrope (NULL: plain positions): n_rot/2 stream indexes (0..3, models/mrope.imrope_streams: which of a row's four
 * positions each pair takes, llama.cpp's IMROPE sectors), then 4 positions per row. As ggml_mrope_cache_init, each
 * stream's theta starts at its position and all four are multiplied by theta_scale once per pair, so a row whose
 * four positions are equal gets the plain rope's bits. Otherwise row t is at pos0 + t + shift. */
int hi_rope_rows(hi_ctx *c, float *x, int64_t T, int64_t H, int64_t hd, int64_t pos0, int64_t shift,
                 const int32_t *mrope, int64_t n_rot, float theta_base, int neox, const float *freq_factors) {
    if (!c || !x || T < 1 || H < 1 || hd < 1 || n_rot < 2 || n_rot > hd || n_rot % 2 || n_rot / 2 > HI_ROPE_MAX_PAIRS)
        return -2;
    const int64_t half = n_rot / 2;
    const int fused = hi_ctx_kernels(c)->isa >= HI_ISA_AVX2;
    const float theta_scale = powf(theta_base, -2.0f / (float)n_rot);
    float cs[HI_ROPE_MAX_PAIRS], sn[HI_ROPE_MAX_PAIRS];
    if (mrope)
        for (int64_t i = 0; i < half; i++)
            if (mrope[i] < 0 || mrope[i] > 3) return -2;
    for (int64_t t = 0; t < T; t++) {
        if (mrope) {
            const int32_t *p = mrope + half + 4 * t;
            float th[4] = {(float)p[0], (float)p[1], (float)p[2], (float)p[3]};
            for (int64_t i = 0; i < half; i++) {
                const float theta = th[mrope[i]];
                const float tf = freq_factors ? theta / freq_factors[i] : theta;
                cs[i] = cosf(tf);
                sn[i] = sinf(tf);
                for (int s = 0; s < 4; s++) th[s] *= theta_scale;
            }
        } else {
            float theta = (float)(pos0 + t + shift);
            for (int64_t i = 0; i < half; i++) {
                const float th = freq_factors ? theta / freq_factors[i] : theta;
                cs[i] = cosf(th);
                sn[i] = sinf(th);
                theta *= theta_scale;
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float *r = x + (t * H + h) * hd;
            for (int64_t i = 0; i < half; i++) {
                const int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                const float x0 = r[i0], x1 = r[i1];
                if (fused) {
                    r[i0] = fmaf(x0, cs[i], -(x1 * sn[i]));
                    r[i1] = fmaf(x0, sn[i], x1 * cs[i]);
                } else {
                    r[i0] = x0 * cs[i] - x1 * sn[i];
                    r[i1] = x0 * sn[i] + x1 * cs[i];
                }
            }
        }
    }
    return 0;
}

int hi_rope(hi_ctx *c, float *x, int64_t T, int64_t H, int64_t hd, int64_t pos0, int64_t n_rot, float theta_base,
            int neox, const float *freq_factors) {
    return hi_rope_rows(c, x, T, H, hd, pos0, 0, NULL, n_rot, theta_base, neox, freq_factors);
}

int hi_rope_multi(hi_ctx *c, float *x, int64_t T, int64_t H, int64_t hd, int64_t pos0, int64_t shift,
                  const int32_t *mrope, int64_t n_rot, float theta_base, int neox, const float *freq_factors) {
    return hi_rope_rows(c, x, T, H, hd, pos0, shift, mrope, n_rot, theta_base, neox, freq_factors);
}

/* ---- hi_copy_many: several buffers copied in segments over the pool (a verify step's copies of the recurrent
 * state: tens of MiB, which one thread copies at a fraction of what the cores together do; and of its GDN calls'
 * row inputs, views of wider rows, as a step of the recorded pass instead of a return to Python) */

#define HI_COPY_SEG ((int64_t)256 << 10)
#define HI_COPY_MAX 1024

typedef struct {
    void *const *dst;
    const void *const *src;
    const int64_t *dst_row, *src_row, *rows, *row_bytes;
    int64_t first[HI_COPY_MAX + 1]; /* buffer i's segments are [first[i], first[i + 1]) */
    int64_t per[HI_COPY_MAX];       /* rows a segment (one row: bytes of HI_COPY_SEG) */
    int64_t n;
} copy_job;

static void copy_seg(void *arg, int64_t s) {
    const copy_job *j = (const copy_job *)arg;
    int64_t lo = 0, hi = j->n; /* the buffer whose segments hold s: first[lo] <= s < first[lo + 1] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (j->first[mid] <= s) lo = mid;
        else hi = mid;
    }
    const int64_t k = s - j->first[lo], rb = j->row_bytes[lo];
    char *d = (char *)j->dst[lo];
    const char *x = (const char *)j->src[lo];
    if (j->rows[lo] == 1) { /* one row: segments of its bytes */
        const int64_t off = k * HI_COPY_SEG, len = rb - off < HI_COPY_SEG ? rb - off : HI_COPY_SEG;
        memcpy(d + off, x + off, (size_t)len);
        return;
    }
    const int64_t r0 = k * j->per[lo], r1 = r0 + j->per[lo] < j->rows[lo] ? r0 + j->per[lo] : j->rows[lo];
    for (int64_t r = r0; r < r1; r++) memcpy(d + r * j->dst_row[lo], x + r * j->src_row[lo], (size_t)rb);
}

int hi_copy_many(hi_ctx *c, int64_t n, void *const *dst, const int64_t *dst_row, const void *const *src,
                 const int64_t *src_row, const int64_t *rows, const int64_t *row_bytes) {
    if (!c || n < 0 || n > HI_COPY_MAX || (n && (!dst || !src || !dst_row || !src_row || !rows || !row_bytes)))
        return -2;
    copy_job *j = (copy_job *)malloc(sizeof(copy_job));
    if (!j) return -3;
    *j = (copy_job){.dst = dst, .src = src, .dst_row = dst_row, .src_row = src_row, .rows = rows,
                    .row_bytes = row_bytes, .n = n};
    for (int64_t i = 0; i < n; i++) {
        const int64_t R = rows[i], rb = row_bytes[i];
        if (R < 0 || rb < 0 || (R > 1 && (dst_row[i] < rb || src_row[i] < rb)) || (R && rb && (!dst[i] || !src[i]))) {
            free(j);
            return -2;
        }
        int64_t segs;
        if (R == 1) {
            j->per[i] = 1;
            segs = (rb + HI_COPY_SEG - 1) / HI_COPY_SEG;
        } else {
            j->per[i] = rb >= HI_COPY_SEG ? 1 : (rb ? HI_COPY_SEG / rb : R);
            segs = rb ? (R + j->per[i] - 1) / j->per[i] : 0;
        }
        j->first[i + 1] = j->first[i] + segs;
    }
    const int64_t total = j->first[n];
    hi_ctx_lock(c);
    if (total > 1) hi_ctx_run(c, copy_seg, j, total);
    else if (total == 1) copy_seg(j, 0);
    hi_ctx_unlock(c);
    free(j);
    return 0;
}

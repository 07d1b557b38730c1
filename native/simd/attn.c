/* hi_attention: causal attention over an F32 K/V cache on the context's thread pool. The arithmetic is the ISA
 * table's `attn` (kernels_attn.h: llama.cpp's float operations); this file only splits the (token, head)
 * query rows into contiguous ranges, one per pool chunk, each with its own slice of the caller's scratch.
 * Every row is computed by one thread in a fixed order, so the result does not depend on the thread count.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "hi_internal.h"
#include "hi_simd.h"

#define HI_ATTN_MAX_CHUNKS 64
/* products below which one thread does the whole call (waking the pool costs more) */
#define HI_ATTN_INLINE_MACS (1 << 16)

typedef struct {
    const hi_kernels *k;
    hi_attn a;
    int64_t rows, per, chunks, chunk_scratch;
    float *scratch;
} attn_job;

static void attn_chunk(void *arg, int64_t i) {
    const attn_job *j = (const attn_job *)arg;
    const int64_t r0 = i * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    if (r0 < r1) j->k->attn(&j->a, r0, r1, j->scratch + i * j->chunk_scratch);
}

static int64_t attn_max_chunks(const hi_ctx *c) {
    const int64_t n = 2 * (int64_t)hi_ctx_threads(c);
    return n < HI_ATTN_MAX_CHUNKS ? n : HI_ATTN_MAX_CHUNKS;
}

/* the split of `rows` query rows (G consecutive rows of a token share a K/V head) into pool chunks: rows per chunk
 * (*per) and rows computed together (*slots: G where there are enough such groups to keep every thread busy and
 * scratch for G rows per chunk, else 1); the chunk count, at most attn_max_chunks and one per unit, one alone
 * when the call is too small to wake the pool (inline); < 1 when the scratch is too small */
static int64_t attn_split(const hi_ctx *c, int64_t rows, int64_t G, int64_t row_scratch, int64_t scratch_len,
                          int inline_call, int64_t *per, int64_t *slots) {
    const int64_t fits = scratch_len / row_scratch, most = inline_call ? 1 : attn_max_chunks(c);
    int64_t R = 1;
    if (G > 1 && rows % G == 0 && rows / G >= (int64_t)hi_ctx_threads(c) && fits / G >= (most < rows / G ? most : rows / G))
        R = G;
    const int64_t units = rows / R;
    int64_t n = fits / R < most ? fits / R : most;
    if (n > units) n = units;
    if (n < 1) return n;
    *slots = R;
    *per = (units + n - 1) / n * R;
    return (rows + *per - 1) / *per;
}

int64_t hi_attention_scratch(const hi_ctx *c, int64_t n_ctx, int64_t hd, int64_t group) {
    if (!c || n_ctx < 1 || hd < 1 || group < 1) return -2;
    return attn_max_chunks(c) * group * hi_ctx_kernels(c)->attn_scratch(n_ctx, hd);
}

/* bytes of one cache position's row of Hkv heads of hd values in cache type t; -1: no cache holds t (or hd does not
 * divide into its blocks) */
static int64_t kv_row_bytes(int t, int64_t Hkv, int64_t hd) {
    switch (t) {
    case HI_T_F32: return Hkv * hd * 4;
    case HI_T_F16: return Hkv * hd * 2;
    case HI_T_Q8_0: return hd % 32 ? -1 : Hkv * hd / 32 * (int64_t)sizeof(block_q8_0);
    case HI_T_Q4_0: return hd % 32 ? -1 : Hkv * hd / 32 * (int64_t)sizeof(block_q4_0);
    case HI_T_LM3: return hd % 32 ? -1 : Hkv * hd / 32 * HI_LM3_BYTES;
    case HI_T_LM4: return hd % 32 ? -1 : Hkv * hd / 32 * HI_LM4_BYTES;
    default: return -1;
    }
}

/* ---- typed caches: work units of (job, token, context chunk, rows of one K/V head) */

#define HI_FA_CHUNK 1024 /* positions per context chunk of a long row */
/* a row over more positions is split into chunks computed apart and merged (llama.cpp's split decode): a rule of the
 * row's own length alone, so no bit depends on the thread count, the batch or the other rows of the call */
#define HI_FA_SPLIT 2048
#define HI_FA_PART_FLOATS ((int64_t)8 << 20) /* partials held at once (32 MiB): longer calls go in waves */

static int64_t fa_chunks(int64_t n) { return n > HI_FA_SPLIT ? (n + HI_FA_CHUNK - 1) / HI_FA_CHUNK : 1; }

/* pool chunks of a typed call: finer than attn_max_chunks, since a long row's units are many and alike and the pool
 * hands chunks out as threads come free; at two a thread one slow thread kept the call's tail to itself (one 32K q8_0
 * decode row, 16 threads of the 16-core host: 1.07 -> 0.91 ms). Any grouping of units gives the same bits. */
#define HI_FA_MAX_CHUNKS 256
static int64_t fa_max_chunks(const hi_ctx *c) {
    const int64_t n = 4 * (int64_t)hi_ctx_threads(c);
    return n < HI_FA_MAX_CHUNKS ? n : HI_FA_MAX_CHUNKS;
}

typedef struct {
    int64_t j, t, nc, u0, part; /* job, token, context chunks, first unit, offset of its partials (floats) */
} fa_pair;

typedef struct {
    const hi_kernels *k;
    const hi_attn *a; /* per job */
    const fa_pair *pairs;
    int64_t npairs, R, upc, units, per, unit_scratch; /* R rows a unit, upc units per (pair, chunk) */
    float *scratch, *part;
} fa_job;

static void fa_chunk_run(void *arg, int64_t i) {
    const fa_job *f = (const fa_job *)arg;
    const int64_t u0 = i * f->per, u1 = u0 + f->per < f->units ? u0 + f->per : f->units;
    float *scratch = f->scratch + i * f->unit_scratch;
    int64_t p = 0, lo = 0, hi = f->npairs - 1;
    while (lo <= hi) { /* the last pair starting at or before u0 */
        const int64_t mid = (lo + hi) / 2;
        if (f->pairs[mid].u0 <= u0) p = mid, lo = mid + 1;
        else hi = mid - 1;
    }
    for (int64_t u = u0; u < u1; u++) {
        while (p + 1 < f->npairs && f->pairs[p + 1].u0 <= u) p++;
        const fa_pair *pr = &f->pairs[p];
        const hi_attn *a = &f->a[pr->j];
        const int64_t local = u - pr->u0, c = local / f->upc, h0 = (local % f->upc) * f->R;
        const int64_t n = a->pos0 + pr->t + 1, s0 = c * HI_FA_CHUNK;
        const int64_t s1 = pr->nc == 1 ? n : (s0 + HI_FA_CHUNK < n ? s0 + HI_FA_CHUNK : n);
        const int64_t prow = pr->nc * (a->hd + 2);
        if (pr->nc == 1) f->k->attn_fa(a, pr->t, h0, f->R, s0, s1, scratch, NULL, prow);
        else f->k->attn_fa_tiled(a, pr->t, h0, f->R, s0, s1, scratch, f->part + pr->part + h0 * prow + c * (a->hd + 2),
                                 prow);
    }
}

/* a split row's output from its chunks' partials (M, S, VKQ), in chunk order, as llama.cpp's
 * ggml_flash_attn_ext_reduce_partials merges them; VKQ kept in out until its division by S */
static void fa_merge(const float *part, int64_t nc, int64_t hd, float *out) {
    float M = -INFINITY, S = 0.0f;
    memset(out, 0, sizeof(float) * (size_t)hd);
    for (int64_t c = 0; c < nc; c++) {
        const float *p = part + c * (hd + 2), Mc = p[0], Sc = p[1];
        if (Sc == 0.0f) continue;
        const float Mn = fmaxf(M, Mc), so = expf(M - Mn), sn = expf(Mc - Mn);
        for (int64_t d = 0; d < hd; d++) out[d] = out[d] * so + p[2 + d] * sn;
        S = S * so + Sc * sn;
        M = Mn;
    }
    const float S_inv = S == 0.0f ? 0.0f : 1.0f / S;
    for (int64_t d = 0; d < hd; d++) out[d] = out[d] * S_inv;
}

typedef struct {
    const hi_attn *a;
    const fa_pair *pairs;
    const int64_t *split; /* the wave's split pairs */
    const float *part;
    int64_t H, per, n; /* rows (split pair, head) per pool chunk, rows */
} fa_merge_job;

/* a pool chunk of a wave's merges: each row's merge is its own (the same bits on any thread) */
static void fa_merge_run(void *arg, int64_t i) {
    const fa_merge_job *m = (const fa_merge_job *)arg;
    const int64_t hd = m->a[0].hd;
    for (int64_t r = i * m->per; r < (i + 1) * m->per && r < m->n; r++) {
        const fa_pair *pr = &m->pairs[m->split[r / m->H]];
        const hi_attn *aj = &m->a[pr->j];
        const int64_t h = r % m->H;
        fa_merge(m->part + pr->part + h * pr->nc * (hd + 2), pr->nc, hd, aj->out + pr->t * aj->out_row + h * hd);
    }
}

/* the query rows of jobs a[0 .. nj) (each T tokens at its pos0 over its typed caches; all the same H, Hkv, hd) on
 * the pool: units of R rows of one K/V head (R the largest divisor of H / Hkv leaving every thread work, which
 * changes no bit) over one context chunk; split rows merged after each wave */
static int attn_fa_go(hi_ctx *c, const hi_attn *a, int64_t nj, float *scratch, int64_t scratch_len, int inline_call) {
    const hi_kernels *kt = hi_ctx_kernels(c);
    const int64_t H = a[0].H, Hkv = a[0].Hkv, hd = a[0].hd, G = H / Hkv;
    if (G > HI_FA_MAXG || hd % 32) return -2;
    int64_t npairs = 0, total_chunks = 0;
    for (int64_t j = 0; j < nj; j++) {
        npairs += a[j].T;
        for (int64_t t = 0; t < a[j].T; t++) total_chunks += fa_chunks(a[j].pos0 + t + 1);
    }
    const int64_t want = inline_call ? 1 : 2 * (int64_t)hi_ctx_threads(c);
    int64_t R = G;
    while (R % 2 == 0 && total_chunks * Hkv * (G / R) < want) R /= 2;
    const int64_t unit_scratch = kt->attn_fa_scratch(hd, R), fits = scratch_len / unit_scratch;
    if (fits < 1) return -2;
    fa_pair *pairs = (fa_pair *)malloc(sizeof(fa_pair) * (size_t)npairs);
    int64_t *split = (int64_t *)malloc(sizeof(int64_t) * (size_t)npairs);
    float *part = NULL, *own = NULL;
    /* the partials in the scratch the units leave (most decode calls: a long row's partials are small next to its
     * cache), else in a buffer of our own: a large malloc is an mmap and page faults at every call */
    const int64_t most = inline_call ? 1 : fa_max_chunks(c), spare_at = (most < fits ? most : fits) * unit_scratch;
    int64_t part_cap = 0; /* floats `part` holds: a wave's first pair may alone need more than HI_FA_PART_FLOATS */
    if (!pairs || !split) {
        free(pairs);
        free(split);
        return -1;
    }
    int rc = 0;
    int64_t j = 0, t = 0;
    while (!rc && j < nj) { /* a wave: pairs in (job, token) order while their partials fit */
        int64_t n = 0, units = 0, pf = 0;
        while (j < nj) {
            const int64_t nc = fa_chunks(a[j].pos0 + t + 1), need = nc > 1 ? H * nc * (hd + 2) : 0;
            if (n && pf + need > HI_FA_PART_FLOATS) break;
            pairs[n] = (fa_pair){.j = j, .t = t, .nc = nc, .u0 = units, .part = need ? pf : -1};
            units += nc * Hkv * (G / R);
            pf += need;
            n++;
            if (++t == a[j].T) t = 0, j++;
        }
        if (pf > part_cap && pf <= scratch_len - spare_at) {
            part = scratch + spare_at;
            part_cap = scratch_len - spare_at;
        } else if (pf > part_cap) {
            const int64_t cap = pf > HI_FA_PART_FLOATS ? pf : HI_FA_PART_FLOATS;
            free(own);
            if (!(own = part = (float *)malloc(sizeof(float) * (size_t)cap))) {
                rc = -1;
                break;
            }
            part_cap = cap;
        }
        int64_t nch = most;
        if (nch > fits) nch = fits;
        if (nch > units) nch = units;
        fa_job f = {.k = kt, .a = a, .pairs = pairs, .npairs = n, .R = R, .upc = Hkv * (G / R), .units = units,
                    .per = (units + nch - 1) / nch, .unit_scratch = unit_scratch, .scratch = scratch, .part = part};
        nch = (units + f.per - 1) / f.per;
        int64_t ns = 0;
        for (int64_t p = 0; p < n; p++)
            if (pairs[p].nc > 1) split[ns++] = p;
        /* the merges on the pool too: with many threads a long row's serial merge is a part of the call's time */
        const int64_t mrows = ns * H, mch = inline_call || mrows < 2 ? 1 : (mrows < most ? mrows : most);
        fa_merge_job mj = {.a = a, .pairs = pairs, .split = split, .part = part, .H = H,
                           .per = (mrows + mch - 1) / mch, .n = mrows};
        hi_ctx_lock(c);
        if (nch == 1) fa_chunk_run(&f, 0);
        else hi_ctx_run(c, fa_chunk_run, &f, nch);
        if (mrows && mch == 1) fa_merge_run(&mj, 0);
        else if (mrows) hi_ctx_run(c, fa_merge_run, &mj, (mrows + mj.per - 1) / mj.per);
        hi_ctx_unlock(c);
    }
    free(own);
    free(pairs);
    free(split);
    return rc;
}

/* rows of job j (its q, k, v, out, shape and types set) on the pool: the F32 cache in llama.cpp's order without
 * flash attention (`attn`, K/V heads grouped where it pays), any other in its flash-attention order (attn_fa_go) */
static int attn_go(hi_ctx *c, attn_job *j, float *scratch, int64_t scratch_len, int inline_call) {
    const hi_kernels *kt = hi_ctx_kernels(c);
    hi_attn *a = &j->a;
    if (!(a->k_type == HI_T_F32 && a->v_type == HI_T_F32)) return attn_fa_go(c, a, 1, scratch, scratch_len, inline_call);
    const int64_t rows = a->T * a->H;
    const int64_t row_scratch = kt->attn_scratch(a->pos0 + a->T, a->hd);
    int64_t per = 1, slots = 1;
    const int64_t chunks = attn_split(c, rows, a->H / a->Hkv, row_scratch, scratch_len, inline_call, &per, &slots);
    if (chunks < 1) return -2;
    a->slots = slots;
    j->k = kt;
    j->rows = rows;
    j->per = per;
    j->chunks = chunks;
    j->chunk_scratch = slots * row_scratch;
    j->scratch = scratch;
    hi_ctx_lock(c);
    if (chunks == 1) attn_chunk(j, 0);
    else hi_ctx_run(c, attn_chunk, j, chunks);
    hi_ctx_unlock(c);
    return 0;
}

int hi_attention(hi_ctx *c, const float *q, int64_t q_row, int64_t T, int64_t H, int64_t hd, const float *k,
                 const float *v, int64_t kv_row, int64_t Hkv, int64_t pos0, float scale, float *out, int64_t out_row,
                 float *scratch, int64_t scratch_len, int ggml_op) {
    if (!c || !q || !k || !v || !out || !scratch || T < 1 || H < 1 || hd < 1 || Hkv < 1 || H % Hkv || pos0 < 0 ||
        ggml_op < HI_GGML_NONE || ggml_op > HI_GGML_DECODE_ROWS)
        return -2;
    if (q_row < H * hd || out_row < H * hd || kv_row < Hkv * hd) return -2;
    const int64_t n = pos0 + T;
    attn_job j = {.a = {.q = q, .k = k, .v = v, .out = out, .T = T, .H = H, .Hkv = Hkv, .hd = hd, .pos0 = pos0,
                        .q_row = q_row, .kv_row = kv_row, .out_row = out_row, .scale = scale,
                        .rows1 = ggml_op == HI_GGML_DECODE_ROWS, .k_type = HI_T_F32, .v_type = HI_T_F32,
                        .k_bytes = kv_row * 4, .v_bytes = kv_row * 4}};
    return attn_go(c, &j, scratch, scratch_len, n * T * H * hd < HI_ATTN_INLINE_MACS);
}

/* ggml's Walsh-Hadamard rotation (ggml_compute_forward_fwht, what llama.cpp's MUL_MAT with a Hadamard hint runs) of
 * each n-value chunk of x[0..len) in place, n a power of two: every value times 1 / sqrtf(n), then the butterflies
 * (u, v) -> (u + v, u - v) for spans 1, 2, 4, ..; each a single rounding, so its vector passes give these bits */
static void kv_fwht(float *x, int64_t len, int64_t n) {
    const float s = 1.0f / sqrtf((float)n);
    for (int64_t c = 0; c < len; c += n) {
        float *r = x + c;
        for (int64_t j = 0; j < n; j++) r[j] = r[j] * s;
        for (int64_t h = 1; h < n; h <<= 1)
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float u = r[j], v = r[j + h];
                    r[j] = u + v;
                    r[j + h] = u - v;
                }
    }
}

/* quantize_row_q4_0_ref: d = the value of largest magnitude / -8, q = min(15, (int8)(x / d + 8.5)) */
static void kv_q4_0(const float *x, int64_t n, uint8_t *y) {
    for (int64_t b = 0; b < n / 32; b++, x += 32, y += 18) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 32; j++)
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        const float d = max / -8, id = d ? 1.0f / d : 0.0f;
        const uint16_t h = hi_f2h_soft(d);
        memcpy(y, &h, 2);
        for (int j = 0; j < 16; j++) {
            const int8_t a = (int8_t)(x[j] * id + 8.5f), b2 = (int8_t)(x[16 + j] * id + 8.5f);
            const uint8_t q0 = (uint8_t)(a < 15 ? a : 15), q1 = (uint8_t)(b2 < 15 ? b2 : 15);
            y[2 + j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* one row of n values into cache type t, as llama.cpp's set_rows writes a cache row (the type's from_float: fp16
 * rounded to nearest even, quantize_row_q8_0 of this ISA's build, quantize_row_q4_0_ref) */
static void kv_store_row(const hi_kernels *kt, int t, const float *x, int64_t n, uint8_t *y) {
    if (t == HI_T_F32) {
        memcpy(y, x, sizeof(float) * (size_t)n);
    } else if (t == HI_T_F16) {
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = hi_f2h_soft(x[i]);
            memcpy(y + 2 * i, &h, 2);
        }
    } else if (t == HI_T_Q8_0) {
        kt->quantize(HI_ACT_Q8_0, x, n, y);
    } else if (t == HI_T_Q4_0) {
        kv_q4_0(x, n, y);
    } else {
        const int64_t bs = t == HI_T_LM3 ? HI_LM3_BYTES : HI_LM4_BYTES;
        for (int64_t b = 0; b < n / 32; b++) hi_lm_encode(t, x + 32 * b, y + b * bs);
    }
}

/* the first half of an attention step: q roped at pos0.., the T new K rows roped there and written with the T new
 * V rows to the caches' rows pos0.. in their types; rot_k > 0: q and the K rows rotated (kv_fwht, chunks of rot_k)
 * after the rope, rot_v > 0: the V rows rotated (chunks of rot_v) before they are written (llama.cpp's attention
 * rotation for quantized caches) */
static int attn_store_rope(hi_ctx *c, float *q, int64_t q_row, int64_t T, int64_t H, int64_t hd, const float *k_new,
                           const float *v_new, int64_t kv_new_row, uint8_t *k_cache, uint8_t *v_cache, int k_type,
                           int v_type, int64_t Hkv, int64_t pos0, int64_t n_rot, float theta_base, int neox,
                           const float *freq_factors, int64_t rot_k, int64_t rot_v, int64_t shift,
                           const int32_t *mrope) {
    const int64_t kv = Hkv * hd, kb = kv_row_bytes(k_type, Hkv, hd), vb = kv_row_bytes(v_type, Hkv, hd);
    const hi_kernels *kt = hi_ctx_kernels(c);
    int rc = 0;
    if (H > 0) { /* no queries: the cache writes alone (hi_attn_store) */
        rc = hi_rope_rows(c, q, T, H, hd, pos0, shift, mrope, n_rot, theta_base, neox, freq_factors);
        if (rc) return rc;
        if (rot_k)
            for (int64_t t = 0; t < T; t++) kv_fwht(q + t * q_row, H * hd, rot_k);
    }
    if (k_type == HI_T_F32 && !rot_k) { /* roped in place in the cache */
        for (int64_t t = 0; t < T; t++) memcpy(k_cache + (pos0 + t) * kb, k_new + t * kv_new_row, (size_t)kb);
        rc = hi_rope_rows(c, (float *)(k_cache + pos0 * kb), T, Hkv, hd, pos0, shift, mrope, n_rot, theta_base, neox,
                       freq_factors);
    } else {
        float *tmp = (float *)malloc(sizeof(float) * (size_t)(T * kv));
        if (!tmp) return -1;
        for (int64_t t = 0; t < T; t++) memcpy(tmp + t * kv, k_new + t * kv_new_row, sizeof(float) * (size_t)kv);
        rc = hi_rope_rows(c, tmp, T, Hkv, hd, pos0, shift, mrope, n_rot, theta_base, neox, freq_factors);
        if (rot_k) kv_fwht(tmp, T * kv, rot_k);
        for (int64_t t = 0; !rc && t < T; t++) kv_store_row(kt, k_type, tmp + t * kv, kv, k_cache + (pos0 + t) * kb);
        free(tmp);
    }
    if (rc) return rc;
    if (rot_v) {
        float *tmp = (float *)malloc(sizeof(float) * (size_t)kv);
        if (!tmp) return -1;
        for (int64_t t = 0; t < T; t++) {
            memcpy(tmp, v_new + t * kv_new_row, sizeof(float) * (size_t)kv);
            kv_fwht(tmp, kv, rot_v);
            kv_store_row(kt, v_type, tmp, kv, v_cache + (pos0 + t) * vb);
        }
        free(tmp);
    } else {
        for (int64_t t = 0; t < T; t++) kv_store_row(kt, v_type, v_new + t * kv_new_row, kv, v_cache + (pos0 + t) * vb);
    }
    return 0;
}

/* a rotation of n values (0: none) a cache of type t with heads of hd values may take: a power of two from 64
 * dividing hd, for a quantized type */
static int rot_ok(int64_t n, int t, int64_t hd) {
    return n == 0 || (n >= 64 && !(n & (n - 1)) && hd % n == 0 && (t == HI_T_Q8_0 || t == HI_T_Q4_0 || hi_is_lm(t)));
}

int hi_attn_store(hi_ctx *c, int64_t T, int64_t hd, const float *k_new, const float *v_new, int64_t kv_new_row,
                  void *k_cache, void *v_cache, int k_type, int v_type, int64_t n_ctx, int64_t Hkv, int64_t pos0,
                  int64_t n_rot, float theta_base, int neox, const float *freq_factors, int64_t rot_k, int64_t rot_v,
                  int64_t rope_shift, const int32_t *mrope) {
    const int64_t kb = kv_row_bytes(k_type, Hkv, hd), vb = kv_row_bytes(v_type, Hkv, hd);
    if (!c || !k_new || !v_new || !k_cache || !v_cache || T < 1 || Hkv < 1 || hd < 1 || kv_new_row < Hkv * hd ||
        kb < 0 || vb < 0 || pos0 < 0 || pos0 > n_ctx - T || !rot_ok(rot_k, k_type, hd) || !rot_ok(rot_v, v_type, hd))
        return -2;
    return attn_store_rope(c, NULL, 0, T, 0, hd, k_new, v_new, kv_new_row, (uint8_t *)k_cache, (uint8_t *)v_cache,
                           k_type, v_type, Hkv, pos0, n_rot, theta_base, neox, freq_factors, rot_k, rot_v, rope_shift,
                           mrope);
}

int hi_attn_step(hi_ctx *c, float *q, int64_t T, int64_t H, int64_t hd, const float *k_new, const float *v_new,
                 int64_t kv_new_row, void *k_cache, void *v_cache, int k_type, int v_type, int64_t n_ctx, int64_t Hkv,
                 int64_t pos0, int64_t n_rot, float theta_base, int neox, const float *freq_factors, float scale,
                 float *out, int64_t out_row, float *scratch, int64_t scratch_len, int ggml_op, int64_t rot_k,
                 int64_t rot_v, int64_t rope_shift, const int32_t *mrope) {
    const int64_t kv = Hkv * hd, kb = kv_row_bytes(k_type, Hkv, hd), vb = kv_row_bytes(v_type, Hkv, hd);
    if (!c || !q || !k_new || !v_new || !k_cache || !v_cache || !out || !scratch || T < 1 || H < 1 || Hkv < 1 ||
        hd < 1 || H % Hkv || kv_new_row < kv || out_row < H * hd || kb < 0 || vb < 0 || pos0 < 0 ||
        pos0 > n_ctx - T || ggml_op < HI_GGML_NONE || ggml_op > HI_GGML_DECODE_ROWS || !rot_ok(rot_k, k_type, hd) ||
        !rot_ok(rot_v, v_type, hd))
        return -2;
    int rc = attn_store_rope(c, q, H * hd, T, H, hd, k_new, v_new, kv_new_row, (uint8_t *)k_cache, (uint8_t *)v_cache,
                             k_type, v_type, Hkv, pos0, n_rot, theta_base, neox, freq_factors, rot_k, rot_v,
                             rope_shift, mrope);
    if (rc) return rc;
    attn_job j = {.a = {.q = q, .k = (const float *)k_cache, .v = (const float *)v_cache, .out = out, .T = T, .H = H,
                        .Hkv = Hkv, .hd = hd, .pos0 = pos0, .q_row = H * hd, .kv_row = kv, .out_row = out_row,
                        .scale = scale, .rows1 = ggml_op == HI_GGML_DECODE_ROWS, .k_type = k_type, .v_type = v_type,
                        .k_bytes = kb, .v_bytes = vb}};
    rc = attn_go(c, &j, scratch, scratch_len, (pos0 + T) * T * H * hd < HI_ATTN_INLINE_MACS);
    if (!rc && rot_v) /* the output back from V's rotation (its own inverse) */
        for (int64_t t = 0; t < T; t++) kv_fwht(out + t * out_row, H * hd, rot_v);
    return rc;
}

/* ---- one token of each of B sequences (decode_batch): each sequence's new K/V rows into its cache and its q and
 * those K rows roped at its position, then every (sequence, head) query row in one pool run; each row computed
 * as hi_attention computes it alone, so the result is bit-identical to B hi_attn_step calls */

#define HI_ATTN_ROWS_MAX 64 /* sequences per pool run (their hi_attn on the stack) */

typedef struct {
    const hi_kernels *k;
    const hi_attn *a; /* one per sequence */
    int64_t H, rows, per, chunk_scratch;
    float *scratch;
} attn_rows_job;

static void attn_rows_chunk(void *arg, int64_t i) {
    const attn_rows_job *j = (const attn_rows_job *)arg;
    const int64_t r0 = i * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    for (int64_t r = r0; r < r1;) { /* each sequence's heads in the chunk, in one call */
        const int64_t b = r / j->H, h1 = (b + 1) * j->H < r1 ? j->H : r1 - b * j->H;
        j->k->attn(&j->a[b], r % j->H, h1, j->scratch + i * j->chunk_scratch);
        r = b * j->H + h1;
    }
}

int hi_attn_rows(hi_ctx *c, int64_t B, float *q, int64_t q_row, int64_t H, int64_t hd, const float *k_new,
                 const float *v_new, int64_t kv_new_row, void *const *k_cache, void *const *v_cache, int k_type,
                 int v_type, int64_t n_ctx, int64_t Hkv, const int64_t *pos, int64_t dpos, int64_t n_rot,
                 float theta_base, int neox, const float *freq_factors, float scale, float *out, int64_t out_row,
                 float *scratch, int64_t scratch_len, int64_t rot_k, int64_t rot_v, const int64_t *rope_shift) {
    const int64_t kv = Hkv * hd, kb = kv_row_bytes(k_type, Hkv, hd), vb = kv_row_bytes(v_type, Hkv, hd);
    if (!c || !q || !k_new || !v_new || !k_cache || !v_cache || !pos || !out || !scratch || B < 1 || H < 1 ||
        hd < 1 || Hkv < 1 || H % Hkv || kv_new_row < kv || q_row < H * hd || out_row < H * hd || kb < 0 || vb < 0 ||
        !rot_ok(rot_k, k_type, hd) || !rot_ok(rot_v, v_type, hd))
        return -2;
    const hi_kernels *kt = hi_ctx_kernels(c);
    const int fa = !(k_type == HI_T_F32 && v_type == HI_T_F32);
    hi_attn a[HI_ATTN_ROWS_MAX];
    for (int64_t j0 = 0; j0 < B; j0 += HI_ATTN_ROWS_MAX) {
        const int64_t nb = B - j0 < HI_ATTN_ROWS_MAX ? B - j0 : HI_ATTN_ROWS_MAX;
        int64_t longest = 0;
        for (int64_t i = 0; i < nb; i++) {
            const int64_t j = j0 + i, p = pos[j] + dpos;
            if (p < 0 || p > n_ctx - 1 || !k_cache[j] || !v_cache[j]) return -2;
            const int rc = attn_store_rope(c, q + j * q_row, q_row, 1, H, hd, k_new + j * kv_new_row,
                                           v_new + j * kv_new_row, kv_new_row, (uint8_t *)k_cache[j],
                                           (uint8_t *)v_cache[j], k_type, v_type, Hkv, p, n_rot, theta_base, neox,
                                           freq_factors, rot_k, rot_v, rope_shift ? rope_shift[j] : 0, NULL);
            if (rc) return rc;
            a[i] = (hi_attn){.q = q + j * q_row, .k = (const float *)k_cache[j], .v = (const float *)v_cache[j],
                             .out = out + j * out_row, .T = 1, .H = H, .Hkv = Hkv, .hd = hd, .pos0 = p,
                             .q_row = H * hd, .kv_row = kv, .out_row = out_row, .scale = scale, .rows1 = 1,
                             .k_type = k_type, .v_type = v_type, .k_bytes = kb, .v_bytes = vb};
            if (p + 1 > longest) longest = p + 1;
        }
        if (fa) {
            const int rc = attn_fa_go(c, a, nb, scratch, scratch_len, 0);
            if (rc) return rc;
        } else {
            const int64_t row_scratch = kt->attn_scratch(longest, hd), rows = nb * H;
            int64_t per = 1, slots = 1;
            const int64_t chunks = attn_split(c, rows, H / Hkv, row_scratch, scratch_len, 0, &per, &slots);
            if (chunks < 1) return -2;
            for (int64_t i = 0; i < nb; i++) a[i].slots = slots;
            attn_rows_job job = {.k = kt, .a = a, .H = H, .rows = rows, .per = per,
                                 .chunk_scratch = slots * row_scratch, .scratch = scratch};
            hi_ctx_lock(c);
            if (chunks == 1) attn_rows_chunk(&job, 0);
            else hi_ctx_run(c, attn_rows_chunk, &job, chunks);
            hi_ctx_unlock(c);
        }
        if (rot_v)
            for (int64_t i = 0; i < nb; i++) kv_fwht(out + (j0 + i) * out_row, H * hd, rot_v);
    }
    return 0;
}

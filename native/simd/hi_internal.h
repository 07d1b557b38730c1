/* Shared definitions of the SIMD library: type ids, the matmul job, the per-ISA kernel table, exact
 * fp16 <-> fp32 conversions, and the plain float helpers of the ops around the products (ops.c, gdn.c).
 *
 * Maths of the conversions (IEEE binary16 <-> binary32, no approximation):
 *   fp16 -> fp32 is exact: normals re-bias the exponent (e - 15 + 127), subnormals are m * 2^-24 (computed
 *   as (float)m * 2^-24, exact, and without touching float denormals, so DAZ/FTZ modes cannot change it).
 *   fp32 -> fp16 rounds to nearest, ties to even (as F16C's vcvtps2ph with imm 0 and numpy's astype):
 *   normals add 0xfff plus the lowest kept mantissa bit before truncating 13 bits; results below 2^-14
 *   are formed by a float addition of 0.5 whose rounding is the wanted one; >= 65520 becomes inf.
 */
#ifndef HI_INTERNAL_H
#define HI_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"

/* ggml type ids */
enum {
    HI_T_F32 = 0, HI_T_F16 = 1, HI_T_Q4_0 = 2, HI_T_Q4_1 = 3, HI_T_Q5_0 = 6, HI_T_Q5_1 = 7, HI_T_Q8_0 = 8,
    HI_T_Q4_K = 12, HI_T_Q5_K = 13, HI_T_Q6_K = 14, HI_T_COUNT = 15
};

/* a qtype flag: K-quant rows stored with their quant bytes zipped (hi_repack_rows), which the units with
 * `kprep` read without unzipping them per row */
#define HI_T_ZIPPED 0x100

/* the ggml type of a qtype that may carry HI_T_ZIPPED (a zipped non-K-quant type stays invalid) */
static inline int hi_base_type(int qtype) {
    const int b = qtype & ~HI_T_ZIPPED;
    return (qtype & HI_T_ZIPPED) && !(b == HI_T_Q4_K || b == HI_T_Q5_K || b == HI_T_Q6_K) ? -1 : b;
}

/* activation kinds (the format a weight type's input row is quantized to) */
enum { HI_ACT_NONE = -1, HI_ACT_F32 = 0, HI_ACT_F16 = 1, HI_ACT_Q8_0 = 2, HI_ACT_Q8_1 = 3, HI_ACT_Q8_K = 4 };

enum { HI_ISA_SCALAR = 0, HI_ISA_SSSE3 = 1, HI_ISA_AVX2 = 2, HI_ISA_AVX512VNNI = 3, HI_N_ISA = 4 };

/* One matrix product: out[t][r] = dot(weight row r, activation row t) for r < rows, t < T.
 * Weight row r starts at w + r * w_row; activation row t at x + t * x_row (bytes); out row t at
 * out + t * out_row (floats). corr/dy/sy are prepared from the activation rows by the ISA's `prep`
 * (legacy types only): corr[t][b][8] the negated lane corrections, dy[t][b] the block scales as float,
 * sy[t][b] the q8_1 sums as float. */
typedef struct hi_mm {
    int qtype;
    const uint8_t *w;
    size_t w_row;
    int64_t rows, cols;
    const uint8_t *x;
    size_t x_row;
    int64_t T;
    float *out;
    size_t out_row;
    const int32_t *corr;
    const float *dy;
    const float *sy;
    const uint8_t *xk; /* K-quants on a unit with `kprep`: the activation rows prepared by it (NULL: not) */
    size_t xk_row;     /* bytes from one prepared row to the next */
    int wz;     /* K-quants: the rows' quant bytes are zipped (HI_T_ZIPPED; only with xk) */
    int kshape; /* K-quants: the float shape of llama.cpp's kernel (HI_KS_*, dot_kq_shapes.h) */
    int rows1;  /* every row in a one-token product's float order (HI_GGML_DECODE_ROWS), whatever T */
    int pf;     /* bytes of the weight stream software-prefetched ahead (the context's; 0: none) */
} hi_mm;

/* bytes per 256-element block of a `kprep`-prepared activation row (hi_q8Kz, dot_kquants.h) */
#define HI_KPREP_BYTES 1056

/* K-quant float shapes: ggml_vec_dot's; the repacked Q4_K gemv (per block) and gemm (per quarter block for
 * tokens t < T - T % 4, per block after); the tiled kernels' */
enum { HI_KS_VEC = 0, HI_KS_REPACK = 1, HI_KS_REPACK_GEMM = 2, HI_KS_TILED = 3 };

/* One causal attention over an F32 K/V cache (kernels_attn.h): T query tokens at positions pos0.. of H heads of
 * hd values (row t at q + t * q_row floats), cache rows 0..pos0+T-1 (position s of KV head g at k + s * kv_row +
 * g * hd, likewise v), out row t at out + t * out_row (H * hd floats); query head h reads KV head h / (H / Hkv).
 * rows1: every query row in the float order of a one-token step, whatever T (HI_GGML_DECODE_ROWS). */
#define HI_FA_MAXG 64 /* query heads a K/V head may serve (typed caches) */

typedef struct hi_attn {
    const float *q, *k, *v;
    float *out;
    int64_t T, H, Hkv, hd, pos0, q_row, kv_row, out_row;
    float scale;
    int rows1;
    int64_t slots; /* rows' scratch the call has: up to this many rows sharing a K/V head go together */
    /* a typed cache (the table's attn_fa): k, v point at its bytes, K/V head g of position s at
     * k + s * k_bytes + g * (k_bytes / Hkv) (likewise v), each head's hd values in type k_type / v_type's blocks */
    int k_type, v_type;
    int64_t k_bytes, v_bytes;
} hi_attn;

/* One full (non-causal) attention of the vision tower (vattn.c, kernels_vattn.h), worked transposed: the query rows
 * of head h packed in the unit's float-product panels of gemm_nr rows at qp + h * q_head (hi_gemm_pack of Q [n, hd]),
 * its keys as rows, K [n, hd] at k + h * n * hd, and its values as Vᵀ [hd, n] at vt + h * hd * n; out [n, nh, hd].
 * Sᵀ = K Qᵀ of a block of keys is then a panel the block kernel takes as its right operand for Oᵀ += Vᵀ P. */
#define HI_VATTN_KB 240 /* keys a block: a multiple of every unit's gemm_mr */

typedef struct hi_vattn {
    const float *qp, *k, *vt;
    float *out;
    int64_t n, nh, hd, q_head;
    float scale;
} hi_vattn;

typedef struct hi_kernels {
    int isa;
    const char *name;
    /* one activation row of n values -> act kind `kind` (HI_ACT_*) */
    void (*quantize)(int kind, const float *x, int64_t n, void *y);
    /* per-block data of one quantized activation row for weight type qtype (see hi_mm) */
    void (*prep)(int qtype, const uint8_t *xq, int64_t nb, int32_t *corr, float *dy, float *sy);
    int needs_corr[HI_T_COUNT]; /* prep must fill corr for this weight type */
    /* NULL, or: one Q8_K activation row of nb blocks -> the unit's prepared form for the K-quant dots
     * (HI_KPREP_BYTES per block, read through hi_mm.xk) */
    void (*kprep)(const uint8_t *xq, int64_t nb, uint8_t *out);
    /* NULL, or (a unit with kprep): nb K-quant weight blocks of type qtype repacked in place into the layout its
     * dots read with hi_mm.wz (HI_T_ZIPPED) */
    void (*krepack)(int qtype, uint8_t *p, int64_t nb);
    /* rows [r0, r1) of job m for all of its T tokens */
    void (*mm)(const hi_mm *m, int64_t r0, int64_t r1);
    /* streaming read of n bytes (n a multiple of 256, p 64-byte aligned); returns a checksum */
    uint64_t (*read_sum)(const void *p, size_t n);
    /* query rows [r0, r1) (row r: token r / H, head r % H) of job a, with a->slots * attn_scratch(n_ctx, hd)
     * floats */
    void (*attn)(const hi_attn *a, int64_t r0, int64_t r1, float *scratch);
    int64_t (*attn_scratch)(int64_t n_ctx, int64_t hd);
    /* a typed cache (a->k_type, a->v_type: f32, f16, q8_0, q4_0) in the order of llama.cpp's CPU flash attention
     * (online softmax): rows h0 .. h0 + m - 1 of token t (m <= HI_FA_MAXG query heads of one K/V head) over cache
     * positions [s0, s1), with attn_fa_scratch(hd, m) floats; part NULL: their outputs; else their partial
     * (M, S, VKQ[hd]) at part + i * part_row (attn.c merges a row's partials) */
    void (*attn_fa)(const hi_attn *a, int64_t t, int64_t h0, int64_t m, int64_t s0, int64_t s1, float *scratch,
                    float *part, int64_t part_row);
    int64_t (*attn_fa_scratch)(int64_t hd, int64_t m);
    /* a chunk of a long row (attn.c's split): the same rows over [s0, s1) in tiles (faster; its own float order),
     * always to partials */
    void (*attn_fa_tiled)(const hi_attn *a, int64_t t, int64_t h0, int64_t m, int64_t s0, int64_t s1, float *scratch,
                          float *part, int64_t part_row);
    /* out[0..n) = silu(g) * u, ggml's vector SwiGLU (out may alias g or u) */
    void (*swiglu)(const float *g, const float *u, float *out, int64_t n);
    /* float products of many rows (kernels_gemm.h; gemm_nr 0 and gemm_block NULL where a unit has none): rows
     * [0, mr) (mr <= gemm_mr) of x against a panel of gemm_nr packed weight rows over kc values of k, into y's
     * columns [0, nc) (added to what y holds when acc) */
    int gemm_mr, gemm_nr;
    void (*gemm_block)(const float *x, int64_t xs, const float *p, int64_t kc, float *y, int64_t ys, int64_t mr,
                       int64_t nc, int acc);
    /* NULL where gemm_block is: query panels [p0, p1) (gemm_nr rows each) of head h of a full attention, with
     * gemm_nr * (HI_VATTN_KB + (p1 - p0) * (hd + 2)) floats of scratch */
    void (*vattn)(const hi_vattn *a, int64_t h, int64_t p0, int64_t p1, float *scratch);
} hi_kernels;

extern const hi_kernels hi_kernels_scalar;
extern const hi_kernels hi_kernels_ssse3;
extern const hi_kernels hi_kernels_avx2;
extern const hi_kernels hi_kernels_avx512vnni;

/* the kernel table of ISA level isa, 0 <= isa < HI_N_ISA (hi_cpu.c) */
const hi_kernels *hi_isa_table(int isa);

static inline uint32_t hi_fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float hi_bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float hi_h2f_soft(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    if (em >= 0x7c00u) /* inf, nan */
        return hi_bitsf(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
    if (em >= 0x0400u) /* normal */
        return hi_bitsf(sign | ((em + ((127u - 15u) << 10)) << 13));
    const float v = (float)em * 0x1p-24f; /* zero or subnormal: exact */
    return sign ? -v : v;
}

static inline uint16_t hi_f2h_soft(float f) {
    uint32_t u = hi_fbits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint32_t o;
    if (u >= 0x47800000u) { /* >= 65536, inf, nan */
        o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) { /* below 2^-14: subnormal half or zero */
        const float t = hi_bitsf(u) + 0.5f;
        o = hi_fbits(t) - 0x3f000000u;
    } else {
        const uint32_t odd = (u >> 13) & 1u;
        u += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        o = u >> 13;
    }
    return (uint16_t)(o | sign);
}

/* a context's mutex and pool, for drivers outside hi_simd.c (gdn.c): hi_ctx_run runs fn(arg, i) for
 * i < total on the pool and the caller, returning when all are done; call it with the context locked */
struct hi_ctx;
void hi_ctx_lock(struct hi_ctx *c);
void hi_ctx_unlock(struct hi_ctx *c);
void hi_ctx_run(struct hi_ctx *c, void (*fn)(void *arg, int64_t chunk), void *arg, int64_t total);
const hi_kernels *hi_ctx_kernels(const struct hi_ctx *c);
/* for replica.c: the context's pool and its replica table (NULL: none), read and written with the context locked */
struct hi_pool *hi_ctx_pool(struct hi_ctx *c);
struct hi_reps **hi_ctx_reps(struct hi_ctx *c);
/* an element-wise op over T rows of n values on the pool (locks the context): fn(arg, t, e0, e1) on segments
 * [e0, e1) of row t, seg values long (the last of a row shorter); on the caller alone when the rows hold fewer
 * than 2 * seg values in all or the pool has one thread */
void hi_ctx_run_rows(struct hi_ctx *c, void (*fn)(void *arg, int64_t t, int64_t e0, int64_t e1), void *arg,
                     int64_t T, int64_t n, int64_t seg);
/* ggml's rope over T rows of H heads (rowops.c; hi_rope and hi_rope_multi, and attention's q and new K rows):
 * mrope NULL for plain positions, row t at pos0 + t + shift */
int hi_rope_rows(struct hi_ctx *c, float *x, int64_t T, int64_t H, int64_t hd, int64_t pos0, int64_t shift,
                 const int32_t *mrope, int64_t n_rot, float theta_base, int neox, const float *freq_factors);

/* round to nearest, ties to even, for |v| < 2^22 (ggml's nearest_int) */
static inline int hi_nearest_int(float v) {
    const float t = v + 12582912.f;
    return (int)(hi_fbits(t) & 0x007fffffu) - 0x00400000;
}

/* ggml's 1/rms of n floats (ggml_compute_forward_rms_norm_f32, ops.rms_scale): float squares summed in double in
 * order, the mean narrowed to float, then 1.0f / sqrtf(mean + eps) in float (the files using it are compiled
 * without FMA contraction or fast math, so these are the operations done) */
static inline float hi_rms_scale(const float *x, int64_t n, float eps) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i] * x[i];
        s += v;
    }
    const float mean = (float)(s / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

/* 1 / (1 + expf(-x)), libm's expf */
static inline float hi_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* ---- the lm3 / lm4 K/V cache types (not ggml's): rows Walsh-Hadamard rotated before they are kept (kv_rotation),
 * then per block of 32 values a fp16 scale d (of six tried: 0.8 .. 1.2 times the block's RMS, its squares fused in
 * order, and its largest magnitude over the outermost level; the least squared error wins) and each value coded as
 * the nearest of the 8 / 16 Lloyd-Max levels of a unit Gaussian (Max 1960) to x * (1 / d): lm3 = d + 32
 * 3-bit codes (14 bytes, 3.5 bits a value; codes 8k..8k+7 in bytes 3k..3k+2, code j at bit 3 (j % 8) of that 24-bit
 * little-endian word), lm4 = d + 32 4-bit codes (18 bytes; code j in byte j / 2, low nibble for even j). A value
 * comes back as d * level. docs/numerics.md says why and what it costs. */
#define HI_T_LM3 1003
#define HI_T_LM4 1004
#define HI_LM3_BYTES 14
#define HI_LM4_BYTES 18

static const float hi_lm3_levels[8] = {-2.1520f, -1.3439f, -0.7560f, -0.2451f, 0.2451f, 0.7560f, 1.3439f, 2.1520f};
static const float hi_lm4_levels[16] = {-2.7326f, -2.0690f, -1.6181f, -1.2562f, -0.9424f, -0.6568f, -0.3881f,
                                        -0.1284f, 0.1284f,  0.3881f,  0.6568f,  0.9424f,  1.2562f,  1.6181f,
                                        2.0690f,  2.7326f};

static inline int hi_is_lm(int t) { return t == HI_T_LM3 || t == HI_T_LM4; }

/* the level nearest y of n ascending levels (a tie goes to the lower one) */
static inline int hi_lm_code(const float *lv, int n, float y) {
    int c = 0;
    for (int j = 0; j + 1 < n; j++) c += y > 0.5f * (lv[j] + lv[j + 1]);
    return c;
}

/* the scales an lm block tries (times its RMS; then its largest magnitude over the outermost level): the one whose
 * codes leave the least squared error (in double, in order; the first of equals) is kept */
static const float hi_lm_scales[5] = {0.8f, 0.9f, 1.0f, 1.1f, 1.2f};

static inline void hi_lm_encode(int t, const float *x, uint8_t *y) {
    const float *lv = t == HI_T_LM3 ? hi_lm3_levels : hi_lm4_levels;
    const int n = t == HI_T_LM3 ? 8 : 16;
    float s = 0.0f, amax = 0.0f;
    for (int j = 0; j < 32; j++) {
        s = fmaf(x[j], x[j], s);
        amax = fmaxf(amax, fabsf(x[j]));
    }
    const float rms = sqrtf(s / 32.0f);
    uint16_t dh = 0;
    double best = INFINITY;
    for (int k = 0; k < 6; k++) {
        const uint16_t h = hi_f2h_soft(k < 5 ? rms * hi_lm_scales[k] : amax / lv[n - 1]);
        const float d = hi_h2f_soft(h), id = d != 0.0f ? 1.0f / d : 0.0f;
        double err = 0.0;
        for (int j = 0; j < 32; j++) {
            const float e = x[j] - d * lv[hi_lm_code(lv, n, x[j] * id)];
            err += (double)e * (double)e;
        }
        if (err < best) {
            best = err;
            dh = h;
        }
    }
    const float d = hi_h2f_soft(dh), id = d != 0.0f ? 1.0f / d : 0.0f;
    memcpy(y, &dh, 2);
    if (t == HI_T_LM3) {
        for (int k = 0; k < 4; k++) {
            uint32_t w = 0;
            for (int j = 0; j < 8; j++) w |= (uint32_t)hi_lm_code(lv, 8, x[8 * k + j] * id) << (3 * j);
            y[2 + 3 * k] = (uint8_t)w;
            y[3 + 3 * k] = (uint8_t)(w >> 8);
            y[4 + 3 * k] = (uint8_t)(w >> 16);
        }
    } else {
        for (int j = 0; j < 16; j++)
            y[2 + j] = (uint8_t)(hi_lm_code(lv, 16, x[2 * j] * id) | (hi_lm_code(lv, 16, x[2 * j + 1] * id) << 4));
    }
}

static inline void hi_lm_decode(int t, const uint8_t *b, float *out) {
    uint16_t dh;
    memcpy(&dh, b, 2);
    const float d = hi_h2f_soft(dh);
    if (t == HI_T_LM3) {
        for (int k = 0; k < 4; k++) {
            const uint32_t w = (uint32_t)b[2 + 3 * k] | ((uint32_t)b[3 + 3 * k] << 8) | ((uint32_t)b[4 + 3 * k] << 16);
            for (int j = 0; j < 8; j++) out[8 * k + j] = d * hi_lm3_levels[(w >> (3 * j)) & 7];
        }
    } else {
        for (int j = 0; j < 16; j++) {
            out[2 * j] = d * hi_lm4_levels[b[2 + j] & 15];
            out[2 * j + 1] = d * hi_lm4_levels[b[2 + j] >> 4];
        }
    }
}

#endif

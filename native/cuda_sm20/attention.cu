// Causal GQA attention for prefill (docs/gguf-qwen35.md §4 steps 5-7), fp32, sm_20 subset.
//
// Maths. T queries at absolute positions pos0..pos0+T-1, query head h reading KV head
// kv(h) = h / (H / H_kv) (division, as ggml and HF repeat_kv). Query row t sees keys s <= pos0 + t:
//   s_ts = (q_t . k_s) / sqrt(hd),   a_t = sum_s softmax_s(s_ts) v_s,   out_t = a_t * sigma(gate_t).
// The softmax is computed online over key tiles of bk keys (flash-attention style): per query row a
// running maximum m, running denominator l and un-normalised accumulator acc; for each tile
//   m' = max(m, max_j s_j),  p_j = e^(s_j - m'),  c = e^(m - m'),  l' = c l + sum_j p_j,
//   acc' = c acc + sum_j p_j v_j,
// and finally a = acc / l. Key 0 is visible to every row and lies in the first tile, so m is finite
// from the first tile on and masked scores (-inf) contribute e^-inf = 0.
//
// Layout. q [T, H, hd] (already RMS-normed and roped), K/V cache [n_ctx, H_kv, hd] with rows
// [0, pos0 + T) valid (the new rows written first, e.g. by kv_append), gate [T, H*hd] or NULL,
// out [T, H, hd]. One block of ATT_THREADS threads per (tile of ATT_BQ queries, head); grid
// (ceil(T / ATT_BQ), H). Shared memory (dynamic): Q tile, K-or-V tile (rows padded to hd+1 floats
// to avoid bank conflicts), the score/probability tile and per-row m, l, c.
//
// Typed caches (-ctk / -ctv: f16, q8_0, q4_0 rows in ggml's block layouts, docs/numerics.md): attn_prefill_kv
// reads them element by element (kv_load: fp16 converted, q * d for q8_0, (q - 8) * d for q4_0), kv_store writes
// new rows as llama.cpp's set_rows does (fp16 rounded to nearest even, quantize_row_q8_0's d = amax / 127 and
// round-to-nearest-even, quantize_row_q4_0_ref), q_round rounds the queries through K's vec_dot type (fp16 for
// f16 K, q8_0 for q8_0 / q4_0 K) as llama.cpp's flash attention converts them, and kv_fwht is ggml's
// Walsh-Hadamard rotation of quantized K / V (llama.cpp's attn_rot_k / attn_rot_v).
#include "prefill_common.cuh"

#define ATT_BQ 16
#define ATT_THREADS 256
#define ATT_MAXR 16  // ATT_BQ * hd / ATT_THREADS for hd <= 256: accumulator registers per thread

// this engine's lm3 / lm4 cache types (native/simd/hi_internal.h has their layout): Lloyd-Max levels of a unit
// Gaussian, a fp16 RMS scale per 32 values
#define HI_LM3 1003
#define HI_LM4 1004
#define HI_LM3_BYTES 14
#define HI_LM4_BYTES 18
__constant__ float c_lm3[8] = {-2.1520f, -1.3439f, -0.7560f, -0.2451f, 0.2451f, 0.7560f, 1.3439f, 2.1520f};
__constant__ float c_lm4[16] = {-2.7326f, -2.0690f, -1.6181f, -1.2562f, -0.9424f, -0.6568f, -0.3881f, -0.1284f,
                                0.1284f,  0.3881f,  0.6568f,  0.9424f,  1.2562f,  1.6181f,  2.0690f,  2.7326f};

// element d of K/V head row r (= position * H_kv + head) of a cache of ggml type `type` (f32 when !TYPED)
template <bool TYPED>
__device__ __forceinline__ float kv_load(const void* c, int type, size_t r, int hd, int d) {
    if (!TYPED || type == HI_F32) return ((const float*)c)[r * hd + d];
    if (type == HI_F16) return hi_h2f(((const u16*)c)[r * hd + d]);
    const int j = d & 31;
    if (type == HI_LM3) {
        const u8* b = (const u8*)c + r * (size_t)(hd / 32 * HI_LM3_BYTES) + (d >> 5) * HI_LM3_BYTES;
        const u8* g = b + 2 + 3 * (j >> 3);
        const u32 w = (u32)g[0] | ((u32)g[1] << 8) | ((u32)g[2] << 16);
        return __fmul_rn(hi_h2f(*(const u16*)b), c_lm3[(w >> (3 * (j & 7))) & 7]);
    }
    if (type == HI_LM4) {
        const u8* b = (const u8*)c + r * (size_t)(hd / 32 * HI_LM4_BYTES) + (d >> 5) * HI_LM4_BYTES;
        const u8 q = b[2 + (j >> 1)];
        return __fmul_rn(hi_h2f(*(const u16*)b), c_lm4[(j & 1) ? q >> 4 : q & 15]);
    }
    if (type == HI_Q8_0) {
        const u8* b = (const u8*)c + r * (size_t)(hd / 32 * HI_Q8_0_BYTES) + (d >> 5) * HI_Q8_0_BYTES;
        return __fmul_rn((float)(signed char)b[2 + j], hi_h2f(*(const u16*)b));
    }
    const u8* b = (const u8*)c + r * (size_t)(hd / 32 * HI_Q4_0_BYTES) + (d >> 5) * HI_Q4_0_BYTES;
    const int qv = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
    return __fmul_rn((float)(qv - 8), hi_h2f(*(const u16*)b));
}

// the query tile (rows t0 .. t0 + nq of head h, times scale) into Qs, rows ld floats apart (rows past nq: zeros)
__device__ __forceinline__ void att_load_q(float* Qs, const float* __restrict__ q, int ld, int t0, int nq, int h,
                                           int H, int hd, float scale) {
    for (int p = threadIdx.x; p < ATT_BQ * hd; p += blockDim.x) {
        const int i = p / hd, d = p - i * hd;
        Qs[i * ld + d] = i < nq ? q[((size_t)(t0 + i) * H + h) * hd + d] * scale : 0.0f;
    }
}

// the bk cache rows k0 .. k0 + nk of K/V head kvh (a cache of type `type`) into KV as floats, rows ld floats apart
// (rows past nk: zeros)
template <bool TYPED>
__device__ __forceinline__ void att_load_kv(float* KV, const void* __restrict__ c, int type, int ld, int k0, int nk,
                                            int bk, int H_kv, int kvh, int hd) {
    for (int p = threadIdx.x; p < bk * hd; p += blockDim.x) {
        const int j = p / hd, d = p - j * hd;
        KV[j * ld + d] = j < nk ? kv_load<TYPED>(c, type, (size_t)(k0 + j) * H_kv + kvh, hd, d) : 0.0f;
    }
}

// FULL: every key visible to every query row, pos0 carrying the number of keys (the vision tower's attention within
// one image, attn_full); else causal, query row t seeing keys s <= pos0 + t
template <bool TYPED, bool FULL = false>
__device__ __forceinline__ void attn_prefill_body(const float* __restrict__ q, const void* __restrict__ kc,
                                                  const void* __restrict__ vc, const float* __restrict__ gate,
                                                  float* __restrict__ out, int T, int H, int H_kv, int hd, int pos0,
                                                  int bk, float scale, int k_type, int v_type) {
    extern __shared__ float sm[];
    const int ld = hd + 1;
    float* Qs = sm;                    // ATT_BQ x ld
    float* KV = Qs + ATT_BQ * ld;      // bk x ld
    float* Ps = KV + bk * ld;          // ATT_BQ x bk
    float* mrow = Ps + ATT_BQ * bk;    // ATT_BQ
    float* lrow = mrow + ATT_BQ;       // ATT_BQ
    float* crow = lrow + ATT_BQ;       // ATT_BQ

    const int tid = threadIdx.x;
    const int nth = blockDim.x;
    const int qt = gridDim.x - 1 - blockIdx.x;  // the longest (last) query tiles start first
    const int h = blockIdx.y;
    const int kvh = h / (H / H_kv);
    const int t0 = qt * ATT_BQ;
    const int nq = min(ATT_BQ, T - t0);
    const int nqd = ATT_BQ * hd;

    att_load_q(Qs, q, ld, t0, nq, h, H, hd, scale);
    if (tid < ATT_BQ) {
        mrow[tid] = -INFINITY;
        lrow[tid] = 0.0f;
    }
    float acc[ATT_MAXR];
#pragma unroll
    for (int r = 0; r < ATT_MAXR; ++r) acc[r] = 0.0f;

    const int nkeys = FULL ? pos0 : pos0 + t0 + nq;  // keys [0, nkeys) are visible to some row of this tile
    for (int k0 = 0; k0 < nkeys; k0 += bk) {
        const int nk = min(bk, nkeys - k0);
        __syncthreads();  // previous tile's readers of KV are done
        att_load_kv<TYPED>(KV, kc, k_type, ld, k0, nk, bk, H_kv, kvh, hd);
        __syncthreads();
        for (int p = tid; p < ATT_BQ * bk; p += nth) {
            const int i = p / bk, j = p - (p / bk) * bk;
            // the last key row i may see (padding rows: as nq-1)
            const int last = FULL ? pos0 - 1 : pos0 + t0 + min(i, nq - 1);
            float s = -INFINITY;
            if (j < nk && k0 + j <= last) {
                const float* a = Qs + i * ld;
                const float* b = KV + j * ld;
                float dot = 0.0f;
                for (int d = 0; d < hd; ++d) dot = fmaf(a[d], b[d], dot);
                s = dot;
            }
            Ps[p] = s;
        }
        __syncthreads();
        if (tid < ATT_BQ) {
            float* pr = Ps + tid * bk;
            const float m_old = mrow[tid];
            float mx = m_old;
            for (int j = 0; j < nk; ++j) mx = fmaxf(mx, pr[j]);
            float sum = 0.0f;
            for (int j = 0; j < bk; ++j) {
                const float e = j < nk ? expf(pr[j] - mx) : 0.0f;
                pr[j] = e;
                sum += e;
            }
            const float c = expf(m_old - mx);  // 0 on the first tile (m_old = -inf)
            lrow[tid] = fmaf(lrow[tid], c, sum);
            mrow[tid] = mx;
            crow[tid] = c;
        }
        att_load_kv<TYPED>(KV, vc, v_type, ld, k0, nk, bk, H_kv, kvh, hd);  // V over K: scores are in Ps already
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ATT_MAXR; ++r) {
            const int p = tid + r * nth;
            if (p < nqd) {
                const int i = p / hd, d = p - (p / hd) * hd;
                const float* pr = Ps + i * bk;
                const float* vv = KV + d;
                float a = acc[r] * crow[i];
                for (int j = 0; j < nk; ++j) a = fmaf(pr[j], vv[j * ld], a);
                acc[r] = a;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ATT_MAXR; ++r) {
        const int p = tid + r * nth;
        if (p < nqd) {
            const int i = p / hd, d = p - (p / hd) * hd;
            if (i < nq) {
                float o = acc[r] / lrow[i];
                const size_t t = (size_t)(t0 + i);
                if (gate) o *= pf_sigmoid(gate[(t * H + h) * hd + d]);
                out[(t * H + h) * hd + d] = o;
            }
        }
    }
}

extern "C" __global__ void attn_prefill(const float* __restrict__ q, const float* __restrict__ kc,
                                        const float* __restrict__ vc, const float* __restrict__ gate,
                                        float* __restrict__ out, int T, int H, int H_kv, int hd, int pos0,
                                        int bk, float scale) {
    attn_prefill_body<false>(q, kc, vc, gate, out, T, H, H_kv, hd, pos0, bk, scale, HI_F32, HI_F32);
}

// full (non-causal) attention of T query rows over n_keys key rows, K/V head h for query head h: q [T, H, hd],
// k and v [n_keys, H, hd], out [T, H, hd] (the vision tower's attention over one image's patches)
extern "C" __global__ void attn_full(const float* __restrict__ q, const float* __restrict__ k,
                                     const float* __restrict__ v, float* __restrict__ out, int T, int H, int hd,
                                     int n_keys, int bk, float scale) {
    attn_prefill_body<false, true>(q, k, v, NULL, out, T, H, H, hd, n_keys, bk, scale, HI_F32, HI_F32);
}

// attn_prefill over caches of ggml types k_type / v_type (f32, f16, q8_0, q4_0)
extern "C" __global__ void attn_prefill_kv(const float* __restrict__ q, const void* __restrict__ kc,
                                           const void* __restrict__ vc, const float* __restrict__ gate,
                                           float* __restrict__ out, int T, int H, int H_kv, int hd, int pos0,
                                           int bk, float scale, int k_type, int v_type) {
    attn_prefill_body<true>(q, kc, vc, gate, out, T, H, H_kv, hd, pos0, bk, scale, k_type, v_type);
}

#include "attention_tiled.cuh"

// fp32 -> fp16 bits, rounded to nearest even: a conversion (cvt), available on every PTX target; widened to 32 bits
// inside the asm (a 16-bit asm output whose low byte alone was used came back as 0 from one compiler)
__device__ __forceinline__ u16 hi_f2h(float f) {
    u32 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; cvt.u32.u16 %0, t; }" : "=r"(h) : "f"(f));
    return (u16)h;
}

// quantize_row_q8_0 of x[0..32) (AVX builds: d = amax / 127, id = 127 / amax, q = round half even (x * id)); the
// block's scale and values written when y is set, the values x takes back (q * fp16(d)) written to r when set
__device__ __forceinline__ void q8_0_block(const float* x, u8* y, float* r) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
    const float d = __fdiv_rn(amax, 127.0f), id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    const u16 dh = hi_f2h(d);
    const float df = hi_h2f(dh);
    if (y) {
        y[0] = (u8)(dh & 0xff);
        y[1] = (u8)(dh >> 8);
    }
    for (int j = 0; j < 32; ++j) {
        const float qv = rintf(__fmul_rn(x[j], id));
        if (y) y[2 + j] = (u8)(signed char)(int)qv;
        if (r) r[j] = __fmul_rn(qv, df);
    }
}

// quantize_row_q4_0_ref of x[0..32): d = (the value of largest magnitude) / -8, q = min(15, (int8)(x / d + 8.5))
__device__ __forceinline__ void q4_0_block(const float* x, u8* y) {
    float amax = 0.0f, mx = 0.0f;
    for (int j = 0; j < 32; ++j)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            mx = x[j];
        }
    const float d = __fdiv_rn(mx, -8.0f), id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    const u16 dh = hi_f2h(d);
    y[0] = (u8)(dh & 0xff);
    y[1] = (u8)(dh >> 8);
    for (int j = 0; j < 16; ++j) {
        const int a = min(15, (int)(signed char)(int)__fadd_rn(__fmul_rn(x[j], id), 8.5f));
        const int b = min(15, (int)(signed char)(int)__fadd_rn(__fmul_rn(x[16 + j], id), 8.5f));
        y[2 + j] = (u8)(a | (b << 4));
    }
}

// the level nearest y of n ascending levels (a tie to the lower), as hi_lm_code
__device__ __forceinline__ int lm_code(const float* lv, int n, float y) {
    int c = 0;
    for (int j = 0; j + 1 < n; ++j) c += y > __fmul_rn(0.5f, __fadd_rn(lv[j], lv[j + 1]));
    return c;
}

// hi_lm_encode of x[0..32): of six fp16 scales (0.8 .. 1.2 times the RMS, squares fused in order; the largest
// magnitude over the outermost level) the one leaving the least squared error (double, in order), then the codes
__device__ __forceinline__ void lm_block(int type, const float* x, u8* y) {
    const float* lv = type == HI_LM3 ? c_lm3 : c_lm4;
    const int n = type == HI_LM3 ? 8 : 16;
    const float mul[5] = {0.8f, 0.9f, 1.0f, 1.1f, 1.2f};
    float s = 0.0f, amax = 0.0f;
    for (int j = 0; j < 32; ++j) {
        s = __fmaf_rn(x[j], x[j], s);
        amax = fmaxf(amax, fabsf(x[j]));
    }
    const float rms = sqrtf(__fdiv_rn(s, 32.0f));
    u16 dh = 0;
    double best = 1e300;
    for (int k = 0; k < 6; ++k) {
        const u16 h = hi_f2h(k < 5 ? __fmul_rn(rms, mul[k]) : __fdiv_rn(amax, lv[n - 1]));
        const float d = hi_h2f(h), id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        double err = 0.0;
        for (int j = 0; j < 32; ++j) {
            const float e = __fsub_rn(x[j], __fmul_rn(d, lv[lm_code(lv, n, __fmul_rn(x[j], id))]));
            err = __dadd_rn(err, __dmul_rn((double)e, (double)e));
        }
        if (err < best) {
            best = err;
            dh = h;
        }
    }
    const float d = hi_h2f(dh), id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    y[0] = (u8)(dh & 0xff);
    y[1] = (u8)(dh >> 8);
    if (type == HI_LM3) {
        for (int k = 0; k < 4; ++k) {
            u32 w = 0;
            for (int j = 0; j < 8; ++j) w |= (u32)lm_code(lv, 8, __fmul_rn(x[8 * k + j], id)) << (3 * j);
            y[2 + 3 * k] = (u8)(w & 0xff);
            y[3 + 3 * k] = (u8)((w >> 8) & 0xff);
            y[4 + 3 * k] = (u8)(w >> 16);
        }
    } else {
        for (int j = 0; j < 16; ++j)
            y[2 + j] = (u8)(lm_code(lv, 16, __fmul_rn(x[2 * j], id)) | (lm_code(lv, 16, __fmul_rn(x[2 * j + 1], id)) << 4));
    }
}

// T new rows (each `row` = H_kv * hd values, contiguous) of k_new / v_new written into the caches at row pos0 in
// their types: one thread per 32 values (per value for f32 / f16). nb = T * row / 32.
extern "C" __global__ void kv_store(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                   void* __restrict__ k_cache, void* __restrict__ v_cache, int nb, int row,
                                   int pos0, int k_type, int v_type) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < 2 * nb; i += gridDim.x * blockDim.x) {
        const bool is_v = i >= nb;
        const int b = is_v ? i - nb : i, type = is_v ? v_type : k_type;
        const float* x = (is_v ? v_new : k_new) + (size_t)b * 32;
        void* c = is_v ? v_cache : k_cache;
        const size_t e0 = (size_t)pos0 * row + (size_t)b * 32;  // first value's index in the cache
        if (type == HI_F32) {
            for (int j = 0; j < 32; ++j) ((float*)c)[e0 + j] = x[j];
        } else if (type == HI_F16) {
            for (int j = 0; j < 32; ++j) ((u16*)c)[e0 + j] = hi_f2h(x[j]);
        } else if (type == HI_Q8_0) {
            q8_0_block(x, (u8*)c + e0 / 32 * HI_Q8_0_BYTES, 0);
        } else if (type == HI_Q4_0) {
            q4_0_block(x, (u8*)c + e0 / 32 * HI_Q4_0_BYTES);
        } else {
            lm_block(type, x, (u8*)c + e0 / 32 * (type == HI_LM3 ? HI_LM3_BYTES : HI_LM4_BYTES));
        }
    }
}

// the queries (n values, a multiple of 32) rounded through K's vec_dot type, in place: fp16 for f16 K, q8_0 for
// q8_0 / q4_0 K (quantized and taken back); one thread per 32 values
extern "C" __global__ void q_round(float* __restrict__ q, int nb, int k_type) {
    for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += gridDim.x * blockDim.x) {
        float* x = q + (size_t)b * 32;
        if (k_type == HI_F16) {
            for (int j = 0; j < 32; ++j) x[j] = hi_h2f(hi_f2h(x[j]));
        } else {
            float r[32];
            q8_0_block(x, 0, r);
            for (int j = 0; j < 32; ++j) x[j] = r[j];
        }
    }
}

// ggml's Walsh-Hadamard rotation of each n-value chunk of x (n a power of two), in place: every value times
// 1 / sqrtf(n), then the butterflies (u, v) -> (u + v, u - v) over spans 1, 2, 4, ..; one thread per chunk
extern "C" __global__ void kv_fwht(float* __restrict__ x, int chunks, int n) {
    const float s = __fdiv_rn(1.0f, sqrtf((float)n));
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += gridDim.x * blockDim.x) {
        float* r = x + (size_t)c * n;
        for (int j = 0; j < n; ++j) r[j] = __fmul_rn(r[j], s);
        for (int h = 1; h < n; h <<= 1)
            for (int i = 0; i < n; i += 2 * h)
                for (int j = i; j < i + h; ++j) {
                    const float u = r[j], v = r[j + h];
                    r[j] = __fadd_rn(u, v);
                    r[j + h] = __fsub_rn(u, v);
                }
    }
}

// out[i] *= sigma(gate[i]) for n elements: the output gate on its own (when attn_prefill ran
// without one). Grid-stride loop, any 1-D grid.
extern "C" __global__ void attn_gate_mul(float* __restrict__ out, const float* __restrict__ gate, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] *= pf_sigmoid(gate[i]);
}

// Append T new rows to the caches: k_cache[pos0 + t] = k_new[t], v_cache likewise.
// k_new, v_new [T, H_kv, hd]; caches [n_ctx, H_kv, hd]; n = T * H_kv * hd. Grid-stride loop.
extern "C" __global__ void kv_append(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                     float* __restrict__ k_cache, float* __restrict__ v_cache, int n,
                                     int row, int pos0) {
    const size_t base = (size_t)pos0 * row;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        k_cache[base + i] = k_new[i];
        v_cache[base + i] = v_new[i];
    }
}

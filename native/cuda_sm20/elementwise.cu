// Row-wise and elementwise ops of the prefill path, fp32, sm_20 subset.
//
// Maths (reference: hybridinfer/reference_ops.py).
//   rms_norm:    y[r, j] = (x[r, j] * inv_r) * w[j],  inv_r = 1 / sqrt(mean_j x[r, j]^2 + eps), j < D.
//                Rows have pitches sx, sy >= D (a q/k norm runs over [T*H, hd] head rows; the q heads of
//                Qwen3.5 sit in rows of 2*hd, [query, gate], so sx = 2*hd normalises the query half).
//                The sum of squares is fp32 per thread, then a shared-memory tree over the block.
//   rope_neox:   for each token t, head h, i < n_rot/2, phi = pos[t] * theta^(-2i/n_rot) (float64, as the
//                numpy reference; cos and sin are rounded to fp32 once):
//                x'_i = x_i cos - x_{i+n_rot/2} sin,  x'_{i+n_rot/2} = x_{i+n_rot/2} cos + x_i sin.
//                Dimensions >= n_rot pass through. x is [T, H, S] (head pitch S >= n_rot), in place.
//                neox = 0 (llama.cpp's NORM mode, llama): the pairs are (2i, 2i+1) instead of (i, i+n_rot/2).
//                s0..s3 > 0 (multimodal rope, llama.cpp's IMROPE): pos is [T, 4] (t, h, w, e) and pair i takes
//                the position of its sector's stream (models/mrope.imrope_streams); all zero: pos is [T].
//   embed_<type>: out[t, :] = dequantize(table[ids[t], :])   (table rows in GGUF form, D % 32 == 0).
//   add:         y += a * x                (a = 1: the residual add, exact)
//   scale:       x *= s
//   swiglu:      out[r, j] = silu(g[r, goff + j]) * u[r, uoff + j],  silu(z) = z / (1 + e^-z)
//   sigmoid_mul: out[r, j] *= sigmoid(g[r, goff + j * gcs])   (gcs = 0: one gate per row)
//   dot_rows:    y[r] = sum_j x[r, j] * w[j]   (a one-row matrix: the shared-expert gate), fp32 per thread,
//                then a shared-memory tree over the block.
// Row-wise kernels run one block per row (grid x loops over rows); flat kernels use grid-stride loops.
#include "common.cuh"

extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    rms_norm_f32(const float* x, const float* __restrict__ w, float* y, int R, int D, int sx, int sy, float eps) {
    __shared__ float red[HI_THREADS];
    for (int r = blockIdx.x; r < R; r += gridDim.x) {
        const float* xr = x + (size_t)r * sx;
        float* yr = y + (size_t)r * sy;
        float ss = 0.0f;
        for (int j = threadIdx.x; j < D; j += blockDim.x) ss = fmaf(xr[j], xr[j], ss);
        ss = hi_block_sum(ss, red);
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int j = threadIdx.x; j < D; j += blockDim.x) yr[j] = __fmul_rn(__fmul_rn(xr[j], inv), w[j]);
    }
}

extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    dot_rows_f32(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int R, int D) {
    __shared__ float red[HI_THREADS];
    for (int r = blockIdx.x; r < R; r += gridDim.x) {
        const float* xr = x + (size_t)r * D;
        float s = 0.0f;
        for (int j = threadIdx.x; j < D; j += blockDim.x) s = fmaf(xr[j], w[j], s);
        s = hi_block_sum(s, red);
        if (threadIdx.x == 0) y[r] = s;
    }
}

#define ROPE_MAX_HALF 256

extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    rope_neox_f32(float* x, const int* __restrict__ pos, int T, int H, int S, int n_rot, double theta, int neox,
                  int s0, int s1, int s2, int s3) {
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    const int half = n_rot >> 1;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        __syncthreads();  // the previous token's readers of cs, sn are done
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            const double wi = pow(theta, -(double)(2 * i) / (double)n_rot);
            int p = pos[t];
            if (s0 + s1 + s2 + s3 > 0) {  // IMROPE: pos is [T, 4]; pair i takes the stream of its sector
                const int sec = i % (s0 + s1 + s2 + s3);
                const int k = (sec % 3 == 1 && sec < 3 * s1) ? 1
                            : (sec % 3 == 2 && sec < 3 * s2) ? 2
                            : (sec % 3 == 0 && sec < 3 * s0) ? 0 : 3;
                p = pos[4 * t + k];
            }
            double s, c;
            sincos((double)p * wi, &s, &c);
            cs[i] = (float)c;
            sn[i] = (float)s;
        }
        __syncthreads();
        float* xt = x + (size_t)t * H * S;
        for (int p = threadIdx.x; p < H * half; p += blockDim.x) {
            const int h = p / half, i = p - h * half;
            float* xh = xt + (size_t)h * S;
            const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
            const float a = xh[ia], b = xh[ib];
            xh[ia] = __fsub_rn(__fmul_rn(a, cs[i]), __fmul_rn(b, sn[i]));
            xh[ib] = __fadd_rn(__fmul_rn(b, cs[i]), __fmul_rn(a, sn[i]));
        }
    }
}

// table [V, D] GGUF rows of row_nbytes; ids [T] int32 in 0..V-1; out [T, D] f32
template <int QT>
__device__ __forceinline__ void embed_body(const u8* __restrict__ table, const int* __restrict__ ids,
                                           float* __restrict__ out, int T, int D, int row_nbytes) {
    const int n16 = D >> 4;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const u8* row = table + (size_t)ids[t] * row_nbytes;
        float* o = out + (size_t)t * D;
        for (int p = threadIdx.x; p < n16; p += blockDim.x) {
            float v[16];
            hi_deq16<QT>(row, p >> 1, p & 1, v);
            float4* o4 = (float4*)(o + 16 * p);
#pragma unroll
            for (int i = 0; i < 4; ++i) o4[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        }
    }
}

#define EMBED_KERNEL(name, QT)                                                                                \
    extern "C" __global__ void HI_BOUNDS(HI_THREADS) embed_##name(                                   \
        const u8* __restrict__ table, const int* __restrict__ ids, float* __restrict__ out, int T, int D,     \
        int row_nbytes) {                                                                                     \
        embed_body<QT>(table, ids, out, T, D, row_nbytes);                                                    \
    }

EMBED_KERNEL(f32, HI_F32)
EMBED_KERNEL(f16, HI_F16)
EMBED_KERNEL(q4_0, HI_Q4_0)
EMBED_KERNEL(q4_1, HI_Q4_1)
EMBED_KERNEL(q8_0, HI_Q8_0)
EMBED_KERNEL(q4_k, HI_Q4_K)
EMBED_KERNEL(q5_k, HI_Q5_K)
EMBED_KERNEL(q6_k, HI_Q6_K)

// y[i] += a * x[i], i < n
extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    add_f32(float* __restrict__ y, const float* __restrict__ x, float a, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = fmaf(a, x[i], y[i]);
}

// x[i] *= s, i < n
extern "C" __global__ void HI_BOUNDS(HI_THREADS) scale_f32(float* __restrict__ x, float s, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] *= s;
}

// out [R, F]; g rows of pitch sg read from column goff, u rows of pitch su from column uoff
extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    swiglu_f32(const float* g, const float* u, float* out, int R, int F, int sg, int goff, int su, int uoff) {
    const int n = R * F;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int r = i / F, j = i - r * F;
        out[i] = __fmul_rn(hi_silu(g[(size_t)r * sg + goff + j]), u[(size_t)r * su + uoff + j]);
    }
}

// out [R, D] in place; gate of element (r, j) at g[r * sg + goff + j * gcs]
extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    sigmoid_mul_f32(float* out, const float* g, int R, int D, int sg, int goff, int gcs) {
    const int n = R * D;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int r = i / D, j = i - r * D;
        out[i] = __fmul_rn(out[i], hi_sigmoid(g[(size_t)r * sg + goff + j * gcs]));
    }
}

// ---- the vision tower's row ops (backends/gpu/vision.py; reference: backends/vision.py RefVisionOps) ----------
// Each row written with a pitch (sy) past its D or N values is zero-padded there: the products step K by 32.

__device__ __forceinline__ double vit_block_sum_d(double v, double* red) {
    const int tid = threadIdx.x;
    red[tid] = v;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    const double r = red[0];
    __syncthreads();
    return r;
}

// layer_norm: y[r, j] = float((x[r, j] - mu) / sqrt(var + eps)) * w[j] + b[j], j < D, the row's mean and variance
// in double (the reference's float64 statistics); y[r, j] = 0 for D <= j < sy. x rows of pitch sx; one block a row.
extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    layer_norm_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                   float* __restrict__ y, int sx, int sy, int R, int D, double eps) {
    __shared__ double red[HI_THREADS];
    for (int r = blockIdx.x; r < R; r += gridDim.x) {
        const float* xr = x + (size_t)r * sx;
        float* yr = y + (size_t)r * sy;
        double s = 0.0;
        for (int j = threadIdx.x; j < D; j += blockDim.x) s += (double)xr[j];
        const double mu = vit_block_sum_d(s, red) / (double)D;
        double ss = 0.0;
        for (int j = threadIdx.x; j < D; j += blockDim.x) {
            const double d = (double)xr[j] - mu;
            ss += d * d;
        }
        const double sd = sqrt(vit_block_sum_d(ss, red) / (double)D + eps);
        for (int j = threadIdx.x; j < sy; j += blockDim.x)
            yr[j] = j < D ? __fadd_rn(__fmul_rn((float)(((double)xr[j] - mu) / sd), w[j]), b[j]) : 0.0f;
    }
}

// 0.5 x (1 + tanh(c (x + 0.044715 x^3))) in the reference's order of roundings (RefVisionOps.gelu_tanh)
__device__ __forceinline__ float vit_gelu_tanh(float x) {
    float t = __fmul_rn(__fmul_rn(__fmul_rn(x, 0.044715f), x), x);
    t = tanhf(__fmul_rn(__fadd_rn(t, x), 0.7978845608028654f));
    return __fmul_rn(__fmul_rn(x, 0.5f), __fadd_rn(t, 1.0f));
}

// torch's nn.GELU(): x/2 (1 + erf(x / sqrt 2)) in double, then rounded (the reference's numba kernel)
__device__ __forceinline__ float vit_gelu_erf(float x) {
    const double xd = (double)x;
    return (float)(0.5 * xd * (1.0 + erf(xd * 0.7071067811865476)));
}

#define VIT_STORE 0
#define VIT_GELU_TANH 1
#define VIT_GELU_ERF 2
#define VIT_ADD 3

// A product's epilogue: v = x[r, j] + b[j] (b NULL: x[r, j]), j < N, rows of x of pitch sx; then y[r, j] = v
// (VIT_STORE), gelu_tanh(v), gelu_erf(v), or y[r, j] + v (VIT_ADD: the residual). y rows of pitch sy; columns
// N <= j < sy are zeroed except under VIT_ADD (left). x may be y when sx == sy.
extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    bias_act_f32(const float* x, const float* __restrict__ b, float* y, int sx, int sy, int R, int N, int mode) {
    const int n = R * sy;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int r = i / sy, j = i - r * sy;
        if (j >= N) {
            if (mode != VIT_ADD) y[i] = 0.0f;
            continue;
        }
        float v = x[(size_t)r * sx + j];
        if (b) v = __fadd_rn(v, b[j]);
        if (mode == VIT_GELU_TANH) v = vit_gelu_tanh(v);
        if (mode == VIT_GELU_ERF) v = vit_gelu_erf(v);
        y[i] = mode == VIT_ADD ? __fadd_rn(y[i], v) : v;
    }
}

// The attention's operands from the qkv product's rows y [n, 3, H, hd] plus b [3 H hd]: q and k rotated, v as it
// is, into out [3, n, H, hd]. x cos + rotate_half(x) sin, rotate_half(x) = [-x[hd/2:], x[:hd/2]], cos and sin
// [n, hd] (the reference's rotate, each product rounded, then the sum).
extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    vit_rope_split_f32(const float* __restrict__ y, const float* __restrict__ b, const float* __restrict__ cs,
                       const float* __restrict__ sn, float* __restrict__ out, int n, int H, int hd) {
    const int C = H * hd, C3 = 3 * C, half = hd >> 1;
    const int total = n * C3;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int t = i / C3, c3 = i - t * C3, s = c3 / C, c = c3 - s * C, d = c % hd;
        float v = __fadd_rn(y[i], b[c3]);
        if (s < 2) {
            const int pc = d < half ? c3 + half : c3 - half;
            const float p = __fadd_rn(y[(size_t)t * C3 + pc], b[pc]);
            const size_t e = (size_t)t * hd + d;
            v = __fadd_rn(__fmul_rn(v, cs[e]), __fmul_rn(d < half ? -p : p, sn[e]));
        }
        out[((size_t)s * n + t) * C + c] = v;
    }
}

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

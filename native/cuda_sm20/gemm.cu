// Dequantize-and-multiply GEMM, fp32, sm_20 subset.
//
// Maths. Y[t, n] = sum_k X[t, k] * W[n, k]  (Y = X W^T), X [T, K] float32 row-major, W [N, K] stored as
// GGUF rows (row_nbytes bytes per row of K weights, whole blocks), dequantized exactly as
// hybridinfer.quant.dequantize does (common.cuh hi_deq16). Sums are fp32 FMA chains over k in order
// within each thread, so the result is the float64 product of the dequantized operands to within
// about sqrt(K) fp32 roundings of sum_k |X[t,k] W[n,k]|.
//
// Grouped form (MoE): W is [E, N, K]; expert e multiplies the rows r = offs[e] .. offs[e+1]-1 of the
// grouped order, reading input row X[idx[r]] (X[r] where idx is NULL) and writing Y[r]:
//   Y[r, n] = sum_k X[idx[r], k] * W[e, n, k]   for offs[e] <= r < offs[e+1].
// The plain GEMM is the grouped one with E = 1, offs = {0, T} (passed as NULL, M = T), idx = NULL.
//
// Tiling. A block of 256 threads computes a BM x 128 tile of Y (BM = 16 TM tokens x 128 weight rows,
// TM = 1, 2, 4, 8): thread (ty, tx) = (tid / 16, tid % 16) holds TM tokens ty*TM + i and 8 rows
// tx*4 + j, 64 + tx*4 + j in registers. K advances by 32 (one quant chunk): the X tile (BM x 32, rows
// padded to 36 floats) and the dequantized W tile (32 x 128, k-major) are staged in shared memory, W by
// two threads per row (16 weights each). The global loads of chunk c+1 (X rows and raw W bytes, kept in
// registers) are issued before chunk c is multiplied, and dequantized into shared memory after it.
// Grid x walks the N tiles, grid y the "virtual" T tiles: expert e owns ceil(cnt_e / BM) consecutive
// tiles; a block finds its (e, tile) by a block prefix sum over the experts' tile counts. Both grid
// dimensions loop (stride gridDim), so any T and N fit sm_20's 65535 limit. Shared memory: at most
// 128 x 36 + 32 x 128 floats + 256 ints = 36 KB (BM = 128).
#include "common.cuh"

#define GEMM_BK 32
#define GEMM_BN 128
#define GEMM_XLD (GEMM_BK + 4)  // X tile row pitch (floats): 16-byte aligned rows, fewer bank conflicts

// Find the expert and tile of virtual tile v: returns false when v is past the last tile.
__device__ __forceinline__ bool gemm_find_tile(const int* __restrict__ offs, int E, int M, int BM, int v,
                                               int* e_out, int* r0_out, int* cnt_out, int* scan) {
    __shared__ int s_e, s_tile;
    const int tid = threadIdx.x;
    if (offs == NULL || E == 1) {  // one group: rows [0, M) (offs NULL) or [offs[0], offs[1])
        const int r0 = offs ? offs[0] : 0, cnt = offs ? offs[1] - r0 : M;
        if (v * BM >= cnt) return false;
        *e_out = 0;
        *r0_out = r0 + v * BM;
        *cnt_out = min(BM, cnt - v * BM);
        return true;
    }
    if (tid == 0) s_e = -1;
    int carry = 0;
    for (int base = 0; base < E; base += HI_THREADS) {
        const int e = base + tid;
        const int nt = e < E ? (offs[e + 1] - offs[e] + BM - 1) / BM : 0;
        scan[tid] = nt;
        __syncthreads();
        for (int off = 1; off < HI_THREADS; off <<= 1) {
            const int add = tid >= off ? scan[tid - off] : 0;
            __syncthreads();
            scan[tid] += add;
            __syncthreads();
        }
        const int incl = carry + scan[tid];
        if (nt > 0 && v >= incl - nt && v < incl) {
            s_e = e;
            s_tile = v - (incl - nt);
        }
        carry += scan[HI_THREADS - 1];
        __syncthreads();
    }
    __syncthreads();
    const int e = s_e, tile = s_tile;
    __syncthreads();  // s_e is rewritten by the next call
    if (e < 0) return false;
    const int cnt = offs[e + 1] - offs[e];
    *e_out = e;
    *r0_out = offs[e] + tile * BM;
    *cnt_out = min(BM, cnt - tile * BM);
    return true;
}

// X rows of chunk c into registers: float4 p = tid + i*256 is row p / 8, columns 4 (p % 8) .. +3
template <int XL>
__device__ __forceinline__ void gemm_load_x(float4 xr[XL], const float* const xrow[XL], int c, int cnt, int BM) {
#pragma unroll
    for (int i = 0; i < XL; ++i) {
        const int p = threadIdx.x + i * HI_THREADS;
        const int m = p >> 3, q4 = p & 7;
        xr[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (p < BM * 8 && m < cnt) xr[i] = *(const float4*)(xrow[i] + c * GEMM_BK + 4 * q4);
    }
}

// staged registers -> shared tiles: X row-major (pitch GEMM_XLD), W k-major (row wn, k = 16 wh + j)
template <int QT, int XL>
__device__ __forceinline__ void gemm_store(const float4 xr[XL], const HiQ<QT>& wq, float* Xs, float* Ws, int BM,
                                           int wn, int wh, bool wok) {
#pragma unroll
    for (int i = 0; i < XL; ++i) {
        const int p = threadIdx.x + i * HI_THREADS;
        if (p < BM * 8) *(float4*)(Xs + (p >> 3) * GEMM_XLD + 4 * (p & 7)) = xr[i];
    }
    float wv[16];
    wq.get(wv);
#pragma unroll
    for (int j = 0; j < 16; ++j) Ws[(16 * wh + j) * GEMM_BN + wn] = wok ? wv[j] : 0.0f;
}

template <int QT, int TM>
__device__ __forceinline__ void gemm_body(const float* __restrict__ X, const u8* __restrict__ W,
                                          float* __restrict__ Y, const int* __restrict__ offs,
                                          const int* __restrict__ idx, int E, int M, int N, int K, int row_nbytes) {
    const int BM = 16 * TM;
    const int XL = (BM * 8 + HI_THREADS - 1) / HI_THREADS;  // float4 X loads per thread per k step
    __shared__ __align__(16) float Xs[BM * GEMM_XLD];
    __shared__ __align__(16) float Ws[GEMM_BK * GEMM_BN];
    __shared__ int scan[HI_THREADS];

    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const int wn = tid & (GEMM_BN - 1), wh = tid >> 7;  // W staging: row and half-chunk of this thread
    const int n_tiles = (N + GEMM_BN - 1) / GEMM_BN;
    const int n_chunks = K / GEMM_BK;

    for (int v = blockIdx.y;; v += gridDim.y) {
        int e, r0, cnt;
        if (!gemm_find_tile(offs, E, M, BM, v, &e, &r0, &cnt, scan)) return;
        // input rows this thread stages (clamped to a valid row; padding rows are zeroed at staging)
        const float* xrow[XL];
#pragma unroll
        for (int i = 0; i < XL; ++i) {
            const int m = (tid + i * HI_THREADS) >> 3;
            const int r = r0 + min(m, cnt - 1);
            xrow[i] = X + (size_t)(idx ? idx[r] : r) * K;
        }
        const u8* Wexp = W + (size_t)e * N * row_nbytes;

        for (int nt = blockIdx.x; nt < n_tiles; nt += gridDim.x) {
            const int n0 = nt * GEMM_BN;
            const int wrow = n0 + wn;
            const bool wok = wrow < N;
            const u8* wptr = Wexp + (size_t)min(wrow, N - 1) * row_nbytes;
            float acc[TM][8];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

            // software pipeline: the global loads of chunk c+1 (X rows, raw W bytes) are in flight while
            // chunk c is multiplied out of shared memory
            float4 xr[XL];
            HiQ<QT> wq;
            gemm_load_x<XL>(xr, xrow, 0, cnt, BM);
            wq.load(wptr, 0, wh);
            gemm_store<QT, XL>(xr, wq, Xs, Ws, BM, wn, wh, wok);
            __syncthreads();
            for (int c = 0; c < n_chunks; ++c) {
                const bool more = c + 1 < n_chunks;
                if (more) {
                    gemm_load_x<XL>(xr, xrow, c + 1, cnt, BM);
                    wq.load(wptr, c + 1, wh);
                }
#pragma unroll
                for (int kk = 0; kk < GEMM_BK; kk += 4) {
                    float4 xa[TM];
#pragma unroll
                    for (int i = 0; i < TM; ++i) xa[i] = *(const float4*)(Xs + (ty * TM + i) * GEMM_XLD + kk);
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const float4 b0 = *(const float4*)(Ws + (kk + q) * GEMM_BN + 4 * tx);
                        const float4 b1 = *(const float4*)(Ws + (kk + q) * GEMM_BN + 64 + 4 * tx);
#pragma unroll
                        for (int i = 0; i < TM; ++i) {
                            const float a = q == 0 ? xa[i].x : q == 1 ? xa[i].y : q == 2 ? xa[i].z : xa[i].w;
                            acc[i][0] = fmaf(a, b0.x, acc[i][0]);
                            acc[i][1] = fmaf(a, b0.y, acc[i][1]);
                            acc[i][2] = fmaf(a, b0.z, acc[i][2]);
                            acc[i][3] = fmaf(a, b0.w, acc[i][3]);
                            acc[i][4] = fmaf(a, b1.x, acc[i][4]);
                            acc[i][5] = fmaf(a, b1.y, acc[i][5]);
                            acc[i][6] = fmaf(a, b1.z, acc[i][6]);
                            acc[i][7] = fmaf(a, b1.w, acc[i][7]);
                        }
                    }
                }
                __syncthreads();  // every thread is done reading chunk c
                if (more) gemm_store<QT, XL>(xr, wq, Xs, Ws, BM, wn, wh, wok);
                __syncthreads();
            }

            // write Y rows r0 + m, columns n0 + 4tx + j and n0 + 64 + 4tx + j
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                const int m = ty * TM + i;
                if (m >= cnt) continue;
                float* yrow = Y + (size_t)(r0 + m) * N;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int n = n0 + 64 * half + 4 * tx;
                    if ((N & 3) == 0 && n + 3 < N) {
                        *(float4*)(yrow + n) = make_float4(acc[i][4 * half], acc[i][4 * half + 1],
                                                           acc[i][4 * half + 2], acc[i][4 * half + 3]);
                    } else {
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            if (n + j < N) yrow[n + j] = acc[i][4 * half + j];
                    }
                }
            }
        }
    }
}

// One entry point per (weight type, BM): name gemm_<type>_b<BM>.
//   X [*, K] f32; W [E, N, K] GGUF rows; Y [M, N] f32; offs [E+1] int32, non-decreasing, offs[E] <= M,
//   or NULL for one group of M rows (E = 1, the plain GEMM); idx [M] int32 row indices into X, or NULL
//   for X rows in grouped order.
#define GEMM_KERNEL(NAME, QT, TM)                                                                              \
    extern "C" __global__ void __launch_bounds__(HI_THREADS)                                                  \
        NAME(const float* __restrict__ X, const u8* __restrict__ W, float* __restrict__ Y,                    \
             const int* __restrict__ offs, const int* __restrict__ idx, int E, int M, int N, int K,          \
             int row_nbytes) {                                                                                 \
        gemm_body<QT, TM>(X, W, Y, offs, idx, E, M, N, K, row_nbytes);                                        \
    }

#define GEMM_TYPE(name, QT)                 \
    GEMM_KERNEL(gemm_##name##_b16, QT, 1)   \
    GEMM_KERNEL(gemm_##name##_b32, QT, 2)   \
    GEMM_KERNEL(gemm_##name##_b64, QT, 4)   \
    GEMM_KERNEL(gemm_##name##_b128, QT, 8)

GEMM_TYPE(f32, HI_F32)
GEMM_TYPE(f16, HI_F16)
GEMM_TYPE(q4_0, HI_Q4_0)
GEMM_TYPE(q8_0, HI_Q8_0)
GEMM_TYPE(q4_k, HI_Q4_K)
GEMM_TYPE(q5_k, HI_Q5_K)
GEMM_TYPE(q6_k, HI_Q6_K)

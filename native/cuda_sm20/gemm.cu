// Dequantize-and-multiply GEMM, fp32, sm_20 subset.
//
// Maths. Y[t, n] = sum_k X[t, k] * W[n, k]  (Y = X W^T), X [T, K] float32 row-major, W [N, K] stored as
// GGUF rows (row_nbytes bytes per row of K weights, whole blocks), dequantized as hybridinfer.quant.dequantize
// does (to within one rounding of each weight: gemm_deq). Sums are fp32 FMA chains over k in order within
// each thread, so the result is the float64 product of the dequantized operands to within about sqrt(K)
// fp32 roundings of sum_k |X[t,k] W[n,k]|.
//
// Grouped form (MoE): W is [E, N, K]; expert e multiplies the rows r = offs[e] .. offs[e+1]-1 of the
// grouped order, reading input row X[idx[r]] (X[r] where idx is NULL) and writing Y[r]:
//   Y[r, n] = sum_k X[idx[r], k] * W[e, n, k]   for offs[e] <= r < offs[e+1].
// The plain GEMM is the grouped one with E = 1, offs = {0, T} (passed as NULL, M = T), idx = NULL.
//
// Tiling. A block of 256 threads computes a BM x BN tile of Y: TYN x TXN threads (TYN * TXN = 256),
// each holding TM tokens ty + TYN i and 8 weight rows 4 tx + j, 4 TXN + 4 tx + j in registers (a warp
// spans 4 ty x 8 tx, so every float4 shared load reads 128 distinct bytes). K advances by BK = 32: the
// X tile (BM x BK, rows padded to BK + 4 floats) and the dequantized W tile
// (BK x BN, k-major) are staged in shared memory, W in pieces of 16 weights of a row. The global loads
// of chunk c+1 (X rows and raw W bytes, kept in registers) are issued before chunk c is multiplied, and
// dequantized into shared memory after it.
// Grid x walks the N tiles, grid y the "virtual" T tiles: expert e owns ceil(cnt_e / BM) consecutive
// tiles; a block finds its (e, tile) by a block prefix sum over the experts' tile counts. Both grid
// dimensions loop (stride gridDim), so any T and N fit sm_20's 65535 limit. Shared memory: at most
// 36 KB (BM = 128: 128 x 36 + 32 x 128 floats + 256 ints).
//
// Split over K (ksplit > 1, for products of too few tiles to fill the card): grid z is the part; part z sums
// the k chunks [gemm_kchunk(z), gemm_kchunk(z + 1)) and writes its partial sums to slab z of Y, then [ksplit, M,
// N] (a scratch the launcher passes); ksplit_sum adds the slabs into the output in order, ((Y_0 + Y_1) + Y_2) ...
// per element, so the result does not depend on the grid. (Every part writes a slab, so the write needs no
// second pointer: one register more there made the 63-register bodies spill.)
#include "common.cuh"

// first k chunk of part z when n_chunks are split into ksplit parts (the last parts may be empty)
__device__ __forceinline__ int gemm_kchunk(int n_chunks, int ksplit, int z) {
    const int per = (n_chunks + ksplit - 1) / ksplit;
    return min(n_chunks, z * per);
}


// Find the expert and tile of virtual tile v: returns false when v is past the last tile.
__device__ __forceinline__ bool gemm_find_tile(const int* __restrict__ offs, int E, int M, int BM, int v,
                                               int* e_out, int* r0_out, int* cnt_out, int* scan, int tid) {
    __shared__ int s_e, s_tile;
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

// X rows of k-chunk c (BK columns) into registers: float4 p = tid + i*256 is row p / (BK/4), columns
// 4 (p % (BK/4)) .. +3 of the chunk
template <int XL, int BK>
__device__ __forceinline__ void gemm_load_x(float4 xr[XL], const float* const xrow[XL], int c, int cnt, int BM) {
#pragma unroll
    for (int i = 0; i < XL; ++i) {
        const int p = threadIdx.x + i * HI_THREADS;
        const int m = p / (BK / 4), q4 = p % (BK / 4);
        xr[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (p < BM * (BK / 4) && m < cnt) xr[i] = *(const float4*)(xrow[i] + c * BK + 4 * q4);
    }
}

// Dequantization for the GEMM's W tile: v[j] = weight j of the piece, or 0 where !ok (a row past N).
// Unlike HiQ::get (bit-equal to quant.dequantize, for the embedding), the K-quants here use one FMA for
// scale and min (as nvcc's default contraction does to llama.cpp's CUDA dequantizers) and turn a small
// integer q into a float as 2^23 + q (its bits 0x4B000000 | q) minus 2^23, both exact, instead of a
// slower int-to-float conversion; a row past N gets zero scales instead of a select per weight.
__device__ __forceinline__ float hi_small_u2f(u32 q) { return __int_as_float(0x4B000000u | q) - 8388608.0f; }

// Q4_K / Q5_K sub-block scale d * sc[s] and min dmin * m[s] (both 0 for a row past N)
__device__ __forceinline__ void gemm_k4_scales(const HiK4Head& q, bool ok, float* ds, float* dm) {
    q.scales(ds, dm);
    *ds = ok ? *ds : 0.0f;
    *dm = ok ? *dm : 0.0f;
}

template <int QT>
__device__ __forceinline__ void gemm_deq(const HiQ<QT>& q, float v[16], bool ok) {
    q.get(v);
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = ok ? v[j] : 0.0f;
}

template <>
__device__ __forceinline__ void gemm_deq<HI_Q4_K>(const HiQ<HI_Q4_K>& q, float v[16], bool ok) {
    float ds, dm;
    gemm_k4_scales(q, ok, &ds, &dm);
    const int sh = 4 * (q.s & 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 w = q.w[i] >> sh;
#pragma unroll
        for (int b = 0; b < 4; ++b) v[4 * i + b] = fmaf(ds, hi_small_u2f((w >> (8 * b)) & 15u), -dm);
    }
}

template <>
__device__ __forceinline__ void gemm_deq<HI_Q5_K>(const HiQ<HI_Q5_K>& q, float v[16], bool ok) {
    float ds, dm;
    gemm_k4_scales(q, ok, &ds, &dm);
    const int sh = 4 * (q.s & 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 w = q.w[i] >> sh, h = q.qh[i] >> q.s;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const u32 x = ((w >> (8 * b)) & 15u) | (((h >> (8 * b)) & 1u) << 4);
            v[4 * i + b] = fmaf(ds, hi_small_u2f(x), -dm);
        }
    }
}

template <>
__device__ __forceinline__ void gemm_deq<HI_Q6_K>(const HiQ<HI_Q6_K>& q, float v[16], bool ok) {
    const float ds = ok ? hi_h2f((u16)q.d) * (float)q.sc : 0.0f;
    const int shl = 4 * (q.s >> 1), shh = 2 * q.s;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 lo = q.ql[i] >> shl, hi = q.qh[i] >> shh;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const u32 x = ((lo >> (8 * b)) & 15u) | (((hi >> (8 * b)) & 3u) << 4);
            v[4 * i + b] = ds * (__int_as_float(0x4B000000u | x) - 8388640.0f);  // q - 32, exact
        }
    }
}

template <>
__device__ __forceinline__ void gemm_deq<HI_Q8_0>(const HiQ<HI_Q8_0>& q, float v[16], bool ok) {
    const float d = ok ? hi_h2f((u16)q.d) : 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int b = 0; b < 4; ++b) {  // int8 q as the byte q + 128 (flipped sign bit), less 128
            const u32 x = ((q.w[i] >> (8 * b)) & 255u) ^ 128u;
            v[4 * i + b] = (__int_as_float(0x4B000000u | x) - 8388736.0f) * d;
        }
}

template <>
__device__ __forceinline__ void gemm_deq<HI_Q4_0>(const HiQ<HI_Q4_0>& q, float v[16], bool ok) {
    const float d = ok ? hi_h2f((u16)q.d) : 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 w = q.w[i] >> q.sh;
#pragma unroll
        for (int b = 0; b < 4; ++b)  // q - 8
            v[4 * i + b] = d * (__int_as_float(0x4B000000u | ((w >> (8 * b)) & 15u)) - 8388616.0f);
    }
}

// staged registers -> shared tiles: X row-major (pitch BK + 4: 16-byte aligned rows, fewer bank
// conflicts), W k-major (row wn[r], k = 16 wh[r] + j of the chunk)
template <int QT, int XL, int WH, int BN, int BK>
__device__ __forceinline__ void gemm_store(const float4 xr[XL], const HiQ<QT> wq[WH], float* Xs, float* Ws, int BM,
                                           const int wn[WH], const int wh[WH], const bool wok[WH]) {
#pragma unroll
    for (int i = 0; i < XL; ++i) {
        const int p = threadIdx.x + i * HI_THREADS;
        if (p < BM * (BK / 4)) *(float4*)(Xs + (p / (BK / 4)) * (BK + 4) + 4 * (p % (BK / 4))) = xr[i];
    }
#pragma unroll
    for (int r = 0; r < WH; ++r) {
        float wv[16];
        gemm_deq<QT>(wq[r], wv, wok[r]);
#pragma unroll
        for (int j = 0; j < 16; ++j) Ws[(16 * wh[r] + j) * BN + wn[r]] = wv[j];
    }
}

// the raw bytes of this thread's W pieces of k-chunk c: piece r is weights c*BK + 16 wh[r] .. +15 of its row,
// i.e. half ((c*BK)/16 + wh[r]) & 1 of 32-weight quant chunk (c*BK + 16 wh[r]) / 32
template <int QT, int WH, int BK>
__device__ __forceinline__ void gemm_load_w(HiQ<QT> wq[WH], const u8* const wptr[WH], const int wh[WH], int c) {
#pragma unroll
    for (int r = 0; r < WH; ++r) {
        const int h16 = c * (BK / 16) + wh[r];
        wq[r].load(wptr[r], h16 >> 1, h16 & 1);
    }
}

template <int QT, int TM, int TXN, int BK>
__device__ __forceinline__ void gemm_body(const float* __restrict__ X, const u8* __restrict__ W,
                                          float* __restrict__ Y, const int* __restrict__ offs,
                                          const int* __restrict__ idx, int E, int M, int N, int K, int row_nbytes,
                                          int ksplit) {
    const int TYN = HI_THREADS / TXN;                       // thread rows along tokens: 16 or 8
    const int BM = TYN * TM, BN = 8 * TXN;                  // the block's tile: BM tokens x BN weight rows
    const int XL = (BM * BK / 4 + HI_THREADS - 1) / HI_THREADS;  // float4 X loads per thread per k chunk
    const int WH = BN * BK / 16 / HI_THREADS;                      // W pieces (16 weights) staged per thread
    __shared__ __align__(16) float Xs[BM * (BK + 4)];
    __shared__ __align__(16) float Ws[BK * BN];
    __shared__ int scan[HI_THREADS];

    const int tid = threadIdx.x;
    // a warp is 8 row groups x 4 token groups, so each float4 shared load of a k step reads 128 distinct
    // bytes (one wavefront: W rows 4tx.. of 8 consecutive tx, X rows of 4 consecutive ty at pitch 36)
    const int lane = tid & 31, warp = tid >> 5;
    const int tx = (lane & 7) | ((warp % (TXN / 8)) << 3), ty = (lane >> 3) | ((warp / (TXN / 8)) << 2);
    int wn[WH], wh[WH];  // W staging: row and half-chunk of each of this thread's pieces
#pragma unroll
    for (int r = 0; r < WH; ++r) {
        wn[r] = (tid + r * HI_THREADS) % BN;
        wh[r] = (tid + r * HI_THREADS) / BN;
    }
    const int n_tiles = (N + BN - 1) / BN;
    const int c0 = gemm_kchunk(K / BK, ksplit, blockIdx.z), n_chunks = gemm_kchunk(K / BK, ksplit, blockIdx.z + 1);
    Y += (size_t)blockIdx.z * M * N;

    for (int v = blockIdx.y;; v += gridDim.y) {
        int e, r0, cnt;
        if (!gemm_find_tile(offs, E, M, BM, v, &e, &r0, &cnt, scan, threadIdx.x)) return;
        // input rows this thread stages (clamped to a valid row; padding rows are zeroed at staging)
        const float* xrow[XL];
#pragma unroll
        for (int i = 0; i < XL; ++i) {
            const int m = (tid + i * HI_THREADS) / (BK / 4);
            const int r = r0 + min(m, cnt - 1);
            xrow[i] = X + (size_t)(idx ? idx[r] : r) * K;
        }
        const u8* Wexp = W + (size_t)e * N * row_nbytes;

        for (int nt = blockIdx.x; nt < n_tiles; nt += gridDim.x) {
            const int n0 = nt * BN;
            bool wok[WH];
            const u8* wptr[WH];
#pragma unroll
            for (int r = 0; r < WH; ++r) {
                wok[r] = n0 + wn[r] < N;
                wptr[r] = Wexp + (size_t)min(n0 + wn[r], N - 1) * row_nbytes;
            }
            float acc[TM][8];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

            // software pipeline: the global loads of chunk c+1 (X rows, raw W bytes) are in flight while
            // chunk c is multiplied out of shared memory
            float4 xr[XL];
            HiQ<QT> wq[WH];
            if (c0 < n_chunks) {  // an empty part writes zeros
                gemm_load_x<XL, BK>(xr, xrow, c0, cnt, BM);
                gemm_load_w<QT, WH, BK>(wq, wptr, wh, c0);
                gemm_store<QT, XL, WH, BN, BK>(xr, wq, Xs, Ws, BM, wn, wh, wok);
            }
            __syncthreads();
            for (int c = c0; c < n_chunks; ++c) {
                const bool more = c + 1 < n_chunks;
                if (more) {
                    gemm_load_x<XL, BK>(xr, xrow, c + 1, cnt, BM);
                    gemm_load_w<QT, WH, BK>(wq, wptr, wh, c + 1);
                }
#pragma unroll
                for (int kk = 0; kk < BK; kk += 4) {
                    float4 xa[TM];
#pragma unroll
                    for (int i = 0; i < TM; ++i) xa[i] = *(const float4*)(Xs + (ty + TYN * i) * (BK + 4) + kk);
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const float4 b0 = *(const float4*)(Ws + (kk + q) * BN + 4 * tx);
                        const float4 b1 = *(const float4*)(Ws + (kk + q) * BN + 4 * TXN + 4 * tx);
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
                if (more) gemm_store<QT, XL, WH, BN, BK>(xr, wq, Xs, Ws, BM, wn, wh, wok);
                __syncthreads();
            }

            // write Y rows r0 + m, columns n0 + 4tx + j and n0 + 4 TXN + 4tx + j
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                const int m = ty + TYN * i;
                if (m >= cnt) continue;
                float* yrow = Y + (size_t)(r0 + m) * N;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int n = n0 + 4 * TXN * half + 4 * tx;
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

#ifdef HI_REG63
#include "gemm_lean.cuh"
#endif

// One entry point per (weight type, tile): name gemm_<type>_b<BM>_n<BN>.
//   X [*, K] f32; W [E, N, K] GGUF rows; Y [M, N] f32; offs [E+1] int32, non-decreasing, offs[E] <= M,
//   or NULL for one group of M rows (E = 1, the plain GEMM); idx [M] int32 row indices into X, or NULL
//   for X rows in grouped order; ksplit: the split over K above (1: none). BODY is gemm_body<QT, TM, TXN, BK>
//   or gemm_body_lean<QT, TM, TXN, BK, CN>.
#define GEMM_KERNEL(NAME, BODY)                                                                                \
    extern "C" __global__ void HI_BOUNDS(HI_THREADS)                                                          \
        NAME(const float* __restrict__ X, const u8* __restrict__ W, float* __restrict__ Y,                    \
             const int* __restrict__ offs, const int* __restrict__ idx, int E, int M, int N, int K,          \
             int row_nbytes, int ksplit) {                                                                     \
        BODY(X, W, Y, offs, idx, E, M, N, K, row_nbytes, ksplit);                                             \
    }
#define GEMM_FULL(QT, TM, TXN) gemm_body<QT, TM, TXN, 32>
#define GEMM_LEAN(QT, TM, TXN, CN) gemm_body_lean<QT, TM, TXN, 32, CN>
#define GEMM_LEAN_WIDE(QT, TM, TXN, CN) gemm_body_lean_wide<QT, TM, TXN, 32, CN>

#ifndef HI_REG63
// 128-row tiles (16 x 16 threads) for long token runs; 256-row tiles (8 x 32 threads) keep 4 tokens per
// thread at 32-token tiles, for MoE groups of a few dozen tokens. (A 32 x 512 tile with 8 x 8 outputs
// per thread and k chunks of 16 measured no faster than 32 x 256: at 32 tokens per dequantized weight
// the dequantization and staging, not shared-memory reads, bound it.)
#define GEMM_TYPE(name, QT)                                          \
    GEMM_KERNEL(gemm_##name##_b16_n128, GEMM_FULL(QT, 1, 16))        \
    GEMM_KERNEL(gemm_##name##_b32_n128, GEMM_FULL(QT, 2, 16))        \
    GEMM_KERNEL(gemm_##name##_b64_n128, GEMM_FULL(QT, 4, 16))        \
    GEMM_KERNEL(gemm_##name##_b128_n128, GEMM_FULL(QT, 8, 16))       \
    GEMM_KERNEL(gemm_##name##_b16_n256, GEMM_FULL(QT, 2, 32))        \
    GEMM_KERNEL(gemm_##name##_b32_n256, GEMM_FULL(QT, 4, 32))        \
    GEMM_KERNEL(gemm_##name##_b64_n256, GEMM_FULL(QT, 8, 32))
#else
// 63 registers a thread: the lean body (gemm_lean.cuh), at most 4 x 8 outputs a thread; the 64 x 128 tile's
// 4 x 8 by gemm_body_lean_wide, which holds less across its k-chunk loop (spill-free where the other spilled), and
// the 64 x 64 tile's 4 x 4 too (its four-k-step multiply needs 16 registers for X that gemm_body_lean lacks)
#define GEMM_TYPE(name, QT)                                          \
    GEMM_KERNEL(gemm_##name##_b16_n128, GEMM_LEAN(QT, 1, 16, 8))     \
    GEMM_KERNEL(gemm_##name##_b32_n128, GEMM_LEAN(QT, 2, 16, 8))     \
    GEMM_KERNEL(gemm_##name##_b64_n128, GEMM_LEAN_WIDE(QT, 4, 16, 8)) \
    GEMM_KERNEL(gemm_##name##_b16_n256, GEMM_LEAN(QT, 2, 32, 8))     \
    GEMM_KERNEL(gemm_##name##_b32_n256, GEMM_LEAN(QT, 4, 32, 8))     \
    GEMM_KERNEL(gemm_##name##_b32_n64, GEMM_LEAN(QT, 2, 16, 4))      \
    GEMM_KERNEL(gemm_##name##_b64_n64, GEMM_LEAN_WIDE(QT, 4, 16, 4))
#endif

GEMM_TYPE(f32, HI_F32)
GEMM_TYPE(f16, HI_F16)
GEMM_TYPE(q4_0, HI_Q4_0)
GEMM_TYPE(q8_0, HI_Q8_0)
GEMM_TYPE(q4_k, HI_Q4_K)
GEMM_TYPE(q5_k, HI_Q5_K)
GEMM_TYPE(q6_k, HI_Q6_K)

// Y[i] = part[0][i] + ... + part[nparts - 1][i], in that order (the split over K's last step); n = M N
extern "C" __global__ void HI_BOUNDS(HI_THREADS)
    ksplit_sum(float* __restrict__ Y, const float* __restrict__ part, int nparts, int n) {
    for (int i = blockIdx.x * HI_THREADS + threadIdx.x; i < n; i += gridDim.x * HI_THREADS) {
        float y = part[i];
        for (int z = 1; z < nparts; ++z) y += part[(size_t)z * n + i];
        Y[i] = y;
    }
}

// The GEMM of gemm.cu for the 63-register class (sm_2x, sm_30; -DHI_REG63): the same maths, tiles and grid, with
// a body that keeps little in registers besides the accumulators.
//
// Why a second body: held to 63 registers, gemm.cu's pipelined body spills kilobytes a thread on its large tiles,
// and even its 16 x 128 tile spills, because registers hold the next chunk's loads, row pointers of the staged X
// rows, and values the compiler hoists out of the tile loops (row pointers, the epilogue's addresses). Here:
// - chunk c is staged straight from global memory into shared memory after the barrier that ends chunk c - 1,
//   so nothing is held across the multiply (latency is hidden by the other resident blocks instead);
// - the tile's description (first row, row count, first weight row, expert) and the X row of each tile row are
//   kept in shared memory and read back after barriers, so they cannot be hoisted into registers;
// - a k step reads one X value a token (scalar shared loads) instead of a float4 of four k steps, except in the
//   64-row-wide tiles (gemm_lean_mul), whose 16 accumulators leave room for them;
// - tiles hold TM x CN outputs a thread, CN = 8 (two float4 of weight rows) or 4 (64-row-wide tiles).
// The 64 x 128 and 64 x 64 tiles (4 x 8 and 4 x 4 outputs a thread) have a body of their own, gemm_body_lean_wide,
// that holds still less. Only the 64-row-wide tiles split over K (gemm.cu): the split's chunk range and slab row
// made the wider bodies spill.
#ifndef HYBRIDINFER_GEMM_LEAN_CUH
#define HYBRIDINFER_GEMM_LEAN_CUH

#ifndef GEMM_LEAN_UNROLL
#define GEMM_LEAN_UNROLL 2
#endif

// stage k-chunk c: X rows (row index rows[m], zero past the tile's row count) and the W pieces, each loaded,
// dequantized and stored in turn; F32 pieces in F32P parts loaded one after the other when F32P > 1 (F32 holds a
// piece's 16 weights in 16 registers, more than the 64 x 128 tile has to spare)
template <int QT, int XL, int WH, int WP, int BM, int BN, int BK, int F32P = 1>
__device__ __forceinline__ void gemm_stage_lean(const float* __restrict__ X, const u8* __restrict__ W,
                                                const int* rows, const int* meta, int N, int K, int row_nbytes,
                                                int c, float* Xs, float* Ws, int tid) {
    const int cnt = meta[1];
#pragma unroll 1
    for (int i = 0; i < XL; ++i) {  // not unrolled: one X load in flight, not XL float4 in registers
        const int p = tid + i * HI_THREADS;
        if (p < BM * (BK / 4)) {
            const int m = p / (BK / 4), q4 = p % (BK / 4);
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (m < cnt) v = *(const float4*)(X + (size_t)rows[m] * K + c * BK + 4 * q4);
            *(float4*)(Xs + m * (BK + 4) + 4 * q4) = v;
        }
    }
    const int n0 = meta[2], e = meta[3];
#pragma unroll 1
    for (int r = 0; r < WH; ++r) {  // likewise one W piece at a time
        const int p = tid + r * HI_THREADS;
        if (WP % HI_THREADS && p >= WP) break;  // 64-wide tiles: half the threads stage W
        const int wn = p % BN, wh = p / BN;
        const u8* wrow = W + ((size_t)e * N + min(n0 + wn, N - 1)) * row_nbytes;
        const int h16 = c * (BK / 16) + wh;
        if (QT == HI_F32 && F32P > 1) {
            const float4* src = (const float4*)(wrow + (size_t)(h16 >> 1) * 128 + 64 * (h16 & 1));
            const bool ok = n0 + wn < N;
#pragma unroll 1
            for (int part = 0; part < F32P; ++part) {
#pragma unroll
                for (int i = 0; i < 4 / F32P; ++i) {
                    const float4 a = src[part * (4 / F32P) + i];
                    const int j = 4 * (part * (4 / F32P) + i);
                    Ws[(16 * wh + j) * BN + wn] = ok ? a.x : 0.0f;
                    Ws[(16 * wh + j + 1) * BN + wn] = ok ? a.y : 0.0f;
                    Ws[(16 * wh + j + 2) * BN + wn] = ok ? a.z : 0.0f;
                    Ws[(16 * wh + j + 3) * BN + wn] = ok ? a.w : 0.0f;
                }
            }
            continue;
        }
        HiQ<QT> q;
        q.load(wrow, h16 >> 1, h16 & 1);
        float wv[16];
        gemm_deq<QT>(q, wv, n0 + wn < N);
#pragma unroll
        for (int j = 0; j < 16; ++j) Ws[(16 * wh + j) * BN + wn] = wv[j];
    }
}

// The k-chunk multiply and the output write, shared by gemm_body_lean and gemm_body_lean_wide.
// acc += the staged chunk's X rows ty + TYN i times its W rows 4 tx + j, 4 TXN + 4 tx + j: an FMA chain over k in order
// The 64-row-wide tiles (CN = 4) take four k steps at a time (a float4 of X a token and of W a k step, as gemm_body
// does: 2 shared loads per 16 FMAs where the scalar X reads take 5; the 64 x 64 tile was bound by them): their 16
// accumulators leave room for the 16 X values, the wider tiles' 32 do not.
template <int TM, int TXN, int BK, int CN>
__device__ __forceinline__ void gemm_lean_mul(float acc[TM][CN], const float* Xs, const float* Ws, int tid) {
    const int TYN = HI_THREADS / TXN, BN = CN * TXN;
    // warp layout as gemm.cu's: 8 weight-row groups x 4 token groups
    const int lane = tid & 31, warp = tid >> 5;
    const int tx = (lane & 7) | ((warp % (TXN / 8)) << 3), ty = (lane >> 3) | ((warp / (TXN / 8)) << 2);
    if (CN == 4) {
#pragma unroll 1
        for (int k = 0; k < BK; k += 4) {
            float4 a[TM];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = *(const float4*)(Xs + (ty + TYN * i) * (BK + 4) + k);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const float4 b = *(const float4*)(Ws + (k + kk) * BN + 4 * tx);
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    const float x = kk == 0 ? a[i].x : kk == 1 ? a[i].y : kk == 2 ? a[i].z : a[i].w;
                    acc[i][0] = fmaf(x, b.x, acc[i][0]);
                    acc[i][1] = fmaf(x, b.y, acc[i][1]);
                    acc[i][2] = fmaf(x, b.z, acc[i][2]);
                    acc[i][3] = fmaf(x, b.w, acc[i][3]);
                }
            }
        }
        return;
    }
    const int kUnroll = GEMM_LEAN_UNROLL;
#pragma unroll kUnroll
    for (int k = 0; k < BK; ++k) {
        const float4 b0 = *(const float4*)(Ws + k * BN + 4 * tx);
        const float4 b1 = CN == 8 ? *(const float4*)(Ws + k * BN + 4 * TXN + 4 * tx) : b0;
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const float a = Xs[(ty + TYN * i) * (BK + 4) + k];
            acc[i][0] = fmaf(a, b0.x, acc[i][0]);
            acc[i][1] = fmaf(a, b0.y, acc[i][1]);
            acc[i][2] = fmaf(a, b0.z, acc[i][2]);
            acc[i][3] = fmaf(a, b0.w, acc[i][3]);
            if (CN == 8) {
                acc[i][4 % CN] = fmaf(a, b1.x, acc[i][4 % CN]);
                acc[i][5 % CN] = fmaf(a, b1.y, acc[i][5 % CN]);
                acc[i][6 % CN] = fmaf(a, b1.z, acc[i][6 % CN]);
                acc[i][7 % CN] = fmaf(a, b1.w, acc[i][7 % CN]);
            }
        }
    }
}

// write Y rows r0 + m (m < cnt), columns n0 + 4 TXN h + 4 tx + j (h < CN / 4)
template <int TM, int TXN, int CN>
__device__ __forceinline__ void gemm_lean_write(const float acc[TM][CN], float* __restrict__ Y, int r0, int cnt, int n0,
                                                int N, int tid) {
    const int TYN = HI_THREADS / TXN;
    const int lane = tid & 31, warp = tid >> 5;
    const int tx = (lane & 7) | ((warp % (TXN / 8)) << 3), ty = (lane >> 3) | ((warp / (TXN / 8)) << 2);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = ty + TYN * i;
        if (m >= cnt) continue;
        float* yrow = Y + (size_t)(r0 + m) * N;
#pragma unroll
        for (int h = 0; h < CN / 4; ++h) {
            const int n = n0 + 4 * TXN * h + 4 * tx;
            if ((N & 3) == 0 && n + 3 < N) {
                *(float4*)(yrow + n) = make_float4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2],
                                                   acc[i][4 * h + 3]);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (n + j < N) yrow[n + j] = acc[i][4 * h + j];
            }
        }
    }
}

// blockIdx.z read afresh (as gemm_tid below): LLVM hoists what a plain read computes out of the tile loops
__device__ __forceinline__ int gemm_part() {
    int z;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    return z;
}

// a token tile's X rows (past its count, the last valid one again), and in meta its first Y row, row count, expert
// and this part's k chunks [meta[6], meta[7]) (kept in shared memory, not registers, across the tile loops)
template <int BM, bool SPLIT>
__device__ __forceinline__ void gemm_lean_tile(int* rows, int* meta, const int* __restrict__ idx, int r0, int cnt,
                                               int e, int M, int n_chunks, int ksplit, int tid) {
    for (int m = tid; m < BM; m += HI_THREADS) {
        const int r = r0 + min(m, cnt - 1);
        rows[m] = idx ? idx[r] : r;
    }
    if (tid == 0) {
        meta[0] = SPLIT ? r0 + gemm_part() * M : r0;  // the first Y row: part z writes slab z (gemm.cu)
        meta[1] = cnt;
        meta[3] = e;
        if (SPLIT) {
            meta[6] = gemm_kchunk(n_chunks, ksplit, gemm_part());
            meta[7] = gemm_kchunk(n_chunks, ksplit, gemm_part() + 1);
        }
    }
}

template <int QT, int TM, int TXN, int BK, int CN>
__device__ __forceinline__ void gemm_body_lean(const float* __restrict__ X, const u8* __restrict__ W,
                                               float* __restrict__ Y, const int* __restrict__ offs,
                                               const int* __restrict__ idx, int E, int M, int N, int K,
                                               int row_nbytes, int ksplit) {
    const int TYN = HI_THREADS / TXN;                             // thread rows along tokens
    const int BM = TYN * TM, BN = CN * TXN;                       // the block's tile: BM tokens x BN weight rows
    const int XL = (BM * BK / 4 + HI_THREADS - 1) / HI_THREADS;   // float4 X loads per thread per k chunk
    const int WP = BN * BK / 16;                                  // W pieces (16 weights) per k chunk
    const int WH = (WP + HI_THREADS - 1) / HI_THREADS;            // W pieces staged per thread
    __shared__ __align__(16) float Xs[BM * (BK + 4)];
    __shared__ __align__(16) float Ws[BK * BN];
    __shared__ int scan[HI_THREADS];
    __shared__ int rows[BM];  // X row of each tile row (the last valid row past the count)
    __shared__ int meta[8];   // first row, row count, first weight row, expert of the current tile; [6, 7): k chunks
    const int tid = threadIdx.x;
    const int n_tiles = (N + BN - 1) / BN;

    for (int v = blockIdx.y;; v += gridDim.y) {
        int e, r0, cnt;
        if (!gemm_find_tile(offs, E, M, BM, v, &e, &r0, &cnt, scan, tid)) return;
        gemm_lean_tile<BM, CN == 4>(rows, meta, idx, r0, cnt, e, M, K / BK, ksplit, tid);
        if (CN == 4) __syncthreads();  // the k chunk loop's bounds are read from meta before its first barrier
        for (int nt = blockIdx.x; nt < n_tiles; nt += gridDim.x) {
            if (tid == 0) meta[2] = nt * BN;
            float acc[TM][CN];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < CN; ++j) acc[i][j] = 0.0f;
            for (int c = CN == 4 ? meta[6] : 0; c < (CN == 4 ? meta[7] : K / BK); ++c) {
                __syncthreads();  // every thread is done reading chunk c - 1 (and meta is written)
                gemm_stage_lean<QT, XL, WH, WP, BM, BN, BK>(X, W, rows, meta, N, K, row_nbytes, c, Xs, Ws, tid);
                __syncthreads();
                gemm_lean_mul<TM, TXN, BK, CN>(acc, Xs, Ws, tid);
            }
            gemm_lean_write<TM, TXN, CN>(acc, Y, meta[0], meta[1], meta[2], N, tid);
            __syncthreads();  // meta[2] is rewritten for the next weight tile
        }
        __syncthreads();  // rows and meta are rewritten for the next token tile
    }
}

// threadIdx.x read afresh: a volatile asm is neither hoisted nor merged with other reads, so what is computed from
// it is not held in registers across the loops
__device__ __forceinline__ int gemm_tid() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}

// The lean body for 4 x 8 outputs a thread (the 64 x 128 tile). Its 32 accumulators, the two float4 of weights and
// the k loop's addresses leave about 15 registers of 63, fewer than gemm_body_lean holds across its k-chunk loop
// (the tile loops' counters and bounds, the staging's thread-derived offsets and row address, the tile search's
// addresses, all hoisted there by LLVM). So here, with the same staging, sums and writes:
// - everything derived from the thread index is computed from a fresh read of it (gemm_tid) where it is used, and
//   N, K, row_nbytes, E and M pass through hi_opaque at each use (kernel parameters, which ptxas reads from the
//   constant bank again instead of holding);
// - the tile loops' counters (token tile v, weight tile nt) live in shared memory, read back after barriers;
// - F32 weights are staged 8 at a time (two float4 in flight instead of four).
template <int QT, int TM, int TXN, int BK, int CN>
__device__ __forceinline__ void gemm_body_lean_wide(const float* __restrict__ X, const u8* __restrict__ W,
                                                    float* __restrict__ Y, const int* __restrict__ offs,
                                                    const int* __restrict__ idx, int E, int M, int N, int K,
                                                    int row_nbytes, int ksplit) {
    const int TYN = HI_THREADS / TXN;
    const int BM = TYN * TM, BN = CN * TXN;
    const int XL = (BM * BK / 4 + HI_THREADS - 1) / HI_THREADS;
    const int WP = BN * BK / 16;
    const int WH = (WP + HI_THREADS - 1) / HI_THREADS;
    __shared__ __align__(16) float Xs[BM * (BK + 4)];
    __shared__ __align__(16) float Ws[BK * BN];
    __shared__ int scan[HI_THREADS];
    __shared__ int rows[BM];
    __shared__ int meta[8];  // first row, row count, first weight row, expert, token tile v, weight tile nt, k chunks

    for (int v = blockIdx.y;;) {
        int e, r0, cnt;
        if (!gemm_find_tile(offs, hi_opaque(E), hi_opaque(M), BM, v, &e, &r0, &cnt, scan, gemm_tid())) return;
        const int tid = gemm_tid();
        gemm_lean_tile<BM, CN == 4>(rows, meta, idx, r0, cnt, e, hi_opaque(M), hi_opaque(K) / BK, hi_opaque(ksplit),
                           tid);
        if (tid == 0) {
            meta[4] = v;
            meta[5] = blockIdx.x;
        }
        __syncthreads();
        for (;;) {
            const int nt = meta[5];
            if (nt >= (hi_opaque(N) + BN - 1) / BN) break;
            if (gemm_tid() == 0) meta[2] = nt * BN;
            float acc[TM][CN];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < CN; ++j) acc[i][j] = 0.0f;
            for (int c = CN == 4 ? meta[6] : 0; c < (CN == 4 ? meta[7] : hi_opaque(K) / BK); ++c) {
                __syncthreads();  // every thread is done reading chunk c - 1 (and meta is written)
                gemm_stage_lean<QT, XL, WH, WP, BM, BN, BK, 2>(X, W, rows, meta, hi_opaque(N), hi_opaque(K),
                                                               hi_opaque(row_nbytes), c, Xs, Ws, gemm_tid());
                __syncthreads();
                gemm_lean_mul<TM, TXN, BK, CN>(acc, Xs, Ws, gemm_tid());
            }
            gemm_lean_write<TM, TXN, CN>(acc, Y, meta[0], meta[1], meta[2], hi_opaque(N), gemm_tid());
            __syncthreads();  // every thread has read meta[5] and meta[2]
            if (gemm_tid() == 0) meta[5] = nt + gridDim.x;
            __syncthreads();
        }
        v = meta[4] + gridDim.y;
        __syncthreads();  // rows and meta are rewritten for the next token tile
    }
}

#endif

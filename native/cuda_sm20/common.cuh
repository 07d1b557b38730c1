// Shared device helpers of gemm.cu and elementwise.cu (sm_20 subset: fp32 and int32 arithmetic, shared
// memory, __syncthreads; no warp shuffles, __ldg, dp4a or half arithmetic).
//
// The GGUF block formats (ggml type ids, bytes per block, field offsets) are those of hybridinfer/quant.py
// and quant_k.py; `HiQ<QT>` / `hi_deq16<QT>` dequantize 16 consecutive weights of a row with the float32
// operation order of those numpy dequantizers (products kept unfused with __fmul_rn), so their values
// are bit-equal to quant.dequantize.
#ifndef HYBRIDINFER_COMMON_CUH
#define HYBRIDINFER_COMMON_CUH

// ggml type ids (ggml.h enum ggml_type)
#define HI_F32 0
#define HI_F16 1
#define HI_Q4_0 2
#define HI_Q4_1 3
#define HI_Q8_0 8
#define HI_Q4_K 12
#define HI_Q5_K 13
#define HI_Q6_K 14

// block sizes in bytes (elements per block: 32 for Q4_0/Q4_1/Q8_0, 256 for the K-quants)
#define HI_Q4_0_BYTES 18   // d f16 @0, qs[16] @2
#define HI_Q4_1_BYTES 20   // d f16 @0, m f16 @2, qs[16] @4
#define HI_Q8_0_BYTES 34   // d f16 @0, q int8[32] @2
#define HI_Q4_K_BYTES 144  // d f16 @0, dmin f16 @2, scales[12] @4, qs[128] @16
#define HI_Q5_K_BYTES 176  // d f16 @0, dmin f16 @2, scales[12] @4, qh[32] @16, qs[128] @48
#define HI_Q6_K_BYTES 210  // ql[128] @0, qh[64] @128, sc int8[16] @192, d f16 @208

#define HI_THREADS 256  // threads per block of every kernel here

// Launch bounds by card class (hybridinfer/backends/gpu/kclass.py passes the defines). The 63-register class (sm_2x,
// sm_30) is compiled with -maxrregcount 63 and no bounds, because ptxas lets launch bounds override that cap;
// the others take HI_MIN_BLOCKS resident blocks a multiprocessor as the bounds' second argument.
#ifndef HI_MIN_BLOCKS
#define HI_MIN_BLOCKS 1
#endif
#ifdef HI_REG63
#define HI_BOUNDS(threads)
#else
#define HI_BOUNDS(threads) __launch_bounds__(threads, HI_MIN_BLOCKS)
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// fp16 bits -> fp32: a conversion (cvt), not half arithmetic, and available on every PTX target
__device__ __forceinline__ float hi_h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// x, opaque to the compiler: a volatile asm is not moved out of loops, so values computed from it are computed
// where they are used instead of being hoisted and held in registers for the whole loop (what makes kernels spill
// at 63 registers a thread)
__device__ __forceinline__ int hi_opaque(int x) {
    asm volatile("mov.b32 %0, %0;" : "+r"(x));
    return x;
}

__device__ __forceinline__ u16 hi_ld16(const u8* p) { return *(const u16*)p; }  // p 2-byte aligned
__device__ __forceinline__ u32 hi_ld32(const u8* p) { return *(const u32*)p; }  // p 4-byte aligned

// 16 bytes from a 2-byte aligned address as four little-endian words: four aligned 32-bit loads (and
// one 16-bit load for the last two bytes when p is 2 mod 4, so nothing outside [p - 2, p + 16) is read)
// instead of eight 16-bit ones; the words are then shifted into place
__device__ __forceinline__ void hi_ld16b_a2(const u8* p, u32 w[4]) {
    const size_t mis = (size_t)p & 2;
    const u32* a = (const u32*)(p - mis);
    const u32 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    if (mis) {
        const u32 t = hi_ld16(p + 14);
        w[0] = (a0 >> 16) | (a1 << 16);
        w[1] = (a1 >> 16) | (a2 << 16);
        w[2] = (a2 >> 16) | (a3 << 16);
        w[3] = (a3 >> 16) | (t << 16);
    } else {
        w[0] = a0;
        w[1] = a1;
        w[2] = a2;
        w[3] = a3;
    }
}

// 16 bytes from a 16-byte aligned address
__device__ __forceinline__ void hi_ld16b_a16(const u8* p, u32 w[4]) {
    const uint4 v = *(const uint4*)p;
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
}

__device__ __forceinline__ u32 hi_byte(const u32 w[4], int j) { return (w[j >> 2] >> (8 * (j & 3))) & 255u; }

// Six-bit scale and min of sub-block s (0..7) of a Q4_K / Q5_K block (ggml get_scale_min_k4) from the
// 12 scale bytes as three little-endian words: bytes s, s+4, s+8 sit at the same shift of words 0, 1, 2.
__device__ __forceinline__ void hi_scale_min_k4(const u32 scw[3], int s, float* sc, float* mn) {
    const int sh = 8 * (s & 3);
    const u32 b0 = (scw[0] >> sh) & 255u, b1 = (scw[1] >> sh) & 255u, b2 = (scw[2] >> sh) & 255u;
    u32 a, b;
    if (s < 4) {
        a = b0 & 63u;
        b = b1 & 63u;
    } else {
        a = (b2 & 15u) | ((b0 >> 6) << 4);
        b = (b2 >> 4) | ((b1 >> 6) << 4);
    }
    *sc = (float)a;
    *mn = (float)b;
}

// HiQ<QT>: the raw bytes behind weights 32*c + 16*h + (0..15) of a row stored at `row` (c: 32-weight
// chunk, h: half). load() only issues the global loads (so a GEMM can prefetch the next chunk while it
// computes), get() decodes them into v[0..15]. Alignment the callers guarantee (rows at multiples of
// their size from a 256-byte aligned base): F32/F16/Q4_K/Q5_K rows 16-byte aligned, Q4_1 4-byte,
// Q4_0/Q8_0/Q6_K 2-byte.
template <int QT>
struct HiQ;

template <>
struct HiQ<HI_F32> {
    float4 a[4];
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int h) {
        const float4* p = (const float4*)(row + (size_t)c * 128 + 64 * h);
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = p[i];
    }
    __device__ __forceinline__ void get(float v[16]) const {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[4 * i] = a[i].x;
            v[4 * i + 1] = a[i].y;
            v[4 * i + 2] = a[i].z;
            v[4 * i + 3] = a[i].w;
        }
    }
};

template <>
struct HiQ<HI_F16> {
    u32 w[8];
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int h) {
        const u8* p = row + (size_t)c * 64 + 32 * h;
        hi_ld16b_a16(p, w);
        hi_ld16b_a16(p + 16, w + 4);
    }
    __device__ __forceinline__ void get(float v[16]) const {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[2 * i] = hi_h2f((u16)(w[i] & 0xffffu));
            v[2 * i + 1] = hi_h2f((u16)(w[i] >> 16));
        }
    }
};

// Q4_0: y = d * (q - 8); weight j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j-16]
template <>
struct HiQ<HI_Q4_0> {
    u32 d, w[4];
    int sh;
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int h) {
        const u8* blk = row + (size_t)c * HI_Q4_0_BYTES;
        d = hi_ld16(blk);
        hi_ld16b_a2(blk + 2, w);
        sh = 4 * h;
    }
    __device__ __forceinline__ void get(float v[16]) const {
        const float df = hi_h2f((u16)d);
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = __fmul_rn(df, (float)((int)((hi_byte(w, j) >> sh) & 15u) - 8));
    }
};

// Q4_1: y = d * q + m
template <>
struct HiQ<HI_Q4_1> {
    u32 dm, w[4];
    int sh;
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int h) {
        const u8* blk = row + (size_t)c * HI_Q4_1_BYTES;
        dm = hi_ld32(blk);
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = hi_ld32(blk + 4 + 4 * i);
        sh = 4 * h;
    }
    __device__ __forceinline__ void get(float v[16]) const {
        const float d = hi_h2f((u16)(dm & 0xffffu)), m = hi_h2f((u16)(dm >> 16));
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = __fadd_rn(__fmul_rn(d, (float)((hi_byte(w, j) >> sh) & 15u)), m);
    }
};

// Q8_0: y = q * d
template <>
struct HiQ<HI_Q8_0> {
    u32 d, w[4];
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int h) {
        const u8* blk = row + (size_t)c * HI_Q8_0_BYTES;
        d = hi_ld16(blk);
        hi_ld16b_a2(blk + 2 + 16 * h, w);
    }
    __device__ __forceinline__ void get(float v[16]) const {
        const float df = hi_h2f((u16)d);
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = __fmul_rn((float)(signed char)hi_byte(w, j), df);
    }
};

// Q4_K / Q5_K block head: the d, dmin word and the 12 scale bytes of the block holding piece c, and the
// sub-block s = c & 7; scales() gives d * sc[s] and dmin * m[s]
struct HiK4Head {
    u32 dd, scw[3];
    int s;
    __device__ __forceinline__ const u8* load_head(const u8* __restrict__ row, int c, int block_bytes) {
        const u8* blk = row + (size_t)(c >> 3) * block_bytes;
        s = c & 7;
        dd = hi_ld32(blk);
#pragma unroll
        for (int i = 0; i < 3; ++i) scw[i] = hi_ld32(blk + 4 + 4 * i);
        return blk;
    }
    __device__ __forceinline__ void scales(float* ds, float* dm) const {
        float sc, mn;
        hi_scale_min_k4(scw, s, &sc, &mn);
        *ds = __fmul_rn(hi_h2f((u16)(dd & 0xffffu)), sc);
        *dm = __fmul_rn(hi_h2f((u16)(dd >> 16)), mn);
    }
};

// Q4_K: y[32s + l] = (d * sc[s]) * q - (dmin * m[s]); sub-block s = 2g + k is nibble k of qs[32g + l]
template <>
struct HiQ<HI_Q4_K> : HiK4Head {
    u32 w[4];
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int h) {
        const u8* blk = load_head(row, c, HI_Q4_K_BYTES);
        hi_ld16b_a16(blk + 16 + 32 * (s >> 1) + 16 * h, w);
    }
    __device__ __forceinline__ void get(float v[16]) const {
        float ds, dm;
        scales(&ds, &dm);
        const int sh = 4 * (s & 1);
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = __fsub_rn(__fmul_rn(ds, (float)((hi_byte(w, j) >> sh) & 15u)), dm);
    }
};

// Q5_K: as Q4_K with a fifth bit: bit s of qh[l]
template <>
struct HiQ<HI_Q5_K> : HiK4Head {
    u32 w[4], qh[4];
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int h) {
        const u8* blk = load_head(row, c, HI_Q5_K_BYTES);
        hi_ld16b_a16(blk + 48 + 32 * (s >> 1) + 16 * h, w);
        hi_ld16b_a16(blk + 16 + 16 * h, qh);
    }
    __device__ __forceinline__ void get(float v[16]) const {
        float ds, dm;
        scales(&ds, &dm);
        const int sh = 4 * (s & 1);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const u32 q = ((hi_byte(w, j) >> sh) & 15u) | (((hi_byte(qh, j) >> s) & 1u) << 4);
            v[j] = __fsub_rn(__fmul_rn(ds, (float)q), dm);
        }
    }
};

// Q6_K: y[i] = (d * sc[i/16]) * (q[i] - 32). Chunk cc = 4*hh + s of a block (hh: half of 128, s = 0..3):
// weight l of it takes its low nibble (s >> 1) from ql[64hh + 32(s&1) + l], its high bits 2s, 2s+1 from
// qh[32hh + l]; the 16 weights of half h share the sub-scale sc[2cc + h].
template <>
struct HiQ<HI_Q6_K> {
    u32 d, ql[4], qh[4];
    int sc, s;
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int h) {
        const u8* blk = row + (size_t)(c >> 3) * HI_Q6_K_BYTES;
        const int cc = c & 7, hh = cc >> 2;
        s = cc & 3;
        d = hi_ld16(blk + 208);
        sc = (signed char)blk[192 + 2 * cc + h];
        hi_ld16b_a2(blk + 64 * hh + 32 * (s & 1) + 16 * h, ql);
        hi_ld16b_a2(blk + 128 + 32 * hh + 16 * h, qh);
    }
    __device__ __forceinline__ void get(float v[16]) const {
        const float ds = __fmul_rn(hi_h2f((u16)d), (float)sc);
        const int shl = 4 * (s >> 1), shh = 2 * s;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int q = (int)(((hi_byte(ql, j) >> shl) & 15u) | (((hi_byte(qh, j) >> shh) & 3u) << 4));
            v[j] = __fmul_rn(ds, (float)(q - 32));
        }
    }
};

// v[0..15] = weights 32*c + 16*h + (0..15) of the row at `row`, dequantized
template <int QT>
__device__ __forceinline__ void hi_deq16(const u8* __restrict__ row, int c, int h, float v[16]) {
    HiQ<QT> q;
    q.load(row, c, h);
    q.get(v);
}

// Sum of v over a 1-D block of HI_THREADS threads; red holds HI_THREADS floats. Every thread gets the
// result; all threads must call it (it synchronises).
__device__ __forceinline__ float hi_block_sum(float v, float* red) {
    const int tid = threadIdx.x;
    red[tid] = v;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float hi_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float hi_silu(float x) { return x / (1.0f + expf(-x)); }

#endif

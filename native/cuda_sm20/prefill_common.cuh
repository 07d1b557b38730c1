// Small device helpers shared by attention.cu, gdn.cu and moe.cu (sm_20 subset only: fp32, int32,
// shared memory, __syncthreads; no warp shuffles or *_sync intrinsics).
#ifndef HYBRIDINFER_PREFILL_COMMON_CUH
#define HYBRIDINFER_PREFILL_COMMON_CUH

// sigma(x) = 1 / (1 + e^-x), as reference_ops.sigmoid
__device__ __forceinline__ float pf_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// SiLU(x) = x / (1 + e^-x), as reference_ops.silu
__device__ __forceinline__ float pf_silu(float x) { return x / (1.0f + expf(-x)); }

// softplus(x) = log(1 + e^x), linear above 20 (torch and ggml), as reference_ops.softplus
__device__ __forceinline__ float pf_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

#include "common.cuh"

// Sum of v over the block's threads (blockDim.x a power of two, 1-D block): common.cuh's reduction.
__device__ __forceinline__ float pf_block_sum(float v, float* red) { return hi_block_sum(v, red); }

// Maximum of v over the block, same contract as pf_block_sum.
__device__ __forceinline__ float pf_block_max(float v, float* red) {
    const int tid = threadIdx.x;
    red[tid] = v;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (tid < s) red[tid] = fmaxf(red[tid], red[tid + s]);
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

#endif

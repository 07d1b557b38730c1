/* Kernel bodies, compiled once per ISA level by the thin units isa_scalar.c, isa_ssse3.c, isa_avx2.c and
 * isa_avx512vnni.c (each sets its target with `#pragma GCC target` before including this file; the
 * branches below follow the ISA macros that pragma defines).
 *
 * The maths (ggml's, as llama.cpp computes it on an x86 host with AVX2 or better):
 *
 * Activation quantizers, per 32-value block (Q8_0, Q8_1):
 *     amax = max |x_i|,  d = amax / 127,  id = (amax != 0) ? 127 / amax : 0   (float32, two divisions)
 *     q_i = round_half_even(x_i * id)          (the x86 build's _mm256_round_ps; NOT roundf)
 *     stored d = fp16(d) (round to nearest even); Q8_1 also s = fp16(d * sum_i q_i)  (d unrounded)
 * Q8_K, per 256-value block (ggml's quantize_row_q8_K_ref, used by every x86 build):
 *     j = first index with |x_j| = amax;  iscale = -127 / x_j;  q_i = min(127, round_half_even(iscale*x_i))
 *     d = 1 / iscale (float32, may be negative);  bsums[g] = sum of q over elements 16g..16g+15;
 *     amax = 0 gives d = 0, q = 0, bsums = 0.
 * F16 activations: fp16(x_i) (round to nearest even). F32 activations: x itself.
 *
 * Dot product of weight block (d_w, [m_w,] q_w) with activation block (d_a, [s_a,] q_a), 32 elements,
 * in 8 integer lanes of 4 consecutive elements each (element j: j < 16 the low nibble of qs[j], j >= 16
 * the high nibble of qs[j-16]; Q5 types add bit j of qh as bit 4):
 *     lane_k = sum_{j=4k}^{4k+3} w_j * q_a,j       exact int32, w_j = q-8 (Q4_0), q-16 (Q5_0), q (others)
 *     acc_k  = fma(d_w * d_a, (float)lane_k, acc_k)      (d_w * d_a one float product, exact)
 *     summs  = fma(m_w, s_a, summs)                       (Q4_1, Q5_1 only)
 *     row    = hsum8(acc) [+ summs],  hsum8(a) = ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))
 * which are exactly the float operations of ggml_vec_dot_*_q8_* on AVX2, so the AVX2, AVX-512 and scalar
 * (fmaf) paths equal ggml's results bit for bit. The SSSE3 path (hosts without FMA) does the same with a
 * separate multiply and add, so its floats may differ in the last bits; its integers are the same.
 * How the lanes are formed differs by ISA but never changes their value:
 *     SSSE3/AVX2: pmaddubsw(unsigned q, q_a) + pmaddwd(1) - c * (sum of the 4 q_a), c = 8 (Q4_0), 16 (Q5_0),
 *                 with the per-lane activation sums precomputed once per call (`prep`);
 *                 Q8_0 weights: pmaddubsw(|w|, sign(q_a, w)) as ggml (no int16 overflow: |pair| <= 32512);
 *     AVX-512 VNNI: vpdpbusd(-c * sums, unsigned q, q_a), Q8_0 with w + 128 and c = 128;
 *     scalar: plain int loops on signed values.
 * F32 / F16 weights: 4 x 8 float lanes over 32-element steps (lane (k, l) takes elements 32i + 8k + l),
 *     acc = fma(w, x, acc); reduce (a0+a2) + (a1+a3), then lanes l and l+4, then pairs (hadd twice);
 *     the n % 32 tail is added in double, products in float (ggml's ggml_vec_dot_f16 shape).
 * K-quants (Q4_K, Q5_K, Q6_K x Q8_K): hi_dot_q*_K_q8_K from dot_kquants.h (its first comment has the maths).
 *
 * A matrix product is this dot for every (weight row, activation row) pair; tiles of R rows x C tokens
 * share loads (and convert the R rows' fp16 scales together), a token block of HI_TB rows keeps the
 * activations in cache while the rows of a work chunk are swept, so each weight row is read from memory
 * once per block of tokens; the next tile's rows are software-prefetched as one linear stream.
 *
 * Layout: this file has the ISA macros, the fp16 helpers, the read-bandwidth kernel and the table; it
 * includes, in order, kernels_quant.h (activation quantizers, prep), kernels_lanes.h (the 8-lane
 * primitives per ISA) and kernels_tiles.h (tiles and the matmul driver, with
 * kernels_rows.h: GGML_DECODE_ROWS' products of one row with a group of tokens).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "hi_internal.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define HI_VNNI 1
#endif
#if defined(__AVX2__)
#if !defined(__FMA__) || !defined(__F16C__)
#error "the AVX2 unit needs FMA and F16C"
#endif
#define HI_AVX2 1
#elif defined(__SSSE3__)
#define HI_SSSE3 1
#else
#define HI_SCALAR 1
#endif

#if defined(HI_AVX2) || defined(HI_SSSE3)
#include <immintrin.h>
#endif

#include "dot_kquants.h"

#define HI_INLINE static inline __attribute__((always_inline))
#define HI_UNROLL _Pragma("GCC unroll 8")

/* tile shapes: RV rows for one token (GEMV); RG rows x CG tokens for several tokens; HI_TB tokens a block */
#if defined(HI_VNNI)
#define HI_RV 4
#define HI_RG 4
#define HI_CG 4
#elif defined(HI_AVX2)
#define HI_RV 4
#define HI_RG 2
#define HI_CG 2
#elif defined(HI_SSSE3)
#define HI_RV 4
#define HI_RG 2
#define HI_CG 2
#else
#define HI_RV 1
#define HI_RG 1
#define HI_CG 1
#endif
#define HI_TB 32
#define HI_MAXR 4
#define HI_MAXC 4

/* ================================================================================================ */
/* fp16 */

#if defined(HI_AVX2)
HI_INLINE float hi_h2f(uint16_t h) { return _cvtsh_ss(h); }
HI_INLINE uint16_t hi_f2h(float f) { return (uint16_t)_cvtss_sh(f, 0); }
#else
HI_INLINE float hi_h2f(uint16_t h) { return hi_h2f_soft(h); }
HI_INLINE uint16_t hi_f2h(float f) { return hi_f2h_soft(f); }
#endif

HI_INLINE uint16_t hi_rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
HI_INLINE uint32_t hi_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* the kernels, in this order (each part uses the ones before it) */
#include "kernels_quant.h"
#include "kernels_lanes.h"
#include "kernels_tiles.h"
#include "kernels_attn.h"
#include "kernels_fa.h"
#include "kernels_fa_vnni.h"
#include "kernels_fa_tiled.h"
#include "kernels_gemm.h"
#include "kernels_vattn.h"

/* ================================================================================================ */
/* memory read bandwidth: sum of 64-bit words, several independent accumulators */

static uint64_t hi_read_sum(const void *p, size_t n) {
#if defined(HI_VNNI)
    const __m512i *v = (const __m512i *)p;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n / 64; i += 4) {
        a0 = _mm512_add_epi64(a0, _mm512_load_si512(v + i));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512(v + i + 1));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512(v + i + 2));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512(v + i + 3));
    }
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
#elif defined(HI_AVX2)
    const __m256i *v = (const __m256i *)p;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n / 32; i += 8) {
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(_mm256_load_si256(v + i), _mm256_load_si256(v + i + 1)));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(_mm256_load_si256(v + i + 2), _mm256_load_si256(v + i + 3)));
        a2 = _mm256_add_epi64(a2, _mm256_add_epi64(_mm256_load_si256(v + i + 4), _mm256_load_si256(v + i + 5)));
        a3 = _mm256_add_epi64(a3, _mm256_add_epi64(_mm256_load_si256(v + i + 6), _mm256_load_si256(v + i + 7)));
    }
    const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t o[4];
    _mm256_storeu_si256((__m256i *)o, s);
    return o[0] + o[1] + o[2] + o[3];
#elif defined(HI_SSSE3)
    const __m128i *v = (const __m128i *)p;
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n / 16; i += 8) {
        a0 = _mm_add_epi64(a0, _mm_add_epi64(_mm_load_si128(v + i), _mm_load_si128(v + i + 1)));
        a1 = _mm_add_epi64(a1, _mm_add_epi64(_mm_load_si128(v + i + 2), _mm_load_si128(v + i + 3)));
        a2 = _mm_add_epi64(a2, _mm_add_epi64(_mm_load_si128(v + i + 4), _mm_load_si128(v + i + 5)));
        a3 = _mm_add_epi64(a3, _mm_add_epi64(_mm_load_si128(v + i + 6), _mm_load_si128(v + i + 7)));
    }
    const __m128i s = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
    uint64_t o[2];
    _mm_storeu_si128((__m128i *)o, s);
    return o[0] + o[1];
#else
    const uint64_t *v = (const uint64_t *)p;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (size_t i = 0; i < n / 8; i += 4) {
        a0 += v[i];
        a1 += v[i + 1];
        a2 += v[i + 2];
        a3 += v[i + 3];
    }
    return a0 + a1 + a2 + a3;
#endif
}

/* ================================================================================================ */

const hi_kernels HI_TABLE = {
    .isa = HI_ISA_ID,
    .name = HI_ISA_NAME,
    .quantize = hi_quantize,
    .prep = hi_prep,
#if defined(HI_SSSE3)
    .kprep = hi_kprep,
    .krepack = hi_kq_zip_blocks,
#endif
    .needs_corr = {
        [HI_T_Q4_0] = HI_CORR(HI_T_Q4_0) != 0, [HI_T_Q5_0] = HI_CORR(HI_T_Q5_0) != 0,
        [HI_T_Q8_0] = HI_CORR(HI_T_Q8_0) != 0,
    },
    .mm = hi_mm_run,
    .read_sum = hi_read_sum,
    .attn = hi_attn_run,
    .attn_scratch = hi_attn_scratch_row,
    .attn_fa = hi_attn_fa_run,
    .attn_fa_scratch = hi_attn_fa_scratch,
    .attn_fa_tiled = hi_attn_fa_tiled,
    .swiglu = hi_swiglu_row,
    .gemm_mr = HI_GEMM_MR,
    .gemm_nr = HI_GEMM_NR,
#if HI_GEMM_NR
    .gemm_block = hi_gemm_block,
    .vattn = hi_vattn_task,
#endif
};

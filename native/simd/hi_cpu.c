/* CPU detection (which ISA level this host runs), the per-ISA kernel tables, and the sizes of the weight
 * and activation rows of each type. Compiled for the baseline target: it holds no SIMD code.
 */
#include "hi_simd.h"

#include <cpuid.h>
#include <stddef.h>

#include "hi_internal.h"

/* ================================================================================================ */
/* CPU detection (cpuid + xgetbv: the CPU has the instructions and the OS saves their registers) */

static uint64_t hi_xgetbv0(void) {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static int hi_detect(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return HI_ISA_SCALAR;
    const int ssse3 = (c >> 9) & 1, fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1,
              f16c = (c >> 29) & 1;
    int level = ssse3 ? HI_ISA_SSSE3 : HI_ISA_SCALAR;
    if (!osxsave || !avx) return level;
    const uint64_t xcr0 = hi_xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return level; /* xmm, ymm state */
    if (__get_cpuid_max(0, NULL) < 7) return level;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1,
              vnni = (c >> 11) & 1;
    if (!(avx2 && fma && f16c)) return level;
    level = HI_ISA_AVX2;
    if (avx512f && avx512bw && avx512vl && vnni && (xcr0 & 0xe6) == 0xe6) level = HI_ISA_AVX512VNNI;
    return level;
}

static int hi_level = -1;

int hi_best_isa(void) {
    if (hi_level < 0) hi_level = hi_detect();
    return hi_level;
}

int hi_isa_supported(int isa) { return isa >= 0 && isa < HI_N_ISA && isa <= hi_best_isa(); }

static const hi_kernels *const hi_tables[HI_N_ISA] = {&hi_kernels_scalar, &hi_kernels_ssse3, &hi_kernels_avx2,
                                                      &hi_kernels_avx512vnni};

const hi_kernels *hi_isa_table(int isa) { return hi_tables[isa]; }

const char *hi_isa_name(int isa) { return isa >= 0 && isa < HI_N_ISA ? hi_tables[isa]->name : "?"; }

/* ================================================================================================ */
/* types */

int hi_act_kind(int qtype) {
    switch (hi_base_type(qtype)) {
    case HI_T_F32: return HI_ACT_F32;
    case HI_T_F16: return HI_ACT_F16;
    case HI_T_Q4_0: case HI_T_Q5_0: case HI_T_Q8_0: return HI_ACT_Q8_0;
    case HI_T_Q4_1: case HI_T_Q5_1: return HI_ACT_Q8_1;
    case HI_T_Q4_K: case HI_T_Q5_K: case HI_T_Q6_K: return HI_ACT_Q8_K;
    default: return HI_ACT_NONE;
    }
}

int64_t hi_act_row_bytes(int qtype, int64_t n) {
    if (n <= 0) return -1;
    switch (hi_act_kind(qtype)) {
    case HI_ACT_F32: return 4 * n;
    case HI_ACT_F16: return 2 * n;
    case HI_ACT_Q8_0: return n % 32 ? -1 : n / 32 * (int64_t)sizeof(block_q8_0);
    case HI_ACT_Q8_1: return n % 32 ? -1 : n / 32 * (int64_t)sizeof(block_q8_1);
    case HI_ACT_Q8_K: return n % 256 ? -1 : n / 256 * (int64_t)sizeof(block_q8_K);
    default: return -1;
    }
}

int64_t hi_weight_row_bytes(int qtype, int64_t n) {
    if (n <= 0) return -1;
    int qk, bs;
    switch (hi_base_type(qtype)) {
    case HI_T_F32: return 4 * n;
    case HI_T_F16: return 2 * n;
    case HI_T_Q4_0: qk = 32; bs = sizeof(block_q4_0); break;
    case HI_T_Q4_1: qk = 32; bs = sizeof(block_q4_1); break;
    case HI_T_Q5_0: qk = 32; bs = sizeof(block_q5_0); break;
    case HI_T_Q5_1: qk = 32; bs = sizeof(block_q5_1); break;
    case HI_T_Q8_0: qk = 32; bs = sizeof(block_q8_0); break;
    case HI_T_Q4_K: qk = 256; bs = sizeof(block_q4_K); break;
    case HI_T_Q5_K: qk = 256; bs = sizeof(block_q5_K); break;
    case HI_T_Q6_K: qk = 256; bs = sizeof(block_q6_K); break;
    default: return -1;
    }
    return n % qk ? -1 : n / qk * (int64_t)bs;
}

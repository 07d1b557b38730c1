/* AVX-512 VNNI compilation unit: vpdpbusd integer lanes (unsigned weights x signed activations, offsets
 * folded into the accumulator's start value), vfmadd float lanes: the float operations of ggml's AVX2
 * kernels. Maths: kernels_body.h and dot_kquants.h. The pragma sets the target of every function below
 * (gcc then defines __AVX512F__, __AVX512BW__, __AVX512VL__, __AVX512VNNI__, __AVX2__, __FMA__, __F16C__). */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#if !defined(__AVX512VNNI__) || !defined(__AVX512VL__) || !defined(__AVX512BW__) || !defined(__AVX2__) || \
    !defined(__FMA__) || !defined(__F16C__)
#error "isa_avx512vnni.c needs gcc's #pragma GCC target(...avx512vnni)"
#endif
#define HI_ISA_ID HI_ISA_AVX512VNNI
#define HI_ISA_NAME "avx512vnni"
#define HI_TABLE hi_kernels_avx512vnni
#include "kernels_body.h"

/* AVX2 + FMA + F16C compilation unit: 32-byte pmaddubsw + pmaddwd integer lanes, vfmadd float lanes: the
 * float operations of ggml's AVX2 kernels. Maths: kernels_body.h and dot_kquants.h. The pragma sets the
 * target of every function below (gcc then defines __AVX2__, __FMA__, __F16C__). */
#pragma GCC target("avx2,fma,f16c")
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__) || defined(__AVX512F__)
#error "isa_avx2.c needs gcc's #pragma GCC target(\"avx2,fma,f16c\")"
#endif
#define HI_ISA_ID HI_ISA_AVX2
#define HI_ISA_NAME "avx2"
#define HI_TABLE hi_kernels_avx2
#include "kernels_body.h"

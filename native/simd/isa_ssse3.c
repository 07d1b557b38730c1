/* SSSE3 compilation unit (old hosts without AVX/FMA): 16-byte pmaddubsw + pmaddwd integer lanes, float lanes
 * with a separate multiply and add (no FMA), fp16 converted in software. Maths: kernels_body.h and
 * dot_kquants.h. The pragma sets the target of every function below (gcc then defines __SSSE3__). */
#pragma GCC target("ssse3")
#if !defined(__SSSE3__) || defined(__AVX__)
#error "isa_ssse3.c needs gcc's #pragma GCC target(\"ssse3\") (and no wider target)"
#endif
#define HI_ISA_ID HI_ISA_SSSE3
#define HI_ISA_NAME "ssse3"
#define HI_TABLE hi_kernels_ssse3
#include "kernels_body.h"

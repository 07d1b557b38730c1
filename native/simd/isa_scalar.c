/* Scalar compilation unit: the portable reference path (plain int loops; fmaf for the float lanes, so its
 * floats equal ggml's AVX2 results). Maths: kernels_body.h (quantizers, legacy dots, float dots) and
 * dot_kquants.h (K-quants). Built with the compiler's baseline target and no ISA pragma. */
#define HI_ISA_ID HI_ISA_SCALAR
#define HI_ISA_NAME "scalar"
#define HI_TABLE hi_kernels_scalar
#include "kernels_body.h"
#if !defined(HI_SCALAR)
#error "isa_scalar.c must compile the scalar branches"
#endif

/* Block layouts of the GGUF weight types and of the int8 activation types they are multiplied with.
 * Identical to ggml's (the bytes of a GGUF tensor are arrays of these structs).
 *
 * Weights (QK = 32 unless noted; K-quants QK_K = 256):
 *   q4_0: w = d * (q - 8),             q 4-bit        (18 bytes)
 *   q4_1: w = d * q + m,               q 4-bit        (20 bytes)
 *   q5_0: w = d * (q - 16),            q 5-bit        (22 bytes)
 *   q5_1: w = d * q + m,               q 5-bit        (24 bytes)
 *   q8_0: w = d * q,                   q int8         (34 bytes)
 *   q4_K: w = d * sc_j * q - dmin * m_j, 8 sub-blocks of 32, 6-bit sc/m packed in scales[12] (144 bytes)
 *   q5_K: as q4_K with a fifth bit in qh                                                       (176 bytes)
 *   q6_K: w = d * sc_j * (q - 32), 16 sub-blocks of 16, int8 sc, q 6-bit (ql low 4 + qh high 2) (210 bytes)
 * Activations:
 *   q8_0: x ~= d * q                    (for q4_0, q5_0, q8_0 weights)
 *   q8_1: x ~= d * q, s = d * sum(q)    (for q4_1, q5_1 weights: the min term is m * s)
 *   q8_K: x ~= d * q, d float, bsums[j] = sum of q over 16-element group j (for K-quants: the min term)
 */
#ifndef HI_BLOCKS_H
#define HI_BLOCKS_H
#include <stdint.h>

#define HI_QK 32
#define HI_QK_K 256

typedef uint16_t hi_half; /* IEEE fp16 bits */

typedef struct { hi_half d; uint8_t qs[16]; } block_q4_0;
typedef struct { hi_half d; hi_half m; uint8_t qs[16]; } block_q4_1;
typedef struct { hi_half d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0;
typedef struct { hi_half d; hi_half m; uint8_t qh[4]; uint8_t qs[16]; } block_q5_1;
typedef struct { hi_half d; int8_t qs[32]; } block_q8_0;
typedef struct { hi_half d; hi_half s; int8_t qs[32]; } block_q8_1;
typedef struct { hi_half d; hi_half dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_K;
typedef struct { hi_half d; hi_half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; hi_half d; } block_q6_K;
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } block_q8_K;

_Static_assert(sizeof(block_q4_0) == 18, "q4_0");
_Static_assert(sizeof(block_q4_1) == 20, "q4_1");
_Static_assert(sizeof(block_q5_0) == 22, "q5_0");
_Static_assert(sizeof(block_q5_1) == 24, "q5_1");
_Static_assert(sizeof(block_q8_0) == 34, "q8_0");
_Static_assert(sizeof(block_q8_1) == 36, "q8_1");
_Static_assert(sizeof(block_q4_K) == 144, "q4_K");
_Static_assert(sizeof(block_q5_K) == 176, "q5_K");
_Static_assert(sizeof(block_q6_K) == 210, "q6_K");
_Static_assert(sizeof(block_q8_K) == 292, "q8_K");

#endif

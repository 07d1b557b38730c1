/* Public C API of hybridinfer's SIMD library (cffi compiles hybridinfer._simd against these declarations).
 *
 * A context holds the kernel table of one ISA level and a persistent thread pool; every call splits its
 * rows across the pool (the calling thread works too) and returns when all rows are done. Calls on one
 * context are serialized by a mutex; use one context per concurrent caller.
 *
 * Layouts: weights are ggml rows (the bytes of a GGUF tensor), row r at w + r * row_bytes(qtype, cols);
 * activation rows are in the format of act_kind(qtype) (block_q8_0 / block_q8_1 / block_q8_K arrays,
 * fp16 or fp32 values); *_row arguments are row strides (bytes for quantized rows, floats for float rows).
 * Return codes: 0 ok, -1 weight type without a kernel, -2 bad argument, -3 out of memory.
 */
#ifndef HI_SIMD_H
#define HI_SIMD_H

#include <stdint.h>

typedef struct hi_ctx hi_ctx;

/* ISA levels: 0 scalar, 1 ssse3, 2 avx2 (+fma, f16c), 3 avx512vnni (+f, bw, vl) */
int hi_isa_supported(int isa);
int hi_best_isa(void);
const char *hi_isa_name(int isa);

/* activation kind of a weight type: 0 f32, 1 f16, 2 q8_0, 3 q8_1, 4 q8_K, -1 no kernel */
int hi_act_kind(int qtype);
/* bytes of one activation row of n values for weight type qtype; -1 if n is not a whole number of blocks */
int64_t hi_act_row_bytes(int qtype, int64_t n);
/* bytes of one weight row of n values; -1 if n is not a whole number of blocks or no kernel */
int64_t hi_weight_row_bytes(int qtype, int64_t n);

/* isa < 0: the best one this CPU runs; n_threads >= 1 including the caller; spin_us: how long an idle
 * worker spins before it sleeps. NULL if the ISA is not supported here or resources are short. */
hi_ctx *hi_ctx_new(int isa, int n_threads, int spin_us);
void hi_ctx_free(hi_ctx *c);
int hi_ctx_isa(const hi_ctx *c);
int hi_ctx_threads(const hi_ctx *c);

/* x (T rows of cols floats, stride x_row floats) -> T activation rows for weight type qtype */
int hi_quantize(hi_ctx *c, int qtype, const float *x, int64_t x_row, int64_t T, int64_t cols, void *out,
                int64_t out_row);

/* out[t][r] = W[r] . x[t]: W (rows x cols, type qtype), xq T activation rows, out T rows of >= rows floats */
int hi_matmul(hi_ctx *c, int qtype, const void *w, int64_t rows, int64_t cols, const void *xq, int64_t xq_row,
              int64_t T, float *out, int64_t out_row);

/* several products of the same activation rows in one call (one pool task): for j < n,
 * out_j[t][r] = W_j[r] . xq[t], W_j of type qtypes[j] with rows[j] rows of cols values; every qtypes[j] must
 * take the activation format of xq (the same act_kind); at most 64 matrices */
int hi_matmul_many(hi_ctx *c, int n, const int *qtypes, const void *const *ws, const int64_t *rows, int64_t cols,
                   const void *xq, int64_t xq_row, int64_t T, float *const *outs, const int64_t *out_rows);

/* MoE decode, gate and up fused: for i < k, e = ids[i] (0 <= e < n_expert):
 *   gate_out[i] = Wg[e] . xq,  up_out[i] = Wu[e] . xq
 * Wg, Wu stacked expert tensors (ggml {cols, rows, n_expert}: expert e's rows contiguous), one xq row. */
int hi_moe_gate_up(hi_ctx *c, int gate_qtype, const void *wg, int up_qtype, const void *wu, int64_t n_expert,
                   int64_t rows, int64_t cols, const void *xq, const int32_t *ids, int k, float *gate_out,
                   int64_t gate_row, float *up_out, int64_t up_row);

/* MoE decode, down: out[i] = Wd[ids[i]] . xq[i] for i < k (each expert its own activation row) */
int hi_moe_down(hi_ctx *c, int qtype, const void *w, int64_t n_expert, int64_t rows, int64_t cols, const void *xq,
                int64_t xq_row, const int32_t *ids, int k, float *out, int64_t out_row);

/* all threads stream-read a fresh buffer of about nbytes (split in equal slices, first touched by their
 * reader); best of reps timed passes; returns bytes per second (<= 0 on failure) */
double hi_read_bandwidth(hi_ctx *c, int64_t nbytes, int reps);

#endif

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

/* ggml_op: which llama.cpp operation the product stands for, and so which float shape its K-quant rows
 * take (dot_kq_shapes.h): 0 none (ggml_vec_dot's shape everywhere), 1 MUL_MAT (a dense matrix over T
 * tokens), 2 MUL_MAT_ID (one expert over the T tokens routed to it). On ISA levels below avx2, where
 * llama.cpp neither repacks nor tiles, every op takes vec_dot's shape. Other weight types ignore it. */
/* HI_GGML_DECODE_ROWS: every row takes the float shape of a one-token MUL_MAT (llama.cpp's decode), whatever T,
 * so a row's result does not depend on the rows beside it (several sequences' decode tokens in one product; the
 * CPU backend's every product, so that a prompt's logits do not depend on how it is cut into chunks) */
enum { HI_GGML_NONE = 0, HI_GGML_MUL_MAT = 1, HI_GGML_MUL_MAT_ID = 2, HI_GGML_DECODE_ROWS = 3 };

/* out[t][r] = W[r] . x[t]: W (rows x cols, type qtype), xq T activation rows, out T rows of >= rows floats */
int hi_matmul(hi_ctx *c, int qtype, const void *w, int64_t rows, int64_t cols, const void *xq, int64_t xq_row,
              int64_t T, float *out, int64_t out_row, int ggml_op);

/* several products of one input in one call (one pool task): for j < n, out_j[t][r] = W_j[r] . xq_j[t], W_j of
 * type qtypes[j] with rows[j] rows of cols values, xq_j = xqs[j] the input quantized to that type's activation
 * format (rows xq_rows[j] bytes apart; matrices of the same format share one); at most 64 matrices */
int hi_matmul_many(hi_ctx *c, int n, const int *qtypes, const void *const *ws, const int64_t *rows, int64_t cols,
                   const void *const *xqs, const int64_t *xq_rows, int64_t T, float *const *outs,
                   const int64_t *out_rows, int ggml_op);

/* MoE over several tokens grouped by expert (hi_simd.c says how): one pool task for all groups; with xws (else
 * NULL) an extra group, the last xT of the npairs rows against the matrices xws[w] (same types) into xouts[w], as
 * ggml op xop (a shared expert, in the shape its own product would take) */
int hi_moe_grouped(hi_ctx *c, int nw, const int *qtypes, const void *const *ws, int64_t n_expert, int64_t rows,
                   int64_t cols, const void *xq, int64_t xq_row, int64_t npairs, int ngroups, const int32_t *experts,
                   const int64_t *starts, float *const *outs, int64_t out_row, int ggml_op, const void *const *xws,
                   int64_t xT, float *const *xouts, int xop);

/* The routed experts of T tokens in one call (moe_rows.c says how): for pair p = t*k + j, e = idx[p],
 *   ys[p] = Wd[e] . q_down(swiglu(Wg[e] . xq_t, Wu[e] . xq_t))
 * grouped by expert (each selected expert read once); eg, eu (T*k rows of n_ff, e_row apart) and hq (T*k rows in
 * the down matrix's activation format) are work rows; scratch of hi_moe_rows_scratch(T*k, n_expert, x_bytes,
 * n_embd) bytes (x_bytes: hi_act_row_bytes(gate_qt, n_embd)). ggml_op: GGML_DECODE_ROWS (each pair in its one-token
 * shape: several sequences' decode tokens, or a prompt's tokens independent of the chunk) or GGML_MUL_MAT_ID
 * (llama.cpp's shape for a prompt). With sg non-NULL, a shared expert of the same types and shapes (sg, su
 * n_ff x n_embd, sd n_embd x n_ff) rides in the same pool runs: s_out[t] (s_out_row apart) = Sd . q_down(swiglu(
 * Sg . xq_t, Su . xq_t)), s_out_row == n_embd, in the shape its own products take (GGML_MUL_MAT for GGML_MUL_MAT_ID, else ggml_op); its
 * rows follow the pairs' in eg, eu and hq (T*k + T rows), and the scratch is hi_moe_rows_scratch(T*k + T, ...). */
int64_t hi_moe_rows_scratch(int64_t n_pairs, int64_t n_expert, int64_t x_bytes, int64_t n_embd);
int hi_moe_rows(hi_ctx *c, int gate_qt, const void *wg, int up_qt, const void *wu, int down_qt, const void *wd,
                int64_t n_expert, int64_t n_ff, int64_t n_embd, const void *xq, int64_t xq_row, int64_t T,
                const int32_t *idx, int k, float *eg, float *eu, int64_t e_row, void *hq, int64_t hq_row, float *ys,
                int64_t ys_row, void *scratch, int64_t scratch_bytes, int ggml_op, const void *sg, const void *su,
                const void *sd, float *s_out, int64_t s_out_row);

/* MoE decode, gate and up fused: for i < k, e = ids[i] (0 <= e < n_expert):
 *   gate_out[i] = Wg[e] . xq,  up_out[i] = Wu[e] . xq
 * Wg, Wu stacked expert tensors (ggml {cols, rows, n_expert}: expert e's rows contiguous), one xq row.
 * With sg non-NULL also the shared expert's s_gate_out = Sg . xq and s_up_out = Su . xq (s_rows x cols each,
 * a MUL_MAT; their types take xq's activation format) in the same pool task. */
int hi_moe_gate_up(hi_ctx *c, int gate_qtype, const void *wg, int up_qtype, const void *wu, int64_t n_expert,
                   int64_t rows, int64_t cols, const void *xq, const int32_t *ids, int k, float *gate_out,
                   int64_t gate_row, float *up_out, int64_t up_row, int ggml_op, int s_gate_qtype, const void *sg,
                   int s_up_qtype, const void *su, int64_t s_rows, float *s_gate_out, float *s_up_out);

/* MoE decode, down: out[i] = Wd[ids[i]] . xq[i] for i < k (each expert its own activation row). With sw
 * non-NULL also the shared expert's s_out = Sw . s_xq (rows x s_cols, type s_qtype taking the same activation
 * format, a MUL_MAT) in the same pool task. */
int hi_moe_down(hi_ctx *c, int qtype, const void *w, int64_t n_expert, int64_t rows, int64_t cols, const void *xq,
                int64_t xq_row, const int32_t *ids, int k, float *out, int64_t out_row, int ggml_op, int s_qtype,
                const void *sw, int64_t s_cols, const void *s_xq, float *s_out);

/* Causal softmax attention of T query tokens at positions pos0..pos0+T-1 over an F32 K/V cache, with
 * llama.cpp's float operations (its CPU backend without flash attention, built for this ISA level:
 * kernels_attn.h). q: T rows of H*hd floats (stride q_row); k, v: cache rows 0..pos0+T-1 of Hkv*hd floats
 * (stride kv_row, position-major); out: T rows of H*hd floats (stride out_row); query head h reads KV head
 * h / (H / Hkv); scores scaled by `scale`. scratch: scratch_len >= hi_attention_scratch(c, n_ctx, hd, 1) floats
 * for pos0 + T <= n_ctx; with hi_attention_scratch(c, n_ctx, hd, H / Hkv) the query heads that share a K/V head
 * are computed together where the rows are many enough (each K/V block read once for them). ggml_op: HI_GGML_DECODE_ROWS gives every query row the float order of a one-token step
 * (a row then never depends on T); any other the order llama.cpp's graph takes for T tokens. No allocation. */
int hi_attention(hi_ctx *c, const float *q, int64_t q_row, int64_t T, int64_t H, int64_t hd, const float *k,
                 const float *v, int64_t kv_row, int64_t Hkv, int64_t pos0, float scale, float *out, int64_t out_row,
                 float *scratch, int64_t scratch_len, int ggml_op);
int64_t hi_attention_scratch(const hi_ctx *c, int64_t n_ctx, int64_t hd, int64_t group);

/* RoPE in place on x (T, H, hd) contiguous, token t at position pos0 + t, the first n_rot dims of each head:
 * pairs (i, i + n_rot/2) (neox) or (2i, 2i+1); freq_factors (n_rot/2) or NULL; llama.cpp's float operations
 * (powf, cosf, sinf, the contracted rotation). On the calling thread. */
int hi_rope(hi_ctx *c, float *x, int64_t T, int64_t H, int64_t hd, int64_t pos0, int64_t n_rot, float theta_base,
            int neox, const float *freq_factors);
/* hi_rope with multimodal positions: token t at pos0 + t + shift, or with mrope non-NULL (n_rot/2 stream indexes
 * 0..3, then 4 positions a token) each pair at the position of its stream, as llama.cpp's IMROPE (ggml_mrope_cache_init) */
int hi_rope_multi(hi_ctx *c, float *x, int64_t T, int64_t H, int64_t hd, int64_t pos0, int64_t shift,
                  const int32_t *mrope, int64_t n_rot, float theta_base, int neox, const float *freq_factors);

/* Float products of many rows (gemm.c; the vision tower's F32/F16 matrices): hi_gemm_packed_floats is the floats
 * hi_gemm_pack needs for W [N, K] (row stride w_row floats; kn: W given as its transpose [K, N]) in this unit's panels, 0 where the unit has no such
 * kernel (scalar, SSSE3: hi_gemm_pack and hi_gemm then return -3); hi_gemm sets Y[M, N] = X[M, K] W^T (row strides
 * in floats) on the pool, then adds bias[N] to each row where bias is not NULL (each output's sum, then one
 * rounding of sum + bias: numpy's `y += bias` after the product, done while the tile is in cache), then R[M, N]
 * (row stride r_row; not Y's memory) where R is not NULL: numpy's `R + (X W^T + bias)`, a block's residual add. */
int64_t hi_gemm_packed_floats(const hi_ctx *c, int64_t N, int64_t K);
int hi_gemm_pack(const hi_ctx *c, const float *W, int64_t w_row, int64_t N, int64_t K, int kn, float *P);
int hi_gemm(hi_ctx *c, const float *X, int64_t x_row, const float *P, int64_t N, int64_t K, float *Y, int64_t y_row,
            int64_t M, const float *bias, const float *R, int64_t r_row);

/* The vision tower's full attention (vattn.c): out[i, h, :] = softmax_j(scale * q[h, i, :] . k[h, j, :]) v[h, :, :]
 * for q, k, v [nh, n, hd] and out [n, nh, hd], all contiguous float32, every key of every row (no mask), on the
 * pool; an online softmax over blocks of keys (no score buffer). ws: ws_len >= hi_vision_attention_floats(c, n, nh,
 * hd) floats of workspace, which is 0 where the unit has no such kernel (scalar, SSSE3: hi_vision_attention then
 * returns -3). A row's bits depend on its values and the unit, not on the thread count. */
int64_t hi_vision_attention_floats(const hi_ctx *c, int64_t n, int64_t nh, int64_t hd);
int hi_vision_attention(hi_ctx *c, const float *q, const float *k, const float *v, int64_t n, int64_t nh, int64_t hd,
                        float scale, float *out, float *ws, int64_t ws_len);

/* The vision tower's row ops (vrows.c), over rows on the pool, the bits of the numba kernels of
 * hybridinfer/backends/cpu/vision_kernels.py whatever the unit or thread count. Row strides in floats.
 * hi_vrows_layer_norm: out = (float)((x - mu) / sd) * w + b per row of n, mu and sd = sqrt(var + eps) in double
 * (each sum in order). hi_vrows_gelu: v = x + bias (bias NULL: v = x), then erf_kind 0: v / (1 + exp(-2u)),
 * u = sqrt(2/pi) (v + 0.044715 v^3), in float with Cephes' float exp; 1: 0.5 v (1 + erf(v / sqrt 2)) in double,
 * rounded; out may be x (the same rows). hi_vrows_rope_heads: qkv [rows, 3, heads, hd] (contiguous; hd even) ->
 * qh, vh [heads, rows, hd] and k [heads, hd, rows] (k_transposed) or [heads, rows, hd], q and k rotated by cos, sin
 * [rows, hd] (NeoX halves: x cos + rotate_half(x) sin). */
int hi_vrows_layer_norm(hi_ctx *c, const float *x, int64_t x_row, int64_t rows, int64_t n, const float *w,
                        const float *b, double eps, float *out, int64_t out_row);
int hi_vrows_gelu(hi_ctx *c, int erf_kind, const float *x, int64_t x_row, int64_t rows, int64_t n,
                  const float *bias, float *out, int64_t out_row);
int hi_vrows_rope_heads(hi_ctx *c, const float *qkv, const float *cos, const float *sin, int64_t rows, int64_t heads,
                        int64_t hd, float *qh, float *k, int k_transposed, float *vh);

/* SwiGLU of T rows of n values, out = silu(g) * u as llama.cpp's ggml_vec_swiglu_f32 (this ISA's build);
 * row strides in floats; out may alias g or u. In segments on the pool when there are several. */
int hi_swiglu(hi_ctx *c, const float *g, int64_t g_row, const float *u, int64_t u_row, float *out, int64_t out_row,
              int64_t T, int64_t n);

/* for i < n (n <= 1024; no buffer overlaps another): rows[i] rows of row_bytes[i] bytes from src[i] to dst[i],
 * row r at r * src_row[i] and r * dst_row[i] bytes (read only where rows[i] > 1), in segments on the pool.
 * -3: out of memory */
int hi_copy_many(hi_ctx *c, int64_t n, void *const *dst, const int64_t *dst_row, const void *const *src,
                 const int64_t *src_row, const int64_t *rows, const int64_t *row_bytes);

/* all threads stream-read a fresh buffer of about nbytes (split in equal slices, first touched by their
 * reader); best of reps timed passes; returns bytes per second (<= 0 on failure) */
double hi_read_bandwidth(hi_ctx *c, int64_t nbytes, int reps);

/* the same passes over the whole pages of an existing buffer of nbytes at p (read only; <= 0 when it is smaller
 * than 1 MiB, has no whole page for each thread, or holds only zero bytes) */
double hi_read_bandwidth_at(hi_ctx *c, const void *p, int64_t nbytes, int reps);

/* runs `reps` pool tasks of `total` chunks, each counting its runs; returns how many (chunk, task) pairs did
 * not run exactly once (0 when the pool is right; -1 on bad arguments or no memory) */
int64_t hi_pool_check(hi_ctx *c, int64_t total, int reps);

/* repacks nbytes of weight rows of type qtype (whole blocks, at data) in place into the layout this context's
 * unit reads fastest, and returns the qtype to pass with them from then on: qtype | 0x100 (HI_T_ZIPPED) for
 * K-quants on the SSSE3 unit (each block's quant bytes in its kernels' order, hi_kq_zip_blocks), qtype itself
 * elsewhere (the bytes left as they are); -1 for a type without kernels, -2 for a size that is not whole
 * blocks. Products of repacked rows give the same bits as of the rows as they were. */
int hi_repack_rows(hi_ctx *c, int qtype, void *data, int64_t nbytes);

/* decode products: bytes of each thread's weight stream software-prefetched ahead of the row it reads (0, the
 * default: none). Pays where decode is bound by memory (many threads; the hardware prefetcher restarts at
 * every 4 KiB page), costs where it is bound by compute (a few threads). */
void hi_ctx_set_prefetch(hi_ctx *c, int bytes);
int hi_ctx_prefetch(const hi_ctx *c);

/* where pooled calls lose time (hi_pool.h, hi_pool_stats): on != 0 clocks every pooled chunk from now on, 0 stops;
 * out (14 doubles, NULL: not read) gets the sums since the last read and resets them: for small tasks (under 24
 * chunks) then big ones, each tasks, chunks, wall_ns, busy_ns (per thread), start_ns (mean over the threads),
 * start_max_ns, spread_ns (first to last thread done) */
void hi_ctx_pool_stats(hi_ctx *c, int on, double *out);

/* Gated DeltaNet layer after its projections (docs/gguf-qwen35.md §3 steps 2-8) for T tokens, state in place;
 * the C twin of tests/oracles/numba_gdn.py:gdn_layer, bit-identical to it, value heads split across the pool.
 * u (T rows of C floats, row stride u_row), z (T x Hv*d_v, z_row), b, a (T x Hv, b_row, a_row), y (T x
 * Hv*d_v, y_row) <- gated-normed output; contiguous: conv_w (C, K), ssm_a, dt_bias (Hv), norm_w (d_v),
 * conv (K-1, C) (oldest row first), S (Hv, d_k, d_v); C = 2*n_k_heads*d_k + Hv*d_v; head_map_mod: value
 * head j reads key head j % n_k_heads, else j / (Hv / n_k_heads); scratch of scratch_len >= Hv*d_v + C
 * floats (the conv outputs of (scratch_len - Hv*d_v) / C tokens per chunk). No allocation.
 * conv_in, S_in: NULL (the state in place), or the state before the first token, read there and never written: the
 * state after the T tokens is then written to conv and S alone (a speculative verify step keeps the state it
 * started from without a copy; the same bits as in place). */
int hi_gdn_layer(hi_ctx *ctx, const float *u, int64_t u_row, const float *z, int64_t z_row, const float *b,
                 int64_t b_row, const float *a, int64_t a_row, const float *conv_w, const float *ssm_a,
                 const float *dt_bias, const float *norm_w, float *conv, float *S, int64_t T, int64_t C, int64_t K,
                 int64_t n_v_heads, int64_t d_k, int64_t d_v, int64_t n_k_heads, int head_map_mod, double eps,
                 float *y, int64_t y_row, float *scratch, int64_t scratch_len, const float *conv_in,
                 const float *S_in);

/* hi_gdn_layer for one token of each of B sequences: row j of u, z, b, a, y is sequence j's token, conv[j] and
 * S[j] its states; scratch of B * (Hv*d_v + C) floats. Bit-identical to B calls of hi_gdn_layer (T = 1), in two
 * pool runs for all. */
int hi_gdn_rows(hi_ctx *ctx, int64_t B, const float *u, int64_t u_row, const float *z, int64_t z_row, const float *b,
                int64_t b_row, const float *a, int64_t a_row, const float *conv_w, const float *ssm_a,
                const float *dt_bias, const float *norm_w, float *const *conv, float *const *S, int64_t C, int64_t K,
                int64_t n_v_heads, int64_t d_k, int64_t d_v, int64_t n_k_heads, int head_map_mod, double eps,
                float *y, int64_t y_row, float *scratch, int64_t scratch_len);

/* hi_attn_step for one token of each of B sequences: row j of q, k_new, v_new, out is sequence j's token, at
 * position pos[j] + dpos in its caches k_cache[j], v_cache[j] (n_ctx rows, types as hi_attn_step's); every
 * (sequence, head) query row in one pool run, each computed as alone (bit-identical to B hi_attn_step calls);
 * scratch as hi_attention's. rope_shift (NULL: none): sequence j's rope position is its row + rope_shift[j]
 * (the positions an image took fewer than its tokens, models/mrope.py). */
int hi_attn_rows(hi_ctx *c, int64_t B, float *q, int64_t q_row, int64_t H, int64_t hd, const float *k_new,
                 const float *v_new, int64_t kv_new_row, void *const *k_cache, void *const *v_cache, int k_type,
                 int v_type, int64_t n_ctx, int64_t Hkv, const int64_t *pos, int64_t dpos, int64_t n_rot,
                 float theta_base, int neox, const float *freq_factors, float scale, float *out, int64_t out_row,
                 float *scratch, int64_t scratch_len, int64_t rot_k, int64_t rot_v, const int64_t *rope_shift);

/* ---- small decode ops (ops.c), on the calling thread (sigmoid_gate in segments on the pool), plain float order:
 * the C twins of the numba ops in tests/oracles/numba_ops.py, bit-identical to them (the float operations written
 * there, no FMA contraction) */

/* residual add and RMSNorm over T tokens of H heads of n floats (head h of token t at x + t*x_row + h*n):
 * with y non-NULL first h[t] += y[t] (H*n floats); with w non-NULL then out[t, h] = (h[t, h] * s) * w with
 * ggml's s = 1.0f / sqrtf((float)(sum of float squares in double / n) + (float)eps); out may be h */
int hi_rms_norm(hi_ctx *c, float *h, int64_t h_row, const float *y, int64_t y_row, int64_t T, int64_t H, int64_t n,
                const float *w, double eps, float *out, int64_t out_row);
/* Qwen's attn_q output, per head [query(hd), gate(hd)] -> q (T, H, hd) contiguous and gate (T rows of H*hd,
 * stride gate_row); gate NULL: qg holds the queries alone (q = qg) */
int hi_split_qgate(hi_ctx *c, const float *qg, int64_t qg_row, int64_t T, int64_t H, int64_t hd, float *q,
                   float *gate, int64_t gate_row);
/* o (T rows of n, stride o_row) *= 1 / (1 + expf(-g)) (the attention output gate) */
int hi_sigmoid_gate(hi_ctx *c, float *o, int64_t o_row, const float *g, int64_t g_row, int64_t T, int64_t n);
/* router: softmax of each row of E logits in double, the k best (ties: lower id), weights renormalized to
 * their sum (at least 2^-14), narrowed to float; idx, w: T rows of k */
int hi_moe_route(hi_ctx *c, const float *logits, int64_t l_row, int64_t T, int64_t E, int k, int32_t *idx,
                 float *w);
/* out[t] = sum_j w[t, j] * ys[t*k + j] in slot order; with s non-NULL then out[t] += s[t] * sigmoid(x[t] . w_shg)
 * (the dot in double, narrowed to float); ys, out, s, x contiguous rows of n floats. The gates on the calling
 * thread, the sums in segments on the pool. */
int hi_moe_combine(hi_ctx *c, const float *ys, const float *w, int64_t T, int k, int64_t n, float *out,
                   const float *s, const float *x, const float *w_shg);

/* attention of T new tokens at pos0.. (a whole step): ropes q (T, H, hd contiguous) and their k rows (T rows of
 * Hkv*hd floats, stride kv_new_row) at pos0.. (hi_rope), writes those and the v rows to the caches' rows pos0..
 * (n_ctx rows of Hkv heads of hd values) in the caches' ggml types k_type / v_type (f32, f16, q8_0, q4_0; as
 * llama.cpp's set_rows writes them), then attends: both F32, hi_attention (ggml_op as there); else in the order of
 * llama.cpp's CPU flash attention (kernels_fa.h, kernels_fa_tiled.h), every row as a one-token step. scratch as
 * hi_attention's.
 * rot_k, rot_v (0: none; a power of two from 64 dividing hd, quantized types only): llama.cpp's rotation of a
 * quantized cache: q and K after the rope, and V, rotated by the Walsh-Hadamard transform of that many values
 * (ggml's fwht) before the cache is written, and the output rotated back from V's.
 * rope_shift, mrope: the rope positions as hi_rope_multi's (the cache rows stay pos0..). */
int hi_attn_step(hi_ctx *c, float *q, int64_t T, int64_t H, int64_t hd, const float *k_new, const float *v_new,
                 int64_t kv_new_row, void *k_cache, void *v_cache, int k_type, int v_type, int64_t n_ctx, int64_t Hkv,
                 int64_t pos0, int64_t n_rot, float theta_base, int neox, const float *freq_factors, float scale,
                 float *out, int64_t out_row, float *scratch, int64_t scratch_len, int ggml_op, int64_t rot_k,
                 int64_t rot_v, int64_t rope_shift, const int32_t *mrope);

/* hi_attn_step's cache writes alone: the T new K rows roped (and rotated) and the V rows written at pos0.., no
 * query and no attention. A row written here is the same bytes hi_attn_step writes for it: the MTP drafter's
 * catch-up over accepted positions needs the block's K/V rows only, never its output. */
int hi_attn_store(hi_ctx *c, int64_t T, int64_t hd, const float *k_new, const float *v_new, int64_t kv_new_row,
                  void *k_cache, void *v_cache, int k_type, int v_type, int64_t n_ctx, int64_t Hkv, int64_t pos0,
                  int64_t n_rot, float theta_base, int neox, const float *freq_factors, int64_t rot_k, int64_t rot_v,
                  int64_t rope_shift, const int32_t *mrope);

/* ---- per-node weight copies (replica.c) ------------------------------------------------------------------
 * A product's chunk reads its weights from the copy of its thread's replica (the same bytes, so the same result)
 * when the job's whole weight extent lies in a registered span. Spans: n_spans (0 clears the table) disjoint
 * ranges [bases[s], bases[s] + lens[s]); copies[s * n_copies + k]: replica k's copy of span s (lens[s] bytes, kept
 * alive by the caller while registered). Threads: tid 0 is the caller, 1.. the workers; replica -1 reads the
 * registered bytes themselves; cpus (ncpus > 0, workers only) pins the worker. Hits: out[tid * HI_MAX_REPLICAS + k]
 * = chunks thread tid read from copy k since the table was set (or last reset). Return codes as above, and -4
 * the kernel refused the CPU set. */
enum { HI_MAX_REPLICAS = 16, HI_MAX_SPANS = 16 };
int hi_ctx_set_replicas(hi_ctx *c, int n_spans, const void *const *bases, const int64_t *lens, int n_copies,
                        const void *const *copies);
int hi_ctx_place_thread(hi_ctx *c, int tid, int replica, const int *cpus, int ncpus);
int hi_ctx_thread_replica(hi_ctx *c, int tid);
int hi_ctx_replica_hits(hi_ctx *c, int64_t *out, int reset);

/* ---- recorded steps (replay.c): a decode step's native calls run back to back without returning to Python.
 * Each step names an entry point above (HI_OP_*) and holds its arguments after the context, in order:
 * pointers in .p, integers in .i, floats in .f; the argument at index pos_arg (-1: none) is replaced by
 * pos + its .i (the token's position). */
enum {
    HI_OP_QUANTIZE = 1, HI_OP_MATMUL, HI_OP_MATMUL_MANY, HI_OP_MOE_GATE_UP, HI_OP_MOE_DOWN, HI_OP_SWIGLU,
    HI_OP_GDN_LAYER, HI_OP_RMS_NORM, HI_OP_SPLIT_QGATE, HI_OP_SIGMOID_GATE, HI_OP_MOE_ROUTE, HI_OP_MOE_COMBINE,
    HI_OP_ATTN_STEP, HI_OP_MOE_ROWS, HI_OP_GDN_ROWS, HI_OP_ATTN_ROWS, HI_OP_COPY_MANY, HI_OP_COUNT
};
enum { HI_STEP_ARGS = 32 };
typedef union {
    int64_t i;
    double f;
    void *p;
} hi_arg;
typedef struct {
    int32_t op;
    int32_t pos_arg;
    hi_arg a[32]; /* HI_STEP_ARGS */
} hi_step;
/* runs steps[0..n) at position pos; returns 0, or the first failing call's code with *failed = its index.
 * ns (NULL: not clocked): ns[i] += the nanoseconds step i took (two clock reads per step) */
int hi_replay_run(hi_ctx *c, const hi_step *steps, int64_t n, int64_t pos, int64_t *failed, int64_t *ns);

#endif

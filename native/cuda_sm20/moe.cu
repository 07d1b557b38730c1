// MoE routing, grouping by expert and combination (docs/gguf-qwen35.md §5; reference_ops.moe_route and
// ReferenceModel.moe), fp32 and int32, sm_20 subset.
//
// Maths. Router logits l [T, E]: P = softmax(l) over all experts; I = the k largest P (ties: lower
// expert index first, as numpy's stable argsort of -P); w_e = P_e / max(sum_{e' in I} P_e', 2^-14).
// softmax is monotonic, so the top-k is taken on the logits themselves.
// Grouping is a stable counting sort of the T*k (token, slot) pairs p = t*k + s by expert:
// counts[e], offsets[e] = sum_{e' < e} counts[e'] (offsets[E] = T*k), and for each pair its grouped
// row offsets[e] + (number of earlier pairs with the same expert), so rows of one expert are in
// token order and the result does not depend on thread timing. perm_tok[row] = t, perm_w[row] = w,
// row_of_pair[p] = row. Combination gathers instead of scattering (deterministic, no atomics):
//   out[t] = sum_{s<k} w[t,s] Y[row_of_pair[t*k+s]]  (+ sigma(gate_logit[t]) shared[t]).
#include "prefill_common.cuh"

#define MOE_MAX_E 1024
#define MOE_ROUTE_THREADS 256
#define MOE_MAX_K 16
#define MOE_TILE 256  // pairs per block in moe_tile_rank / moe_scatter (their blockDim.x)

// ids [T, k] int32, weights [T, k] f32 from logits [T, E]. grid min(T, 65535) looping over tokens,
// block MOE_ROUTE_THREADS.
extern "C" __global__ void moe_route(const float* __restrict__ logits, int* __restrict__ ids,
                                     float* __restrict__ weights, int T, int E, int k) {
    __shared__ float lg[MOE_MAX_E];
    __shared__ int taken[MOE_MAX_E];
    __shared__ float red[MOE_ROUTE_THREADS];
    __shared__ float bv[MOE_ROUTE_THREADS];
    __shared__ int bi[MOE_ROUTE_THREADS];
    __shared__ float psel[MOE_MAX_K];
    const int tid = threadIdx.x, nth = blockDim.x;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        float mx = -INFINITY;
        for (int e = tid; e < E; e += nth) {
            const float v = logits[(size_t)t * E + e];
            lg[e] = v;
            taken[e] = 0;
            mx = fmaxf(mx, v);
        }
        mx = pf_block_max(mx, red);
        float z = 0.0f;
        for (int e = tid; e < E; e += nth) z += expf(lg[e] - mx);
        z = pf_block_sum(z, red);
        for (int s = 0; s < k; ++s) {
            float v0 = -INFINITY;
            int i0 = 0x7fffffff;
            for (int e = tid; e < E; e += nth) {
                const float v = lg[e];
                if (!taken[e] && (v > v0 || (v == v0 && e < i0))) {
                    v0 = v;
                    i0 = e;
                }
            }
            bv[tid] = v0;
            bi[tid] = i0;
            __syncthreads();
            for (int h = nth >> 1; h > 0; h >>= 1) {
                if (tid < h) {
                    const float v = bv[tid + h];
                    const int i = bi[tid + h];
                    if (v > bv[tid] || (v == bv[tid] && i < bi[tid])) {
                        bv[tid] = v;
                        bi[tid] = i;
                    }
                }
                __syncthreads();
            }
            if (tid == 0) {
                int e = bi[0];
                if (e >= E) {  // only NaN logits left: take the lowest free expert so ids stay valid
                    e = 0;
                    while (e < E - 1 && taken[e]) ++e;
                }
                taken[e] = 1;
                ids[(size_t)t * k + s] = e;
                psel[s] = expf(lg[e] - mx) / z;
            }
            __syncthreads();
        }
        if (tid == 0) {
            float sum = 0.0f;
            for (int s = 0; s < k; ++s) sum += psel[s];
            const float den = fmaxf(sum, 6.103515625e-5f);
            for (int s = 0; s < k; ++s) weights[(size_t)t * k + s] = psel[s] / den;
        }
        __syncthreads();
    }
}

// Pass 1 of the counting sort. Block b takes pairs [b*MOE_TILE, (b+1)*MOE_TILE) of ids (P = T*k
// pairs). rank[p] = earlier pairs of the tile with the same expert; hist[b, e] = pairs of the tile
// routed to e. grid ceil(P / MOE_TILE), block MOE_TILE. hist [n_tiles, E].
extern "C" __global__ void moe_tile_rank(const int* __restrict__ ids, int* __restrict__ rank, int* __restrict__ hist,
                                         int P, int E) {
    __shared__ int es[MOE_TILE];
    const int tid = threadIdx.x;
    const int p = blockIdx.x * MOE_TILE + tid;
    const int e = p < P ? ids[p] : -1;
    es[tid] = e;
    int* h = hist + (size_t)blockIdx.x * E;
    for (int i = tid; i < E; i += MOE_TILE) h[i] = 0;
    __syncthreads();
    if (e < 0 || e >= E) return;
    int before = 0, after = 0;
    for (int i = 0; i < MOE_TILE; ++i) {
        const int same = es[i] == e;
        if (i < tid) before += same;
        else if (i > tid) after += same;
    }
    rank[p] = before;
    if (after == 0) h[e] = before + 1;  // the last pair of e in the tile writes the tile's count
}

// Pass 2, one block of blockDim.x >= E threads (a power of two): per expert, turn hist[b, e] into
// the exclusive prefix over tiles (in place) and the total counts[e]; offsets [E+1] = exclusive
// scan of counts (Hillis-Steele in shared memory).
extern "C" __global__ void moe_offsets(int* __restrict__ hist, int* __restrict__ counts, int* __restrict__ offsets,
                                       int n_tiles, int E) {
    __shared__ int buf[2][MOE_MAX_E];
    const int e = threadIdx.x;
    int total = 0;
    if (e < E) {
        for (int b = 0; b < n_tiles; ++b) {
            const int h = hist[(size_t)b * E + e];
            hist[(size_t)b * E + e] = total;
            total += h;
        }
        counts[e] = total;
    }
    int cur = 0;
    buf[0][e] = total;
    __syncthreads();
    for (int d = 1; d < blockDim.x; d <<= 1) {
        const int v = buf[cur][e] + (e >= d ? buf[cur][e - d] : 0);
        buf[cur ^ 1][e] = v;
        cur ^= 1;
        __syncthreads();
    }
    const int incl = buf[cur][e];
    if (e < E) offsets[e] = incl - total;
    if (e == E - 1) offsets[E] = incl;
}

// Pass 3: row = offsets[e] + hist[b, e] + rank[p]; perm_tok[row] = p / k, perm_w[row] = weights[p],
// row_of_pair[p] = row. rank may alias row_of_pair (each thread reads its entry, then writes it).
// grid ceil(P / MOE_TILE), block MOE_TILE.
extern "C" __global__ void moe_scatter(const int* __restrict__ ids, const float* __restrict__ weights,
                                       const int* __restrict__ offsets, const int* __restrict__ hist, const int* rank,
                                       int* __restrict__ perm_tok, float* __restrict__ perm_w, int* row_of_pair,
                                       int P, int E, int k) {
    const int p = blockIdx.x * MOE_TILE + threadIdx.x;
    if (p >= P) return;
    const int e = ids[p];
    if (e < 0 || e >= E) return;
    const int row = offsets[e] + hist[(size_t)blockIdx.x * E + e] + rank[p];
    perm_tok[row] = p / k;
    perm_w[row] = weights[p];
    row_of_pair[p] = row;
}

// xg[row] = x[perm_tok[row]]: the grouped expert inputs. x [T, D], xg [P, D].
// grid (ceil(D / blockDim.x), min(P, 65535)) looping over rows.
extern "C" __global__ void moe_gather_rows(const float* __restrict__ x, const int* __restrict__ perm_tok,
                                           float* __restrict__ xg, int P, int D) {
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    for (int r = blockIdx.y; r < P; r += gridDim.y) xg[(size_t)r * D + d] = x[(size_t)perm_tok[r] * D + d];
}

// out[t] = sum_{s<k} w[t,s] Y[row_of_pair[t*k+s]] (slot order; w NULL: weight 1, for expert outputs
// already scaled by perm_w), plus sigma(shared_gate[t]) * shared[t] when shared is not NULL.
// Y [P, D], row_of_pair, w [T, k], out, shared [T, D], shared_gate [T].
// grid (ceil(D / blockDim.x), min(T, 65535)) looping over tokens.
extern "C" __global__ void moe_combine(const float* __restrict__ Y, const int* __restrict__ row_of_pair,
                                       const float* __restrict__ w, const float* __restrict__ shared,
                                       const float* __restrict__ shared_gate, float* __restrict__ out, int T, int D,
                                       int k) {
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        float acc = 0.0f;
        for (int s = 0; s < k; ++s) {
            const size_t p = (size_t)t * k + s;
            const float y = Y[(size_t)row_of_pair[p] * D + d];
            acc = w ? fmaf(w[p], y, acc) : acc + y;
        }
        if (shared) acc = fmaf(pf_sigmoid(shared_gate[t]), shared[(size_t)t * D + d], acc);
        out[(size_t)t * D + d] = acc;
    }
}

// out[t] += sigma(gate_logit[t]) * shared[t]: the gated shared expert on its own.
// out, shared [T, D]; gate_logit [T] (w_shexp_gate . x from a GEMV). Same grid as moe_combine.
extern "C" __global__ void moe_shared_add(float* __restrict__ out, const float* __restrict__ shared,
                                          const float* __restrict__ gate_logit, int T, int D) {
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        const size_t i = (size_t)t * D + d;
        out[i] = fmaf(pf_sigmoid(gate_logit[t]), shared[i], out[i]);
    }
}

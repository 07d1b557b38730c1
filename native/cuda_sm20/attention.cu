// Causal GQA attention for prefill (docs/gguf-qwen35.md §4 steps 5-7), fp32, sm_20 subset.
//
// Maths. T queries at absolute positions pos0..pos0+T-1, query head h reading KV head
// kv(h) = h / (H / H_kv) (division, as ggml and HF repeat_kv). Query row t sees keys s <= pos0 + t:
//   s_ts = (q_t . k_s) / sqrt(hd),   a_t = sum_s softmax_s(s_ts) v_s,   out_t = a_t * sigma(gate_t).
// The softmax is computed online over key tiles of bk keys (flash-attention style): per query row a
// running maximum m, running denominator l and un-normalised accumulator acc; for each tile
//   m' = max(m, max_j s_j),  p_j = e^(s_j - m'),  c = e^(m - m'),  l' = c l + sum_j p_j,
//   acc' = c acc + sum_j p_j v_j,
// and finally a = acc / l. Key 0 is visible to every row and lies in the first tile, so m is finite
// from the first tile on and masked scores (-inf) contribute e^-inf = 0.
//
// Layout. q [T, H, hd] (already RMS-normed and roped), K/V cache [n_ctx, H_kv, hd] with rows
// [0, pos0 + T) valid (the new rows written first, e.g. by kv_append), gate [T, H*hd] or NULL,
// out [T, H, hd]. One block of ATT_THREADS threads per (tile of ATT_BQ queries, head); grid
// (ceil(T / ATT_BQ), H). Shared memory (dynamic): Q tile, K-or-V tile (rows padded to hd+1 floats
// to avoid bank conflicts), the score/probability tile and per-row m, l, c.
#include "prefill_common.cuh"

#define ATT_BQ 16
#define ATT_THREADS 256
#define ATT_MAXR 16  // ATT_BQ * hd / ATT_THREADS for hd <= 256: accumulator registers per thread

extern "C" __global__ void attn_prefill(const float* __restrict__ q, const float* __restrict__ kc,
                                        const float* __restrict__ vc, const float* __restrict__ gate,
                                        float* __restrict__ out, int T, int H, int H_kv, int hd, int pos0,
                                        int bk, float scale) {
    extern __shared__ float sm[];
    const int ld = hd + 1;
    float* Qs = sm;                    // ATT_BQ x ld
    float* KV = Qs + ATT_BQ * ld;      // bk x ld
    float* Ps = KV + bk * ld;          // ATT_BQ x bk
    float* mrow = Ps + ATT_BQ * bk;    // ATT_BQ
    float* lrow = mrow + ATT_BQ;       // ATT_BQ
    float* crow = lrow + ATT_BQ;       // ATT_BQ

    const int tid = threadIdx.x;
    const int nth = blockDim.x;
    const int qt = gridDim.x - 1 - blockIdx.x;  // the longest (last) query tiles start first
    const int h = blockIdx.y;
    const int kvh = h / (H / H_kv);
    const int t0 = qt * ATT_BQ;
    const int nq = min(ATT_BQ, T - t0);
    const int nqd = ATT_BQ * hd;

    for (int p = tid; p < nqd; p += nth) {
        const int i = p / hd, d = p - (p / hd) * hd;
        Qs[i * ld + d] = i < nq ? q[((size_t)(t0 + i) * H + h) * hd + d] * scale : 0.0f;
    }
    if (tid < ATT_BQ) {
        mrow[tid] = -INFINITY;
        lrow[tid] = 0.0f;
    }
    float acc[ATT_MAXR];
#pragma unroll
    for (int r = 0; r < ATT_MAXR; ++r) acc[r] = 0.0f;

    const int nkeys = pos0 + t0 + nq;  // keys [0, nkeys) are visible to some row of this tile
    for (int k0 = 0; k0 < nkeys; k0 += bk) {
        const int nk = min(bk, nkeys - k0);
        __syncthreads();  // previous tile's readers of KV are done
        for (int p = tid; p < bk * hd; p += nth) {
            const int j = p / hd, d = p - (p / hd) * hd;
            KV[j * ld + d] = j < nk ? kc[((size_t)(k0 + j) * H_kv + kvh) * hd + d] : 0.0f;
        }
        __syncthreads();
        for (int p = tid; p < ATT_BQ * bk; p += nth) {
            const int i = p / bk, j = p - (p / bk) * bk;
            const int last = pos0 + t0 + min(i, nq - 1);  // last key row i may see (padding rows: as nq-1)
            float s = -INFINITY;
            if (j < nk && k0 + j <= last) {
                const float* a = Qs + i * ld;
                const float* b = KV + j * ld;
                float dot = 0.0f;
                for (int d = 0; d < hd; ++d) dot = fmaf(a[d], b[d], dot);
                s = dot;
            }
            Ps[p] = s;
        }
        __syncthreads();
        if (tid < ATT_BQ) {
            float* pr = Ps + tid * bk;
            const float m_old = mrow[tid];
            float mx = m_old;
            for (int j = 0; j < nk; ++j) mx = fmaxf(mx, pr[j]);
            float sum = 0.0f;
            for (int j = 0; j < bk; ++j) {
                const float e = j < nk ? expf(pr[j] - mx) : 0.0f;
                pr[j] = e;
                sum += e;
            }
            const float c = expf(m_old - mx);  // 0 on the first tile (m_old = -inf)
            lrow[tid] = fmaf(lrow[tid], c, sum);
            mrow[tid] = mx;
            crow[tid] = c;
        }
        for (int p = tid; p < bk * hd; p += nth) {  // V tile may overwrite K: scores are in Ps already
            const int j = p / hd, d = p - (p / hd) * hd;
            KV[j * ld + d] = j < nk ? vc[((size_t)(k0 + j) * H_kv + kvh) * hd + d] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ATT_MAXR; ++r) {
            const int p = tid + r * nth;
            if (p < nqd) {
                const int i = p / hd, d = p - (p / hd) * hd;
                const float* pr = Ps + i * bk;
                const float* vv = KV + d;
                float a = acc[r] * crow[i];
                for (int j = 0; j < nk; ++j) a = fmaf(pr[j], vv[j * ld], a);
                acc[r] = a;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ATT_MAXR; ++r) {
        const int p = tid + r * nth;
        if (p < nqd) {
            const int i = p / hd, d = p - (p / hd) * hd;
            if (i < nq) {
                float o = acc[r] / lrow[i];
                const size_t t = (size_t)(t0 + i);
                if (gate) o *= pf_sigmoid(gate[(t * H + h) * hd + d]);
                out[(t * H + h) * hd + d] = o;
            }
        }
    }
}

// out[i] *= sigma(gate[i]) for n elements: the output gate on its own (when attn_prefill ran
// without one). Grid-stride loop, any 1-D grid.
extern "C" __global__ void attn_gate_mul(float* __restrict__ out, const float* __restrict__ gate, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] *= pf_sigmoid(gate[i]);
}

// Append T new rows to the caches: k_cache[pos0 + t] = k_new[t], v_cache likewise.
// k_new, v_new [T, H_kv, hd]; caches [n_ctx, H_kv, hd]; n = T * H_kv * hd. Grid-stride loop.
extern "C" __global__ void kv_append(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                     float* __restrict__ k_cache, float* __restrict__ v_cache, int n,
                                     int row, int pos0) {
    const size_t base = (size_t)pos0 * row;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        k_cache[base + i] = k_new[i];
        v_cache[base + i] = v_new[i];
    }
}

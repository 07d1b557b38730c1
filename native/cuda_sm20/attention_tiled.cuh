// attn_prefill_body's maths, with each thread's work held in registers (included by attention.cu after kv_load).
//
// Why: attn_prefill_body reads two shared-memory values per multiply-add (a query and a key value for each score,
// a probability and a V value for each output), and 16 threads run each key tile's softmax alone while the rest
// wait, so shared memory, not arithmetic, sets its speed (about 8% of an H200's fp32 peak on a 32K prompt). Here:
// - scores: thread t takes query row i = t / 16 and keys j = t % 16 + 16 u (u < bk / 16), reading the query and
//   the keys as float4 (rows padded to hd + 4 floats: 16-byte aligned, and the 8 key rows of a quarter warp on
//   distinct banks; the 16 threads of a row read its query as one broadcast).
// - softmax: every thread of a row takes the tile's maximum from the row's scores and exponentiates its own; the
//   row's running maximum lives in each of its threads' registers, its running sum in its first thread's.
// - output: thread t takes dimension d = t % hd of R = 16 hd / 256 consecutive query rows, reading each V value
//   once and the probabilities as float4 (stored key-major, so a thread's rows are contiguous).
// Each sum is taken in attn_prefill_body's order (scores over d, the tile's sum and the outputs over keys in
// order, one rescale a tile) with attn_prefill_body's key tile, so the results are the same bits. Needs hd in {64,
// 128, 256} (R a multiple of 4).
//
// Split over the context (nseg > 1: gridDim.z segments of the keys, for calls of few query rows over a long
// context, which would leave most multiprocessors idle): each block takes the keys of its segment and writes its
// rows' unnormalised outputs and (running maximum, sum) to `part`; attn_merge joins the segments as llama.cpp
// merges split-decode partials. A row may see no key of a segment: its maximum stays -inf, its sum and outputs 0.

#define ATT_RPT 16  // ATT_BQ query rows / 16 threads a row

// HD: the head dimension, fixed per instantiation so that the tile sizes are constants (a 63-register class card
// keeps the 16 accumulators and the indices without spilling); the key tile is attn_prefill_body's for that head
template <bool TYPED, int HD>
__device__ __forceinline__ void attn_prefill_tiled_body(const float* __restrict__ q, const void* __restrict__ kc,
                                                        const void* __restrict__ vc, const float* __restrict__ gate,
                                                        float* __restrict__ out, int T, int H, int H_kv, int pos0,
                                                        float scale, int k_type, int v_type, int nseg,
                                                        float* __restrict__ part) {
    const int hd = HD, bk = HD == 256 ? 16 : 32;
    extern __shared__ float4 sm4[];
    float* sm = (float*)sm4;
    const int ld = hd + 4;
    float* Qs = sm;                  // ATT_BQ x ld
    float* KV = Qs + ATT_BQ * ld;    // bk x ld
    const int ls = bk + 1;           // a score row's stride: two rows of a warp on different banks
    float* S = KV + bk * ld;         // ATT_BQ x ls scores, row-major
    float* Pt = S + ATT_BQ * ls;     // bk x ATT_BQ probabilities, key-major
    float* crow = Pt + bk * ATT_BQ;  // ATT_BQ rescale factors of the tile
    float* lrow = crow + ATT_BQ;     // ATT_BQ final sums

    const int tid = threadIdx.x;
    const int qt = gridDim.x - 1 - blockIdx.x;  // the longest (last) query tiles start first
    const int h = blockIdx.y;
    const int kvh = h / (H / H_kv);
    const int t0 = qt * ATT_BQ;
    const int nq = min(ATT_BQ, T - t0);
    const int kpt = bk >> 4;  // keys a thread scores
    // scores and softmax: row si, keys sj + 16 u
    const int si = tid >> 4, sj = tid & 15;
    const int last = pos0 + t0 + min(si, nq - 1);  // the last key row si sees (padding rows: as nq - 1)
    // output: dimension od of rows orow .. orow + R - 1
    const int R = ATT_BQ * HD / ATT_THREADS;
    const int od = tid % hd, orow = (tid / hd) * R;

    att_load_q(Qs, q, ld, t0, nq, h, H, hd, scale);
    float m = -INFINITY, l = 0.0f;
    float acc[ATT_RPT];
#pragma unroll
    for (int r = 0; r < ATT_RPT; ++r) acc[r] = 0.0f;

    int kbeg = 0, nkeys = pos0 + t0 + nq;
    if (nseg > 1) {  // segments of the whole call's keys, whole key tiles each
        const int seg = ((pos0 + T + nseg - 1) / nseg + bk - 1) / bk * bk;
        kbeg = blockIdx.z * seg;
        nkeys = min(nkeys, kbeg + seg);
    }
    for (int k0 = kbeg; k0 < nkeys; k0 += bk) {
        const int nk = min(bk, nkeys - k0);
        __syncthreads();  // the last tile's readers of KV and Pt are done
        att_load_kv<TYPED>(KV, kc, k_type, ld, k0, nk, bk, H_kv, kvh, hd);
        __syncthreads();
#pragma unroll
        for (int u = 0; u < kpt; ++u) {  // one key at a time: fewer registers live beside the accumulators
            const int j = sj + 16 * u;
            const float4* a = (const float4*)(Qs + si * ld);
            const float4* b = (const float4*)(KV + j * ld);
            float dot = 0.0f;
#pragma unroll 1
            for (int d4 = 0; d4 < (hd >> 2); ++d4) {
                const float4 x = a[d4], y = b[d4];
                dot = fmaf(x.w, y.w, fmaf(x.z, y.z, fmaf(x.y, y.y, fmaf(x.x, y.x, dot))));
            }
            S[si * ls + j] = j < nk && k0 + j <= last ? dot : -INFINITY;
        }
        __syncthreads();
        float mx = m;
        for (int j = 0; j < nk; ++j) mx = fmaxf(mx, S[si * ls + j]);
        const float c = mx == -INFINITY ? 1.0f : expf(m - mx);  // 0 on the first seen key's tile (m = -inf)
        m = mx;
#pragma unroll
        for (int u = 0; u < kpt; ++u) {
            const int j = sj + 16 * u;
            const float sv = S[si * ls + j];
            Pt[j * ATT_BQ + si] = j < nk && sv != -INFINITY ? expf(sv - mx) : 0.0f;
        }
        if (sj == 0) crow[si] = c;
        att_load_kv<TYPED>(KV, vc, v_type, ld, k0, nk, bk, H_kv, kvh, hd);  // V over K: every score is taken
        __syncthreads();
        if (sj == 0) {
            float sum = 0.0f;
            for (int j = 0; j < bk; ++j) sum += Pt[j * ATT_BQ + si];
            l = fmaf(l, c, sum);
        }
#pragma unroll
        for (int r = 0; r < ATT_RPT; ++r)
            if (r < R) acc[r] *= crow[orow + r];
#pragma unroll 1
        for (int j = 0; j < nk; ++j) {
            const float v = KV[j * ld + od];
            const float4* pr = (const float4*)(Pt + j * ATT_BQ + orow);
#pragma unroll
            for (int r4 = 0; r4 < ATT_RPT / 4; ++r4)
                if (4 * r4 < R) {
                    const float4 p = pr[r4];
                    acc[4 * r4] = fmaf(p.x, v, acc[4 * r4]);
                    acc[4 * r4 + 1] = fmaf(p.y, v, acc[4 * r4 + 1]);
                    acc[4 * r4 + 2] = fmaf(p.z, v, acc[4 * r4 + 2]);
                    acc[4 * r4 + 3] = fmaf(p.w, v, acc[4 * r4 + 3]);
                }
        }
    }
    if (nseg > 1) {  // this segment's partial rows: outputs unnormalised, then (m, l) per row
        const size_t base = (size_t)blockIdx.z * T;
        for (int r = 0; r < ATT_RPT; ++r) {
            const int i = orow + r;
            if (r < R && i < nq) part[((base + t0 + i) * H + h) * hd + od] = acc[r];
        }
        if (sj == 0 && si < nq) {
            float* ml = part + (size_t)nseg * T * H * hd + ((base + t0 + si) * H + h) * 2;
            ml[0] = m;
            ml[1] = l;
        }
        return;
    }
    __syncthreads();
    if (sj == 0) lrow[si] = l;
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ATT_RPT; ++r) {
        const int i = orow + r;
        if (r < R && i < nq) {
            float o = acc[r] / lrow[i];
            const size_t t = (size_t)(t0 + i);
            if (gate) o *= pf_sigmoid(gate[(t * H + h) * hd + od]);
            out[(t * H + h) * hd + od] = o;
        }
    }
}

// one kernel per head size: the three bodies in one kernel would share one register allocation, which spills at 63
#define ATT_TILED(HDV)                                                                                             \
    extern "C" __global__ void attn_prefill_tiled##HDV(const float* __restrict__ q, const float* __restrict__ kc, \
                                                       const float* __restrict__ vc,                             \
                                                       const float* __restrict__ gate, float* __restrict__ out,  \
                                                       int T, int H, int H_kv, int pos0, float scale, int nseg,  \
                                                       float* __restrict__ part) {                               \
        attn_prefill_tiled_body<false, HDV>(q, kc, vc, gate, out, T, H, H_kv, pos0, scale, HI_F32, HI_F32, nseg, \
                                            part);                                                               \
    }                                                                                                            \
    extern "C" __global__ void attn_prefill_tiled##HDV##_kv(                                                     \
        const float* __restrict__ q, const void* __restrict__ kc, const void* __restrict__ vc,                    \
        const float* __restrict__ gate, float* __restrict__ out, int T, int H, int H_kv, int pos0, float scale,   \
        int k_type, int v_type, int nseg, float* __restrict__ part) {                                            \
        attn_prefill_tiled_body<true, HDV>(q, kc, vc, gate, out, T, H, H_kv, pos0, scale, k_type, v_type, nseg,  \
                                           part);                                                                \
    }
ATT_TILED(64)
ATT_TILED(128)
ATT_TILED(256)

// the nseg partials of attn_prefill_tiled* joined, one thread per output value (n = T * H * hd): with M the largest
// segment maximum, out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), segments in order, times sigmoid(gate)
extern "C" __global__ void attn_merge(const float* __restrict__ part, const float* __restrict__ gate,
                                      float* __restrict__ out, int n, int hd, int nseg) {
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < n; p += gridDim.x * blockDim.x) {
        const float* ml = part + (size_t)nseg * n + (size_t)(p / hd) * 2;
        float M = -INFINITY;
        for (int s = 0; s < nseg; ++s) M = fmaxf(M, ml[(size_t)s * (n / hd) * 2]);
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < nseg; ++s) {
            const float ms = ml[(size_t)s * (n / hd) * 2];
            if (ms == -INFINITY) continue;
            const float w = expf(ms - M);
            num = fmaf(part[(size_t)s * n + p], w, num);
            den = fmaf(ml[(size_t)s * (n / hd) * 2 + 1], w, den);
        }
        float o = num / den;
        if (gate) o *= pf_sigmoid(gate[p]);
        out[p] = o;
    }
}

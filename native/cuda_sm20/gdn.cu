// Gated DeltaNet layer over a prompt chunk of T tokens (docs/gguf-qwen35.md §3; backends/reference.py RefOps.gdn),
// fp32, sm_20 subset. The projections (u = W_qkv x, z, b, a) and ssm_out are GEMMs done elsewhere.
//
// Maths, per chunk, with the carried state (conv (K-1, C), S (H_v, d_k, d_v)):
//   win = [conv; u] (oldest first);  c[t,ch] = SiLU(sum_tau w[ch,tau] win[t+tau,ch]);  conv <- win[T:]
//   q_i = c[:, i d_k ...], k_i = c[:, H_k d_k + i d_k ...], v_j = c[:, 2 H_k d_k + j d_v ...]
//   q^ = q / sqrt(sum q^2 + eps) / sqrt(d_k),   k^ = k / sqrt(sum k^2 + eps)
//   value head j reads key head kappa(j) = j mod H_k (qwen35 GGUF, "mod") or j / (H_v/H_k) ("div")
//   g = ssm_a[j] softplus(a + dt_bias[j])   (ssm_a is already -exp(A_log): no further exp or sign)
//   beta = sigma(b)
//   per token: S <- e^g S;  delta = beta (v - S^T k^);  S <- S + k^ delta^T;  o = S^T q^
//   y_j = o_j / sqrt(mean(o_j^2) + eps) * w_norm * SiLU(z_j)
// Snapshots: for each requested position p (ascending, 0 <= p <= T, counted in tokens of this chunk)
// the conv state and S after the first p tokens are also written to [n_snap, ...] buffers in the
// same pass.
//
// Kernels, in launch order: gdn_conv_silu, gdn_conv_state, gdn_l2norm_qk, gdn_delta_rule,
// gdn_gated_norm (hybridinfer/backends/gpu/k_gdn.py runs them).
#include "prefill_common.cuh"

#define GDN_MAXK 8     // conv kernel width K <= GDN_MAXK
#define GDN_TC 16      // tokens staged in shared memory per step of gdn_delta_rule
// S rows per thread in gdn_delta_rule: ceil(d_k / blockDim.y) <= GDN_MAXR (8 where a thread has 63 registers:
// its rows of S and of k stay in registers; k_gdn.delta_rule_shape gives the block the row groups to match)
#ifndef GDN_MAXR
#ifdef HI_REG63
#define GDN_MAXR 8
#else
#define GDN_MAXR 16
#endif
#endif
// block size bound of gdn_delta_rule: 256 threads let ptxas give each 255 registers (at 512 it caps them at 128
// and spills S); the 63-register class has no bounds (HI_BOUNDS) and takes 512
#ifndef GDN_MAX_THREADS
#ifdef HI_REG63
#define GDN_MAX_THREADS 512
#else
#define GDN_MAX_THREADS 256
#endif
#endif

// c[t, ch] = SiLU(sum_tau w[ch, tau] * win[t + tau, ch]) with win = [conv_state; u].
// u, c [T, C]; conv_state [K-1, C]; w [C, K]. One thread per channel and a run of tchunk tokens:
// grid (ceil(C / blockDim.x), ceil(T / tchunk)). The K-tap window slides in registers (K is a
// template argument of the device function so that the window is not spilled to local memory).
template <int K>
__device__ __forceinline__ void gdn_conv_run(const float* __restrict__ u, const float* __restrict__ conv_state,
                                             const float* __restrict__ w, float* __restrict__ c, int ch, int t0,
                                             int t1, int C) {
    float wr[K], win[K];
#pragma unroll
    for (int tau = 0; tau < K; ++tau) wr[tau] = w[(size_t)ch * K + tau];
#pragma unroll
    for (int tau = 0; tau < K - 1; ++tau) {  // window rows t0 .. t0+K-2 of win
        const int i = t0 + tau;
        win[tau] = i < K - 1 ? conv_state[(size_t)i * C + ch] : u[(size_t)(i - (K - 1)) * C + ch];
    }
    for (int t = t0; t < t1; ++t) {
        win[K - 1] = u[(size_t)t * C + ch];
        float acc = 0.0f;
#pragma unroll
        for (int tau = 0; tau < K; ++tau) acc = fmaf(wr[tau], win[tau], acc);
        c[(size_t)t * C + ch] = pf_silu(acc);
#pragma unroll
        for (int tau = 0; tau < K - 1; ++tau) win[tau] = win[tau + 1];
    }
}

extern "C" __global__ void gdn_conv_silu(const float* __restrict__ u, const float* __restrict__ conv_state,
                                         const float* __restrict__ w, float* __restrict__ c, int T, int C, int K,
                                         int tchunk) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    const int t0 = blockIdx.y * tchunk;
    const int t1 = min(T, t0 + tchunk);
    switch (K) {
        case 1: gdn_conv_run<1>(u, conv_state, w, c, ch, t0, t1, C); break;
        case 2: gdn_conv_run<2>(u, conv_state, w, c, ch, t0, t1, C); break;
        case 3: gdn_conv_run<3>(u, conv_state, w, c, ch, t0, t1, C); break;
        case 4: gdn_conv_run<4>(u, conv_state, w, c, ch, t0, t1, C); break;
        case 5: gdn_conv_run<5>(u, conv_state, w, c, ch, t0, t1, C); break;
        case 6: gdn_conv_run<6>(u, conv_state, w, c, ch, t0, t1, C); break;
        case 7: gdn_conv_run<7>(u, conv_state, w, c, ch, t0, t1, C); break;
        default: gdn_conv_run<GDN_MAXK>(u, conv_state, w, c, ch, t0, t1, C); break;
    }
}

// After gdn_conv_silu: snapshots and the new conv state. snap_conv[s, r, ch] = win[p_s + r, ch] and
// conv_state[r, ch] <- win[T + r, ch] for r < K-1 (win = [old conv_state; u]). One thread per
// channel reads and writes only its own column, rows in increasing order, so the in-place update
// is safe (row T + r > r is read before it is overwritten). snap_pos [n_snap] int32 ascending in
// [0, T]; snap_conv [n_snap, K-1, C] (may be NULL when n_snap == 0).
extern "C" __global__ void gdn_conv_state(const float* __restrict__ u, float* __restrict__ conv_state,
                                          const int* __restrict__ snap_pos, int n_snap,
                                          float* __restrict__ snap_conv, int T, int C, int K) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    const int km1 = K - 1;
    for (int s = 0; s < n_snap; ++s) {
        const int p = snap_pos[s];
        if (p < 0 || p > T) continue;
        for (int r = 0; r < km1; ++r) {
            const int i = p + r;
            snap_conv[((size_t)s * km1 + r) * C + ch] =
                i < km1 ? conv_state[(size_t)i * C + ch] : u[(size_t)(i - km1) * C + ch];
        }
    }
    for (int r = 0; r < km1; ++r) {
        const int i = T + r;
        conv_state[(size_t)r * C + ch] = i < km1 ? conv_state[(size_t)i * C + ch] : u[(size_t)(i - km1) * C + ch];
    }
}

// L2-normalise the 2*H_k q and k heads of c [T, C] in place (the first 2*H_k*d_k channels):
// x <- x / sqrt(sum x^2 + eps), and q additionally times q_scale (= 1/sqrt(d_k)).
// grid (2*H_k, min(T, 65535)) looping over tokens; blockDim.x a power of two.
extern "C" __global__ void gdn_l2norm_qk(float* __restrict__ c, int T, int C, int H_k, int d_k, float eps,
                                         float q_scale) {
    __shared__ float red[1024];
    const int hh = blockIdx.x;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        float* x = c + (size_t)t * C + (size_t)hh * d_k;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < d_k; i += blockDim.x) ss = fmaf(x[i], x[i], ss);
        ss = pf_block_sum(ss, red);
        float inv = 1.0f / sqrtf(ss + eps);
        if (hh < H_k) inv *= q_scale;
        for (int i = threadIdx.x; i < d_k; i += blockDim.x) x[i] *= inv;
    }
}

// The delta-rule recurrence over the chunk. One block per (slice of VB = blockDim.x value columns,
// value head j): grid (ceil(d_v / VB), H_v), block (VB, NG). Thread (x, y) keeps rows
// i = y GDN_MAXR + r (r < GDN_MAXR) of column blockIdx.x*VB + x of S_j in registers; sums over d_k go
// through shared memory (partials of the NG row groups, column-major at pitch NG + 1: a thread's NG
// partials are consecutive, one base address plus constants, and a warp's writes hit distinct banks),
// two __syncthreads per token. Tokens are staged GDN_TC at a time (a chunk ends early at a snapshot position);
// row group 0 leaves each token's outputs in place of its v values and writes them to o after the chunk.
// c [T, C]: q, k normalised by gdn_l2norm_qk, v raw (post-SiLU); a, b [T, H_v] (alpha and beta
// projections); ssm_a, dt_bias [H_v]; S [H_v, d_k, d_v] read and written back; o [T, H_v, d_v].
// snap_S [n_snap, H_v, d_k, d_v]: S after snap_pos[s] tokens (snap_pos ascending, 0 <= p <= T).
// Dynamic shared memory: (2 GDN_TC DKP + GDN_TC VB + 2 GDN_TC + 2 (NG + 1) VB) floats, DKP = NG GDN_MAXR
// (gdn_smem's layout).
// sum over g < NG of p[x (NG + 1) + g]; pairwise for NG = 8 (d_k = 128), a shorter dependent chain
__device__ __forceinline__ float pf_group_sum(const float* p, int NG, int x) {
    const float* q = p + x * (NG + 1);
    if (NG == 8) {
        const float a0 = q[0] + q[1], a1 = q[2] + q[3], a2 = q[4] + q[5], a3 = q[6] + q[7];
        return (a0 + a1) + (a2 + a3);
    }
    float acc = 0.0f;
    for (int g = 0; g < NG; ++g) acc += q[g];
    return acc;
}

// This thread's rows of S, rows i = y GDN_MAXR + r (y = threadIdx.y) of column col (the block's columns from
// blockIdx.x blockDim.x) of the [d_k, d_v] matrix of value head j = blockIdx.y in M ([n, H_v, d_k, d_v]), slot n,
// loaded or stored. The indices are opaque copies (hi_opaque), so the addresses and bounds tests are computed at
// each call instead of being shared between the load at the start and the stores at the end and held, eight
// 64-bit addresses and eight predicates, through the whole kernel.
struct GdnRows {
    size_t off;  // of row y GDN_MAXR, column col
    int y, col, dk, dv;
};

__device__ __forceinline__ GdnRows gdn_rows(int slot, int H_v, int d_k, int d_v) {
    GdnRows w;
    w.dk = hi_opaque(d_k);
    w.dv = hi_opaque(d_v);
    w.y = hi_opaque(threadIdx.y);
    w.col = hi_opaque(blockIdx.x) * hi_opaque(blockDim.x) + hi_opaque(threadIdx.x);
    w.off = (((size_t)slot * hi_opaque(H_v) + hi_opaque(blockIdx.y)) * w.dk + w.y * GDN_MAXR) * w.dv + w.col;
    return w;
}

__device__ __forceinline__ void gdn_rows_load(const float* M, float s[GDN_MAXR], const GdnRows& w) {
    const float* src = M + w.off;
#pragma unroll
    for (int r = 0; r < GDN_MAXR; ++r) {
        s[r] = (w.y * GDN_MAXR + r < w.dk && w.col < w.dv) ? *src : 0.0f;
        src += w.dv;
    }
}

__device__ __forceinline__ void gdn_rows_store(float* M, const float s[GDN_MAXR], const GdnRows& w) {
    float* dst = M + w.off;
#pragma unroll
    for (int r = 0; r < GDN_MAXR; ++r) {
        if (w.y * GDN_MAXR + r < w.dk && w.col < w.dv) *dst = s[r];
        dst += w.dv;
    }
}

// every snapshot slot that asks for position `pos` (the state after `pos` tokens; they come in order) gets
// this thread's rows of S
__device__ __forceinline__ void gdn_snapshots(int pos, int& ns, int& next, const int* __restrict__ snap_pos,
                                              int n_snap, float* __restrict__ snap_S, const float s[GDN_MAXR],
                                              int d_k, int d_v, int H_v) {
    while (next == pos) {
        gdn_rows_store(snap_S, s, gdn_rows(ns, H_v, d_k, d_v));
        ++ns;
        next = ns < n_snap ? snap_pos[ns] : -1;
    }
}

// The delta rule's dynamic shared memory, in floats: the decay e^g and beta of GDN_TC tokens at fixed offsets, then
// the partials of k.S and q.S (VB x (NG + 1) each), v and then the outputs (GDN_TC x VB), and q and k (GDN_TC x DKP
// each). k_gdn.delta_rule_smem gives its size.
struct GdnSmem {
    float *gs, *bs, *pa, *pb, *vs, *qs, *ks;
};

// Callers pass opaque copies of NG and VB (hi_opaque) so that the pointers are recomputed where they are used, a
// few integer operations, instead of eight registers held through the token loop
__device__ __forceinline__ GdnSmem gdn_smem(float* sm, int NG, int VB) {
    GdnSmem m;
    m.gs = sm;
    m.bs = sm + GDN_TC;
    m.pa = sm + 2 * GDN_TC;
    m.pb = m.pa + (NG + 1) * VB;
    m.vs = m.pb + (NG + 1) * VB;
    m.qs = m.vs + GDN_TC * VB;
    m.ks = m.qs + GDN_TC * NG * GDN_MAXR;
    return m;
}

// stage a chunk of nt tokens from t0: q and k rows of key head kh padded with zeros to DKP = NG GDN_MAXR, the
// block's VB value columns of head j, the decay e^g and beta of each token
__device__ __forceinline__ void gdn_stage(const GdnSmem& m, const float* __restrict__ c, const float* __restrict__ a,
                                          const float* __restrict__ b, const float* __restrict__ ssm_a,
                                          const float* __restrict__ dt_bias, int t0, int nt, int tid, int nth, int NG,
                                          int VB, int C, int kh, int H_k, int H_v, int j, int d_k, int d_v) {
    const int DKP = NG * GDN_MAXR;
    const size_t qoff = (size_t)kh * d_k, koff = (size_t)(H_k + kh) * d_k;
    const int c0 = blockIdx.x * VB;
    const size_t voff = (size_t)2 * H_k * d_k + (size_t)j * d_v + c0;
    for (int p = tid; p < nt * DKP; p += nth) {
        const int tt = p / DKP, i = p - (p / DKP) * DKP;
        const float* row = c + (size_t)(t0 + tt) * C;
        m.qs[p] = i < d_k ? row[qoff + i] : 0.0f;
        m.ks[p] = i < d_k ? row[koff + i] : 0.0f;
    }
    for (int p = tid; p < nt * VB; p += nth) {
        const int tt = p / VB, xx = p - (p / VB) * VB;
        m.vs[p] = c0 + xx < d_v ? c[(size_t)(t0 + tt) * C + voff + xx] : 0.0f;
    }
    if (tid < nt) {
        const size_t ti = (size_t)(t0 + tid) * H_v + j;
        m.gs[tid] = expf(ssm_a[j] * pf_softplus(a[ti] + dt_bias[j]));
        m.bs[tid] = pf_sigmoid(b[ti]);
    }
}

// One token of the recurrence on this thread's rows of S (s), column x, row group y; two barriers. Row group 0
// leaves the column's output where the token's v was: every thread has read that v before the second barrier, and
// the next chunk's staging comes after the thread has written the output to o, so the outputs take no shared memory
// of their own (a 2 KiB buffer would halve a GK104's resident blocks at d_k = d_v = 128).
__device__ __forceinline__ void gdn_token(const GdnSmem& m, float s[GDN_MAXR], int tt, int x, int y, int NG,
                                          int VB) {
    const float dec = m.gs[tt], beta = m.bs[tt];
    const int DKP = NG * GDN_MAXR;
    const float* kt = m.ks + tt * DKP + y * GDN_MAXR;
    const float* qt = m.qs + tt * DKP + y * GDN_MAXR;
    // this thread's rows of k, used twice; two partial sums halve the dependent FMA chains
    float kr[GDN_MAXR];
    float p0 = 0.0f, p1 = 0.0f;
#pragma unroll
    for (int r = 0; r < GDN_MAXR; ++r) {
        kr[r] = kt[r];
        s[r] *= dec;
        if (r & 1) p1 = fmaf(kr[r], s[r], p1);
        else p0 = fmaf(kr[r], s[r], p0);
    }
    m.pa[x * (NG + 1) + y] = p0 + p1;
    __syncthreads();
    const float kv = pf_group_sum(m.pa, NG, x);
    const float delta = beta * (m.vs[tt * VB + x] - kv);
    p0 = p1 = 0.0f;
#pragma unroll
    for (int r = 0; r < GDN_MAXR; ++r) {
        s[r] = fmaf(kr[r], delta, s[r]);
        const float qi = qt[r];
        if (r & 1) p1 = fmaf(qi, s[r], p1);
        else p0 = fmaf(qi, s[r], p0);
    }
    m.pb[x * (NG + 1) + y] = p0 + p1;
    __syncthreads();
    if (y == 0) m.vs[tt * VB + x] = pf_group_sum(m.pb, NG, x);
}

// At most GDN_MAX_THREADS threads per block (d_k <= 256), so the registers fit any card's register file. Through
// the token loop a thread holds its rows of S and the loop counters; everything else (global and shared addresses,
// indices, bounds) is recomputed from opaque copies where it is used, which keeps the 63-register class spill-free.
extern "C" __global__ void HI_BOUNDS(GDN_MAX_THREADS)
    gdn_delta_rule(const float* __restrict__ c, const float* __restrict__ a, const float* __restrict__ b,
                   const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, float* __restrict__ S,
                   float* __restrict__ o, const int* __restrict__ snap_pos, int n_snap, float* __restrict__ snap_S,
                   int T, int C, int H_k, int H_v, int d_k, int d_v, int head_mod) {
    // a thread holds rows y GDN_MAXR .. + GDN_MAXR - 1 of S (consecutive, so its q and k values are one base
    // address plus constants), and q and k are staged with rows padded by zeros to DKP = NG GDN_MAXR >= d_k, so
    // the per-token loops need no bounds tests (a padded row of S starts at 0 and stays 0)
    extern __shared__ float sm[];
    float s[GDN_MAXR];
    gdn_rows_load(S, s, gdn_rows(0, H_v, d_k, d_v));

    int ns = 0;
    int next = n_snap > 0 ? snap_pos[0] : -1;
    gdn_snapshots(0, ns, next, snap_pos, n_snap, snap_S, s, d_k, d_v, H_v);  // incoming state

    for (int t0 = 0, nt; t0 < T; t0 += nt) {
        // a chunk ends where a snapshot is asked for, so snapshots are taken between chunks and their code and
        // addresses stay out of the token loop
        nt = min(GDN_TC, T - t0);
        if (next > t0 && next - t0 < nt) nt = next - t0;
        __syncthreads();
        {
            const int VB = hi_opaque(blockDim.x), NG = hi_opaque(blockDim.y), jo = hi_opaque(blockIdx.y);
            const int tid = hi_opaque(threadIdx.y) * VB + hi_opaque(threadIdx.x);
            const int Hk = hi_opaque(H_k), Hv = hi_opaque(H_v);
            const int kh = hi_opaque(head_mod) ? jo % Hk : jo / (Hv / Hk);
            gdn_stage(gdn_smem(sm, NG, VB), c, a, b, ssm_a, dt_bias, t0, nt, tid, VB * NG, NG, VB, hi_opaque(C), kh,
                      Hk, Hv, jo, hi_opaque(d_k), hi_opaque(d_v));
        }
        __syncthreads();
        for (int tt = 0; tt < nt; ++tt) {
            const int NG = hi_opaque(blockDim.y), VB = hi_opaque(blockDim.x);
            gdn_token(gdn_smem(sm, NG, VB), s, tt, hi_opaque(threadIdx.x), hi_opaque(threadIdx.y), NG, VB);
        }
        // the thread that summed each output writes it (no barrier: it reads only its own values back)
        if (threadIdx.y == 0) {
            const int dv = hi_opaque(d_v), hv = hi_opaque(H_v), VB = hi_opaque(blockDim.x), x = hi_opaque(threadIdx.x);
            const int cl = hi_opaque(blockIdx.x) * VB + x;
            if (cl < dv) {
                const float* src = gdn_smem(sm, hi_opaque(blockDim.y), VB).vs + x;
                float* dst = o + ((size_t)t0 * hv + hi_opaque(blockIdx.y)) * dv + cl;
                for (int tt = 0; tt < nt; ++tt) {
                    *dst = src[tt * VB];
                    dst += (size_t)hv * dv;
                }
            }
        }
        gdn_snapshots(t0 + nt, ns, next, snap_pos, n_snap, snap_S, s, d_k, d_v, H_v);
    }
    gdn_rows_store(S, s, gdn_rows(0, H_v, d_k, d_v));
}

// Gated RMSNorm per (token, value head): y = o / sqrt(mean(o^2) + eps) * w * SiLU(z).
// o, y [T, H_v, d_v] (y may alias o); z [T, H_v * d_v]; w [d_v].
// grid (H_v, min(T, 65535)) looping over tokens; blockDim.x a power of two.
extern "C" __global__ void gdn_gated_norm(const float* o, const float* __restrict__ z, const float* __restrict__ w,
                                          float* y, int T, int H_v, int d_v, float eps) {
    __shared__ float red[1024];
    const int j = blockIdx.x;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        const size_t row = ((size_t)t * H_v + j) * d_v;
        float ss = 0.0f;
        for (int d = threadIdx.x; d < d_v; d += blockDim.x) ss = fmaf(o[row + d], o[row + d], ss);
        ss = pf_block_sum(ss, red);
        const float inv = 1.0f / sqrtf(ss / (float)d_v + eps);
        for (int d = threadIdx.x; d < d_v; d += blockDim.x) y[row + d] = o[row + d] * inv * w[d] * pf_silu(z[row + d]);
    }
}

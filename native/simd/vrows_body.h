/* The vision tower's row ops (vrows.c), one copy per target: vrows.c includes this file once for the baseline and
 * once each under `#pragma GCC target("avx2")` and ("avx2,avx512f"), with VR(name) naming the copy. Plain float C
 * written op for op as the numba kernels of hybridinfer/backends/cpu/vision_kernels.py: the library is compiled with
 * -ffp-contract=off and no fast-math, so the compiler vectorizes the element loops without reordering or fusing an
 * operation and every copy gives those kernels' bits. */

/* vision_kernels.exp32, Cephes' expf: clamped to [-87, 88], n = floor(x log2 e + 1/2) (below SSE4.1 a
 * truncation corrected down, exact for |t| < 2^31, which vectorizes without roundps), r = x - n ln 2 in two steps,
 * the degree-6 polynomial, 2^n built in the exponent bits */
static inline float VR(exp32)(float x, float lo, float hi) {
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const float t = x * 1.44269504088896341f + 0.5f;
#ifdef __SSE4_1__
    const float n = floorf(t); /* roundps: gcc would make the truncation below a scalar roundss */
    const int32_t m = (int32_t)n;
#else
    int32_t m = (int32_t)t;
    m -= (float)m > t;
    const float n = (float)m;
#endif
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    const float p = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                      1.6666665459e-1f) * r + 5.0000001201e-1f) * (r * r) + r + 1.0f;
    const uint32_t bits = (uint32_t)(m + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return p * s;
}

/* a row's statistics are two sums in order (each add waits on the one before): VR_LN_ROWS rows at a time make as
 * many independent chains for the core to overlap, each row's sums still in the order of the numba kernel (it has no
 * reassociation either) */
#ifndef VR_LN_ROWS
#define VR_LN_ROWS 8
#endif

static void VR(layer_norm_rows)(const void *arg, int64_t r0, int64_t r1) {
    const vr_ln_job *j = (const vr_ln_job *)arg;
    const int64_t c = j->n;
    const float *restrict w = j->w, *restrict b = j->b;
    for (int64_t r = r0; r < r1;) {
        const int64_t m = r1 - r >= VR_LN_ROWS ? VR_LN_ROWS : 1;
        const float *p[VR_LN_ROWS];
        double s[VR_LN_ROWS], v[VR_LN_ROWS], mu[VR_LN_ROWS];
        for (int64_t k = 0; k < m; k++) p[k] = j->x + (r + k) * j->x_row, s[k] = 0.0, v[k] = 0.0;
        if (m == VR_LN_ROWS) {
            for (int64_t i = 0; i < c; i++)
                for (int k = 0; k < VR_LN_ROWS; k++) s[k] += p[k][i];
            for (int k = 0; k < VR_LN_ROWS; k++) mu[k] = s[k] / (double)c;
            for (int64_t i = 0; i < c; i++)
                for (int k = 0; k < VR_LN_ROWS; k++) {
                    const double d = p[k][i] - mu[k];
                    v[k] += d * d;
                }
        } else {
            for (int64_t i = 0; i < c; i++) s[0] += p[0][i];
            mu[0] = s[0] / (double)c;
            for (int64_t i = 0; i < c; i++) {
                const double d = p[0][i] - mu[0];
                v[0] += d * d;
            }
        }
        for (int64_t k = 0; k < m; k++) {
            const float *restrict row = p[k];
            float *restrict o = j->out + (r + k) * j->out_row;
            const double mk = mu[k], sd = sqrt(v[k] / (double)c + j->eps);
            for (int64_t i = 0; i < c; i++) o[i] = (float)((row[i] - mk) / sd) * w[i] + b[i];
        }
        r += m;
    }
}

/* out may be x (the same rows), so no restrict on them */
static void VR(gelu_tanh_rows)(const void *arg, int64_t r0, int64_t r1) {
    const vr_gelu_job *j = (const vr_gelu_job *)arg;
    const float *restrict bias = j->bias;
    /* the clamp's bounds hidden from the optimizer: with them known, gcc computes the GELU at each bound apart
     * (v / (1 + exp32(bound)), a second division a vector) and blends the three */
    float lo = -87.0f, hi = 88.0f;
    __asm__("" : "+x"(lo), "+x"(hi));
    for (int64_t r = r0; r < r1; r++) {
        const float *row = j->x + r * j->x_row;
        float *o = j->out + r * j->out_row;
        if (bias)
            for (int64_t i = 0; i < j->n; i++) {
                const float v = row[i] + bias[i];
                const float u = (0.044715f * v * v * v + v) * VR_GELU_C;
                o[i] = v / (1.0f + VR(exp32)(-2.0f * u, lo, hi));
            }
        else
            for (int64_t i = 0; i < j->n; i++) {
                const float v = row[i];
                const float u = (0.044715f * v * v * v + v) * VR_GELU_C;
                o[i] = v / (1.0f + VR(exp32)(-2.0f * u, lo, hi));
            }
    }
}

static void VR(gelu_erf_rows)(const void *arg, int64_t r0, int64_t r1) {
    const vr_gelu_job *j = (const vr_gelu_job *)arg;
    for (int64_t r = r0; r < r1; r++) {
        const float *row = j->x + r * j->x_row;
        float *o = j->out + r * j->out_row;
        for (int64_t i = 0; i < j->n; i++) {
            const double xd = (double)(j->bias ? row[i] + j->bias[i] : row[i]);
            o[i] = (float)(0.5 * xd * (1.0 + erf(xd * 0.7071067811865476)));
        }
    }
}

/* tokens [r0, r1): q and k rotated, x cos + rotate_half(x) sin (NeoX halves, the model's `rotate` op for op), q and
 * v to [heads, rows, hd], k to [heads, hd, rows] (k_t) or [heads, rows, hd]. A head at a time over the chunk's
 * tokens, VR_KT of them at a time, so that kᵀ is written through a small tile a cache line (VR_KT floats) per row
 * of the head rather than a float in each of hd lines per token. */
#ifndef VR_KT
#define VR_KT 16
#define VR_KT_MAX_HD 256 /* the tile's bound (a head of the towers here: 64 to 80) */
#endif

static inline void VR(rotate_half)(const float *restrict a, const float *restrict c, const float *restrict s,
                                   int64_t half, int64_t hd, float *restrict o) {
    for (int64_t d = 0; d < half; d++) o[d] = a[d] * c[d] + -a[d + half] * s[d];
    for (int64_t d = half; d < hd; d++) o[d] = a[d] * c[d] + a[d - half] * s[d];
}

static void VR(rope_heads_rows)(const void *arg, int64_t r0, int64_t r1) {
    const vr_rope_job *j = (const vr_rope_job *)arg;
    const int64_t H = j->heads, hd = j->hd, half = hd / 2, n = j->rows;
    const int tile = j->k_t && hd <= VR_KT_MAX_HD;
    float kb[VR_KT * VR_KT_MAX_HD];
    for (int64_t h = 0; h < H; h++)
        for (int64_t i0 = r0; i0 < r1; i0 += VR_KT) {
            const int64_t m = r1 - i0 < VR_KT ? r1 - i0 : VR_KT;
            for (int64_t t = 0; t < m; t++) {
                const int64_t i = i0 + t;
                const float *c = j->cos + i * hd, *s = j->sin + i * hd, *q = j->qkv + (i * 3 * H + h) * hd;
                VR(rotate_half)(q, c, s, half, hd, j->qh + (h * n + i) * hd);
                const float *k = q + H * hd;
                if (tile) VR(rotate_half)(k, c, s, half, hd, kb + t * hd);
                else if (!j->k_t) VR(rotate_half)(k, c, s, half, hd, j->k + (h * n + i) * hd);
                else { /* a head wider than the tile: a float in each of hd rows */
                    float *kt = j->k + h * hd * n + i;
                    for (int64_t d = 0; d < half; d++) kt[d * n] = k[d] * c[d] + -k[d + half] * s[d];
                    for (int64_t d = half; d < hd; d++) kt[d * n] = k[d] * c[d] + k[d - half] * s[d];
                }
                memcpy(j->vh + (h * n + i) * hd, k + H * hd, (size_t)hd * sizeof(float));
            }
            if (tile)
                for (int64_t d = 0; d < hd; d++) {
                    float *restrict kt = j->k + (h * hd + d) * n + i0;
                    for (int64_t t = 0; t < m; t++) kt[t] = kb[t * hd + d];
                }
        }
}

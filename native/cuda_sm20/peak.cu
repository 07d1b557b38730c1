// fma_peak: the card's fp32 FMA throughput, the compute floor of prefill GEMMs.
// Each thread runs n rounds of 8 independent chains x_j <- x_j * a + b (one FMA each, 2 flops):
// flops = 2 * 8 * n * (threads in the grid). The sum lands in out[] so the compiler keeps the work.
extern "C" __global__ void fma_peak(float* out, int n, float a, float b) {
    float x0 = threadIdx.x, x1 = x0 + 1, x2 = x0 + 2, x3 = x0 + 3, x4 = x0 + 4, x5 = x0 + 5, x6 = x0 + 6, x7 = x0 + 7;
    for (int i = 0; i < n; ++i) {
        x0 = fmaf(x0, a, b); x1 = fmaf(x1, a, b); x2 = fmaf(x2, a, b); x3 = fmaf(x3, a, b);
        x4 = fmaf(x4, a, b); x5 = fmaf(x5, a, b); x6 = fmaf(x6, a, b); x7 = fmaf(x7, a, b);
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;
}

// pace_hold: holds the stream it runs on so that host-to-device copies queued between holds keep to a slower
// bus's rate (hybridinfer/gpu/pacing.py plans the pieces and their shares of time).
// Maths: t_next (ns on the card's clock) is when the bus of the emulated card would be free again.
//   mode 0 (first piece of a layer): t_next = now + dur         (the layer's upload starts now)
//   mode 1 (each later piece):       wait until now >= t_next; t_next = t_next + dur
//   mode 2 (after the last piece):   wait until now >= t_next  (the layer is ready when the slow bus is done)
// Adding to t_next rather than to now keeps the schedule exact when a hold starts late (its block waited for
// room beside the compute stream's kernels). One thread does the work; the wait sleeps where the card can.
// The card's clock: %globaltimer (ns) from sm_30; sm_2x counts clock64() cycles at clock_khz.
__device__ __forceinline__ unsigned long long pace_now(int clock_khz) {
#if __CUDA_ARCH__ >= 300
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    (void)clock_khz;
    return t;
#else
    return (unsigned long long)clock64() * 1000000ull / (unsigned long long)clock_khz;
#endif
}

extern "C" __global__ void pace_hold(unsigned long long* t_next, unsigned long long dur_ns, int mode,
                                     int clock_khz) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (mode == 0) {
        *t_next = pace_now(clock_khz) + dur_ns;
        return;
    }
    volatile unsigned long long* tn = t_next;
    const unsigned long long until = *tn;
    while (pace_now(clock_khz) < until) {
#if __CUDA_ARCH__ >= 700
        __nanosleep(2000);
#endif
    }
    if (mode == 1) *tn = until + dur_ns;
}

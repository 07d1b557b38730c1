/* Host-side holds that pace a CUDA copy stream to an old card's bus (hybridinfer/backends/gpu/k_pace.py enqueues them with
 * cuLaunchHostFunc between the pieces of a layer's upload; hybridinfer/backends/gpu/pacing.py plans the pieces). A host
 * function holds the stream in order without taking a multiprocessor from the kernels beside it, and in C it runs
 * on the driver's thread without waiting for Python.
 *
 * Maths: clock->t_next (CLOCK_MONOTONIC ns) is when the emulated bus is free again.
 *   HI_PACE_START (first piece of an upload):  start = max(now, t_next); t_next = start + dur; sleep until start
 *   HI_PACE_NEXT  (each later piece):          sleep until t_next; t_next += dur
 *   HI_PACE_END   (after the last piece):      sleep until t_next  (the upload is there when the bus is done)
 * Adding to t_next rather than to now keeps the schedule exact when a hold runs late. START books from t_next
 * because several streams of one card share its clock (the weights' stream and the expert split's partial sums:
 * one bus): an upload that starts while another holds the bus waits for it, and the other's next piece waits for
 * this one's share. The driver may run host functions of different streams on different threads, so t_next
 * moves by atomic operations.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <time.h>

#include "pace.h"

int64_t hi_pace_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void sleep_until(int64_t t) {
    struct timespec ts = {(time_t)(t / 1000000000LL), (long)(t % 1000000000LL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

void hi_pace_hold(void *arg) {
    hi_pace_hold_arg *a = (hi_pace_hold_arg *)arg;
    int64_t *t_next = &a->clock->t_next;
    if (a->mode == HI_PACE_START) {
        int64_t t = __atomic_load_n(t_next, __ATOMIC_ACQUIRE), start;
        do {
            const int64_t now = hi_pace_now_ns();
            start = t > now ? t : now;
        } while (!__atomic_compare_exchange_n(t_next, &t, start + a->dur_ns, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
        if (start > hi_pace_now_ns()) sleep_until(start);
        return;
    }
    const int64_t t = __atomic_load_n(t_next, __ATOMIC_ACQUIRE);
    if (t > hi_pace_now_ns()) sleep_until(t);
    if (a->mode == HI_PACE_NEXT) __atomic_fetch_add(t_next, a->dur_ns, __ATOMIC_ACQ_REL);
}

/* Host-side holds that pace a CUDA copy stream to an old card's bus (hybridinfer/backends/gpu/k_pace.py enqueues them with
 * cuLaunchHostFunc between the pieces of a layer's upload; hybridinfer/backends/gpu/pacing.py plans the pieces). A host
 * function holds the stream in order without taking a multiprocessor from the kernels beside it, and in C it runs
 * on the driver's thread without waiting for Python.
 *
 * Maths: clock->t_next (CLOCK_MONOTONIC ns) is when the emulated bus is free again.
 *   HI_PACE_START (first piece of a layer): t_next = now + dur          (the layer's upload starts now)
 *   HI_PACE_NEXT  (each later piece):       sleep until t_next; t_next += dur
 *   HI_PACE_END   (after the last piece):   sleep until t_next           (the layer is ready when the bus is done)
 * Adding to t_next rather than to now keeps the schedule exact when a hold runs late.
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
    if (a->mode == HI_PACE_START) {
        a->clock->t_next = hi_pace_now_ns() + a->dur_ns;
        return;
    }
    if (a->clock->t_next > hi_pace_now_ns()) sleep_until(a->clock->t_next);
    if (a->mode == HI_PACE_NEXT) a->clock->t_next += a->dur_ns;
}

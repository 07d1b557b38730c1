/* The GPU backend's bus pacing (hybridinfer/backends/gpu/k_pace.py): host functions that hold a CUDA copy stream
 * to a slower bus's rate, run by the driver through cuLaunchHostFunc. The one header cffi and pace.c share. */
#ifndef HI_PACE_H
#define HI_PACE_H

#include <stdint.h>

enum { HI_PACE_START = 0, HI_PACE_NEXT = 1, HI_PACE_END = 2 };
typedef struct {
    int64_t t_next; /* CLOCK_MONOTONIC ns when the emulated bus is free again */
} hi_pace_clock;
typedef struct {
    hi_pace_clock *clock;
    int64_t dur_ns;
    int32_t mode;
} hi_pace_hold_arg;
int64_t hi_pace_now_ns(void);
void hi_pace_hold(void *arg); /* arg: a hi_pace_hold_arg */

#endif

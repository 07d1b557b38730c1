"""The scheduler's worker thread (Scheduler starts it at the first request; Engine.close ends it)."""

from __future__ import annotations

import threading

IDLE_WAIT_S = 1.0  # an idle worker looks this often whether its scheduler is still there


def work(ref, cv: threading.Condition) -> None:
    """Scheduler._once while there is work (`ref`: a weak reference to the scheduler, `cv`: its condition). It
    holds the scheduler only during a turn and waits for work on the condition alone, so an engine its program
    dropped without close() can be collected (its finalizer lets go of the backend) and the thread then ends."""
    while True:
        with cv:
            s = ref()
            if s is None:
                return
            if s.idle() and not s._closed:
                del s
                cv.wait(IDLE_WAIT_S)
                continue
        if not s._once():
            return
        del s

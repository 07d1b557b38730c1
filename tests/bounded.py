"""Test helper: a call that could block for ever (a read of a FIFO with no writer, a request that never finishes)
run in a thread bounded in time, so that a regression fails its test instead of hanging the suite."""

from __future__ import annotations

import os
import threading

import pytest


def bounded(fn, *fifos: str, timeout: float = 60.0) -> dict:
    """fn() in a daemon thread: {"value": its result} or {"error": the exception it raised}. One still running
    after `timeout` fails the test, after each FIFO in `fifos` is opened for writing and closed so that a reader
    blocked on it ends."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(10)
        pytest.fail(f"{fn} still running after {timeout} s")
    return out

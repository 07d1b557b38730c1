"""numpy's OpenBLAS on one thread for a span of work, so that the caller can split its products over its own threads
(backends/cpu/vision.py).

Why: OpenBLAS's idle worker threads spin for 2^28 cycles (0.1 s at 2.4 GHz, OPENBLAS_THREAD_TIMEOUT's default)
after each threaded product, so between products every other kernel runs beside a spinning thread: on a 2-core
machine the vision tower's row kernels and softmax ran at half speed (2026-11-28, 2-core EPYC). Products split by
rows over the tower's own pool (threads that sleep on a lock) run as fast as OpenBLAS's own threads there, and
leave nothing spinning. Where numpy's BLAS is not an OpenBLAS found here, `one_thread` does nothing and says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading

import numpy as np

_NAMES = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
          ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
          ("openblas_get_num_threads", "openblas_set_num_threads"))
_lock = threading.Lock()
_depth = 0
_saved = 1
_funcs: tuple | None | bool = False  # False: not looked up yet


def _find() -> tuple | None:
    """(get, set) of the OpenBLAS that numpy's wheel bundles (dlopen of its path returns the loaded copy)."""
    libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libdir, "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for g, s in _NAMES:
            if hasattr(lib, g) and hasattr(lib, s):
                get, put = getattr(lib, g), getattr(lib, s)
                get.restype, get.argtypes = ctypes.c_int, []
                put.restype, put.argtypes = None, [ctypes.c_int]
                return get, put
    return None


def available() -> bool:
    global _funcs
    with _lock:
        if _funcs is False:
            _funcs = _find()
        return _funcs is not None


@contextlib.contextmanager
def one_thread():
    """Inside: numpy's OpenBLAS runs each product on the calling thread; the count it had is restored when the last
    of nested or concurrent users leaves. Yields whether it could (see `available`)."""
    global _depth, _saved
    if not available():
        yield False
        return
    get, put = _funcs
    with _lock:
        if _depth == 0:
            _saved = get()
            put(1)
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                put(_saved)

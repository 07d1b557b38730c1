"""Launcher of the bus pacing: a Pacer runs pacing.pace_pieces' schedule on a copy stream, so the host-to-device
copies queued through it keep to `bus_bw` bytes/s (an old card's bus emulated on a faster one). The holds are host
functions (native/pace/pace.c, hi_pace_hold, in this package's own compiled module `_pace`) enqueued with the
driver's cuLaunchHostFunc: they hold the stream in order and take no multiprocessor from the kernels beside it (a
hold kernel waits for room on a busy card, which made uploads slower than asked)."""

from __future__ import annotations

import ctypes
from collections import deque
from functools import cache

from ...errors import BackendNotAvailableError
from .pacing import MAX_PIECE, check_bus_bw, pace_pieces

START, NEXT, END = 0, 1, 2  # HI_PACE_* of native/pace/pace.h


@cache
def native():
    """The compiled pacing module (cffi: .ffi, .lib)."""
    try:
        from . import _pace
    except ImportError as e:
        raise BackendNotAvailableError(
            "the bus-pacing helper hybridinfer.backends.gpu._pace is not built: `pip install -e .` (or "
            f"`python native/pace/build.py`) builds it ({e})") from e
    return _pace


@cache
def _launch_host_func():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise BackendNotAvailableError(f"bus pacing needs the CUDA driver library libcuda.so.1 ({e})") from None
    f = cuda.cuLaunchHostFunc
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f


class Pacer:
    def __init__(self, bus_bw: float, max_piece: int = MAX_PIECE):
        mod = native()
        self.ffi, self.lib = mod.ffi, mod.lib
        self.bus_bw, self.max_piece = check_bus_bw(bus_bw), int(max_piece)
        self.clock = self.ffi.new("hi_pace_clock *")
        self.fn = int(self.ffi.cast("uintptr_t", self.ffi.addressof(self.lib, "hi_pace_hold")))
        self.launch = _launch_host_func()
        self.pending: deque = deque()  # (event after an upload's last hold, its hold arguments): alive until run

    def _hold(self, mode: int, dur_ns: int, stream, keep: list) -> None:
        a = self.ffi.new("hi_pace_hold_arg *", {"clock": self.clock, "dur_ns": int(dur_ns), "mode": mode})
        keep.append(a)
        rc = self.launch(ctypes.c_void_p(stream.handle), ctypes.c_void_p(self.fn),
                         ctypes.c_void_p(int(self.ffi.cast("uintptr_t", a))))
        if rc:
            raise BackendNotAvailableError(f"cuLaunchHostFunc failed (CUDA error {rc})")

    def upload(self, copies, stream) -> int:
        """Queue `copies` ((device address, page-locked host uint8 array) pairs, in order) on `stream`, paced.
        Returns the bytes queued."""
        import pycuda.driver as drv

        while self.pending and self.pending[0][0].query():
            self.pending.popleft()
        pieces = pace_pieces([h.nbytes for _, h in copies], self.bus_bw, self.max_piece)
        if not pieces:
            return 0
        keep: list = []
        for j, p in enumerate(pieces):
            self._hold(START if j == 0 else NEXT, p.hold_ns, stream, keep)
            dst, host = copies[p.copy]
            drv.memcpy_htod_async(dst + p.offset, host[p.offset : p.offset + p.nbytes], stream)
        self._hold(END, 0, stream, keep)
        done = drv.Event()
        done.record(stream)
        self.pending.append((done, keep))
        return sum(p.nbytes for p in pieces)

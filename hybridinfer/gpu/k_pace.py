"""Launcher of native/cuda_sm20/pace.cu: a Pacer runs pacing.pace_pieces' schedule on a copy stream, so the
host-to-device copies queued through it keep to `bus_bw` bytes/s (an old card's bus emulated on a faster one)."""

from __future__ import annotations

import numpy as np

from . import loader
from .pacing import MAX_PIECE, check_bus_bw, pace_pieces

FAMILY = "pace"
START, NEXT, END = 0, 1, 2


class Pacer:
    def __init__(self, bus_bw: float, max_piece: int = MAX_PIECE):
        import pycuda.driver as drv
        from pycuda import gpuarray

        loader.init()
        self.drv, self.bus_bw, self.max_piece = drv, check_bus_bw(bus_bw), int(max_piece)
        self.t_next = gpuarray.zeros(1, np.uint64)
        dev = drv.Context.get_device()
        self.clock_khz = np.int32(dev.get_attribute(drv.device_attribute.CLOCK_RATE))

    def _hold(self, mode: int, dur_ns: int, stream) -> None:
        loader.launch(FAMILY, "pace_hold", (1,), (32,),
                      [self.t_next.gpudata, np.uint64(dur_ns), np.int32(mode), self.clock_khz], stream=stream)

    def upload(self, copies, stream) -> int:
        """Queue `copies` ((device address, page-locked host uint8 array) pairs, in order) on `stream`, paced.
        Returns the bytes queued."""
        pieces = pace_pieces([h.nbytes for _, h in copies], self.bus_bw, self.max_piece)
        for j, p in enumerate(pieces):
            self._hold(START if j == 0 else NEXT, p.hold_ns, stream)
            dst, host = copies[p.copy]
            self.drv.memcpy_htod_async(dst + p.offset, host[p.offset : p.offset + p.nbytes], stream)
        if pieces:
            self._hold(END, 0, stream)
        return sum(p.nbytes for p in pieces)

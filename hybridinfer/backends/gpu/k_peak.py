"""Physical floors of the card, measured by the project's own code: fp32 FMA peak (native/cuda_sm20/peak.cu)
and pinned host-to-device bandwidth."""

from __future__ import annotations

import numpy as np

from . import loader


def fma_peak_flops(rounds: int = 1 << 14, repeats: int = 3) -> float:
    """fp32 FLOP/s of independent FMA chains over the whole card (best of `repeats`)."""
    import pycuda.driver as drv
    from pycuda import gpuarray

    loader.init()
    dev = drv.Context.get_device()
    blocks = dev.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT) * 16
    threads = 256
    out = gpuarray.empty(blocks * threads, np.float32)
    best = 0.0
    for _ in range(repeats + 1):  # the first launch compiles and warms up
        start, end = drv.Event(), drv.Event()
        start.record()
        loader.launch("peak", "fma_peak", (blocks,), (threads,),
                      [out.gpudata, np.int32(rounds), np.float32(0.9999), np.float32(1e-4)])
        end.record()
        end.synchronize()
        best = max(best, 2 * 8 * rounds * blocks * threads / (end.time_since(start) / 1e3))
    return best


def pinned_h2d_bytes_per_s(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Host-to-device copy bandwidth from page-locked memory (best of `repeats`)."""
    import pycuda.driver as drv
    from pycuda import gpuarray

    loader.init()
    host = drv.pagelocked_empty(nbytes, np.uint8)
    host[:] = 1
    dev = gpuarray.empty(nbytes, np.uint8)
    stream = drv.Stream()
    best = 0.0
    for _ in range(repeats):
        start, end = drv.Event(), drv.Event()
        start.record(stream)
        drv.memcpy_htod_async(dev.gpudata, host, stream)
        end.record(stream)
        end.synchronize()
        best = max(best, nbytes / (end.time_since(start) / 1e3))
    return best

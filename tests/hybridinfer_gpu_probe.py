"""Whether gpu-marked tests can run here: pycuda imports and a device initialises."""

from functools import cache


@cache
def has_gpu() -> bool:
    try:
        import pycuda.driver as drv

        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False

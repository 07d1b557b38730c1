"""The one PyCUDA loader: compiles native/cuda_sm20/<family>.cu for the running card (cached by PyCUDA
on disk, by us per process), and checks every buffer and the grid before a launch.

Kernels are declared `extern "C" __global__` so their names survive compilation. Launcher modules
(hybridinfer/gpu/k_*.py) call `arg()` for each buffer and `launch()` once; nothing else touches pycuda's
function objects.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import numpy as np

from ..errors import BackendNotAvailableError, KernelArgumentError

SRC_DIR = Path(__file__).resolve().parents[2] / "native" / "cuda_sm20"  # a source tree (editable install)
PKG_SRC_DIR = Path(__file__).resolve().parents[1] / "_cuda_sm20"  # copied there by setup.py for a wheel
MAX_GRID = 65535  # sm_20: grid x, y and z
MAX_BLOCK = 1024


def source_dir() -> Path:
    for d in (SRC_DIR, PKG_SRC_DIR):
        if d.is_dir() and any(d.glob("*.cu")):
            return d
    raise BackendNotAvailableError(f"CUDA kernel sources not found at {SRC_DIR} or {PKG_SRC_DIR}")


_ctx = None


def init(device: int = 0):
    """Create (once) a context on `device` and return it. Raises BackendNotAvailableError without a GPU."""
    global _ctx
    if _ctx is not None:
        return _ctx
    try:
        import pycuda.driver as drv
    except ImportError as e:
        raise BackendNotAvailableError(f"pycuda is not installed ({e})") from None
    try:
        drv.init()
        if drv.Device.count() <= device:
            raise BackendNotAvailableError(f"no CUDA device {device} ({drv.Device.count()} present)")
        _ctx = drv.Device(device).retain_primary_context()
        _ctx.push()
    except drv.Error as e:
        raise BackendNotAvailableError(f"CUDA initialisation failed: {e}") from None
    import atexit

    atexit.register(_ctx.pop)
    return _ctx


@contextmanager
def on_this_thread():
    """The context made current on the calling thread for the duration. CUDA contexts are current per thread: a
    call from another thread than the one that loaded the engine (a web framework's worker, the scheduler's)
    finds none. Pushing the context that is already current is allowed, so this nests."""
    import pycuda.driver as drv

    init().push()
    try:
        yield
    finally:
        drv.Context.pop()


@cache
def module(family: str):
    """Compile native/cuda_sm20/<family>.cu (and the .cuh it includes) for the current card."""
    init()
    from pycuda.compiler import SourceModule

    d = source_dir()
    path = d / f"{family}.cu"
    if not path.is_file():
        raise BackendNotAvailableError(f"no kernel source {path}")
    src = path.read_text()
    # headers are part of the cache key: PyCUDA hashes only the source text
    deps = "".join(p.read_text() for p in sorted(d.glob("*.cuh")))
    src = f"// deps-hash {hash(deps) & 0xffffffff:08x}\n" + src
    opts = ["-O3", "--fmad=true", "-lineinfo"]
    cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "hybridinfer", "cubin")
    os.makedirs(cache_dir, exist_ok=True)
    return SourceModule(src, options=opts, include_dirs=[str(d)], no_extern_c=True, cache_dir=cache_dir)


@cache
def function(family: str, name: str):
    return module(family).get_function(name)


def arg(a, dtype, shape: tuple, what: str):
    """The device pointer of GPUArray `a` after checking dtype, shape (None = any extent) and C order."""
    from pycuda.gpuarray import GPUArray

    if not isinstance(a, GPUArray):
        raise KernelArgumentError(f"{what}: expected a pycuda GPUArray, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise KernelArgumentError(f"{what}: dtype {a.dtype}, expected {np.dtype(dtype)}")
    if len(a.shape) != len(shape) or any(s is not None and s != t for s, t in zip(shape, a.shape, strict=True)):
        raise KernelArgumentError(f"{what}: shape {a.shape}, expected {shape}")
    if not a.flags.c_contiguous:
        raise KernelArgumentError(f"{what}: not C-contiguous (strides {a.strides})")
    return np.uintp(int(a.gpudata))  # views (slices) carry a plain int, which kernels do not take


def grid_for(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def launch(family: str, name: str, grid: tuple, block: tuple, args: list, shared: int = 0, stream=None):
    """Launch kernel `name` of `family`; grid and block are checked against sm_20's limits."""
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
    if any(g < 1 or g > MAX_GRID for g in grid):
        raise KernelArgumentError(f"{name}: grid {grid} outside 1..{MAX_GRID} (sm_20 limit)")
    if np.prod(block) > MAX_BLOCK or min(block) < 1:
        raise KernelArgumentError(f"{name}: block {block} has more than {MAX_BLOCK} threads")
    if shared > 48 * 1024:
        raise KernelArgumentError(f"{name}: {shared} bytes of shared memory exceed sm_20's 48 KiB")
    function(family, name)(*args, grid=grid, block=block, shared=shared, stream=stream)

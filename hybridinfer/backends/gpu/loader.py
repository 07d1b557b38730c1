"""The one PyCUDA loader: compiles native/cuda_sm20/<family>.cu for the running card and its kernel class (the
card's own, or a --card-profile's: kclass.py), caches the cubins on disk (one file per source, options and arch)
and per process, records what it compiled and how long it took (compile_log), and checks every buffer and the
grid before a launch.

Kernels are declared `extern "C" __global__` so their names survive compilation. Launcher modules
(hybridinfer/backends/gpu/k_*.py) call `arg()` for each buffer and `launch()` once; nothing else touches pycuda's
function objects.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import BackendNotAvailableError, KernelArgumentError
from . import cards, kclass

SRC_DIR = Path(__file__).resolve().parents[3] / "native" / "cuda_sm20"  # a source tree (editable install)
PKG_SRC_DIR = Path(__file__).resolve().parents[2] / "_cuda_sm20"  # copied there by setup.py for a wheel
MAX_GRID = 65535  # sm_20: grid x, y and z
MAX_BLOCK = 1024
MAX_SHARED = 48 * 1024  # bytes of shared memory a block may take on every class


def source_dir() -> Path:
    for d in (SRC_DIR, PKG_SRC_DIR):
        if d.is_dir() and any(d.glob("*.cu")):
            return d
    raise BackendNotAvailableError(f"CUDA kernel sources not found at {SRC_DIR} or {PKG_SRC_DIR}")


_ctx = None
_primaries: dict = {}  # device -> its primary context, as card_context gave it (kept for the process)
# the context a thread has made current with on_card (None: the first context, init's): modules, functions and
# limits are kept per context, since a module loaded in one context cannot launch in another
_tls = threading.local()


def _key():
    key = getattr(_tls, "key", None)
    return key if key is not None else (_ctx.handle if _ctx is not None else None)


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
        _ctx = _primaries[device] = drv.Device(device).retain_primary_context()
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


@contextmanager
def model_context():
    """The context a model's streams and buffers are made in, current for the duration: the card's where on_card
    made one current on this thread, else the first context (init's). Without it a model takes whatever context
    the thread happens to have current (another card's, left by a multi-card model), and its streams then fail
    in its own ("invalid resource handle")."""
    if getattr(_tls, "key", None) is not None:
        yield
        return
    with on_this_thread():
        yield


def card_context(device: int):
    """The context of `device` for one card of a multi-card prefill, not left current: the device's primary context.
    A device named twice (two "cards" on one GPU: how the multi-card path runs on a one-GPU host) shares it: each
    card keeps its own streams and buffers, and a context of its own would be one more that must be torn down in
    order. BackendNotAvailableError where there is no such device."""
    init(device)  # pycuda up; the process's first context
    import pycuda.driver as drv

    n = drv.Device.count()
    if not 0 <= device < n:
        raise BackendNotAvailableError(f"no CUDA device {device} ({n} present)")
    # one Context object a device, kept for the process: pycuda, releasing a collected primary context, pushes it
    # first and leaves it current on the collecting thread
    if device not in _primaries:
        try:
            _primaries[device] = drv.Device(device).retain_primary_context()
        except drv.Error as e:
            raise BackendNotAvailableError(f"CUDA device {device}: no context ({e})") from None
    return _primaries[device]


def device_name(device: int) -> str:
    import pycuda.driver as drv

    return str(drv.Device(device).name())


@contextmanager
def on_card(ctx):
    """`ctx` (card_context's) current on the calling thread for the duration, and the loader's modules its own."""
    import pycuda.driver as drv

    ctx.push()
    prev, _tls.key = getattr(_tls, "key", None), ctx.handle
    try:
        yield
    finally:
        _tls.key = prev
        drv.Context.pop()


FAMILIES = ("gemm", "elementwise", "gdn", "attention", "moe")  # what a prefill uses (peak.cu is bench-only)
_profile: str | None = None


def configure(card_profile: str | None) -> None:
    """Compile and choose tiles as for `card_profile` (cards.PROFILES: fermi, kepler, maxwell, pascal), or for the
    card itself (None). Process-wide: modules are kept per class, and launches after a change use the new one."""
    global _profile
    if card_profile is not None and card_profile not in cards.PROFILES:
        raise ValueError(f"unknown card profile {card_profile!r} (known: {', '.join(cards.PROFILES)})")
    _profile = card_profile
    _limits.clear()


def profile() -> str | None:
    return _profile


def device_cc() -> tuple[int, int]:
    import pycuda.driver as drv

    init()
    return drv.Context.get_device().compute_capability()


_limits: dict = {}


def limits() -> cards.CardLimits:
    """The limits tiles are chosen for on the current context's card: the profile's (with the card's SM count) or
    the card's own."""
    import pycuda.driver as drv

    init()
    key = _key()
    got = _limits.get(key)
    if got is None:
        sms = int(drv.Context.get_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT))
        got = cards.profile_limits(_profile, sms) if _profile is not None else cards.limits_for(device_cc(), sms)
        _limits[key] = got
    return got


def kernel_class() -> str:
    return kclass.kernel_class(limits())


def cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "hybridinfer", "cubin")


@dataclass(frozen=True)
class Compiled:
    family: str
    kernel_class: str
    arch: str
    seconds: float
    cached: bool  # read from the disk cache, not compiled


compile_log: list[Compiled] = []
_modules: dict = {}


def _source(family: str) -> tuple[str, Path]:
    d = source_dir()
    path = d / f"{family}.cu"
    if not path.is_file():
        raise BackendNotAvailableError(f"no kernel source {path}")
    return path.read_text(), d


def cache_key(src: str, headers: str, options: list[str], arch: str, nvcc_version: str) -> str:
    """The disk cache's file name for a source, its headers, the options, the arch and the compiler."""
    h = hashlib.sha256()
    for part in (src, headers, " ".join(options), arch, nvcc_version):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32] + ".cubin"


def _plan(family: str):
    """(source, include dir, options, arch, cache path) of a family under the current class."""
    from pycuda.compiler import get_nvcc_version

    src, d = _source(family)
    headers = "".join(p.read_text() for p in sorted(d.glob("*.cuh")))
    cc = device_cc()
    arch = f"sm_{cc[0]}{cc[1]}"
    opts = ["-O3", "--fmad=true", "-lineinfo", *kclass.nvcc_options(kernel_class())]
    path = os.path.join(cache_dir(), cache_key(src, headers, opts, arch, get_nvcc_version("nvcc")))
    return src, d, opts, arch, path


def is_cached(family: str) -> bool:
    """Whether `family` is in the disk cache for this card and class (so loading it compiles nothing)."""
    return os.path.isfile(_plan(family)[4])


def module(family: str):
    """Compile native/cuda_sm20/<family>.cu (and the .cuh it includes) for the current card and class, or load it
    from the disk cache; each load is appended to compile_log."""
    cls = kernel_class()
    key = (_key(), family, cls)
    if key in _modules:
        return _modules[key]
    import pycuda.driver as drv
    from pycuda.compiler import compile as nvcc_compile

    src, d, opts, arch, path = _plan(family)
    t0 = time.perf_counter()
    cached = os.path.isfile(path)
    if cached:
        with open(path, "rb") as f:
            cubin = f.read()
    else:
        cubin = nvcc_compile(src, options=opts, arch=arch, include_dirs=[str(d)], no_extern_c=True, cache_dir=False)
        os.makedirs(cache_dir(), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)  # atomic: a concurrent process reads a whole file or none
    mod = drv.module_from_buffer(cubin)
    compile_log.append(Compiled(family, cls, arch, time.perf_counter() - t0, cached))
    _modules[key] = mod
    return mod


def compile_all(families=FAMILIES) -> list[Compiled]:
    """Load (compiling where the disk cache lacks them) every family; returns what this call loaded."""
    n = len(compile_log)
    for f in families:
        module(f)
    return compile_log[n:]


def describe_compiles(loaded: list[Compiled]) -> str | None:
    """One line on kernels this process compiled (None when everything came from the cache)."""
    built = [c for c in loaded if not c.cached]
    if not built:
        return None
    c = built[0]
    prof = f", {_profile} profile" if _profile else ""
    return (f"compiled {len(built)} GPU kernel source(s) for {c.arch} ({c.kernel_class}{prof}) in "
            f"{sum(b.seconds for b in built):.1f} s; cached in {cache_dir()}")


def function(family: str, name: str):
    key = (_key(), family, kernel_class(), name)
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = module(family).get_function(name)
    return fn


_functions: dict = {}


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
    return ptr(a)


def ptr(a):
    """A GPUArray's device pointer as a kernel argument: a view's (a slice's) gpudata is a plain int, which pycuda
    refuses ("invalid type on parameter")."""
    return np.uintp(int(a.gpudata))


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
    if shared > MAX_SHARED:
        raise KernelArgumentError(f"{name}: {shared} bytes of shared memory exceed sm_20's 48 KiB")
    function(family, name)(*args, grid=grid, block=block, shared=shared, stream=stream)

"""cffi build script of the compiled module `hybridinfer.backends.gpu._pace` (API mode), the GPU backend's bus
pacing: pace.c's host functions, which the CUDA driver runs between the pieces of a paced upload
(hybridinfer/backends/gpu/k_pace.py). Run by setup.py through `cffi_modules` beside native/simd's library, or
directly: `python native/pace/build.py` builds it in place for development. Plain C with no ISA flags: it only
reads the clock and sleeps.
"""

from __future__ import annotations

import os
import re

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = "hybridinfer.backends.gpu._pace"


def _path(name: str, absolute: bool = False) -> str:
    """Relative to the working directory when below it (setuptools' preference), else absolute."""
    p = os.path.join(_HERE, name)
    rel = os.path.relpath(p)
    return p if absolute or rel.startswith("..") else rel


def _cdef() -> str:
    with open(os.path.join(_HERE, "pace.h")) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    return "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))


def make_ffi(absolute: bool = False) -> FFI:
    ffi = FFI()
    ffi.cdef(_cdef())
    ffi.set_source(MODULE, '#include "pace.h"\n', sources=[_path("pace.c", absolute)],
                   depends=[_path("pace.h", absolute)], include_dirs=[_path(".", absolute)],
                   extra_compile_args=["-std=gnu11", "-O2"])
    return ffi


ffibuilder = make_ffi()

if __name__ == "__main__":
    # development build (what `pip install -e .` also does): the module copied next to the GPU package's sources
    import shutil

    root = os.path.dirname(os.path.dirname(_HERE))
    os.chdir(root)
    built = make_ffi(absolute=True).compile(tmpdir=os.path.join("build", "pace-dev"), verbose=False)
    pkg = os.path.join(root, *MODULE.split(".")[:-1])
    dest = os.path.join(pkg, os.path.basename(built))
    tmp = dest + ".tmp"
    shutil.copyfile(built, tmp)
    os.replace(tmp, dest)  # a new inode: processes that loaded the old module keep it intact
    for f in os.listdir(pkg):  # another build of the module (pip's _pace.abi3.so) would compete with this one
        if f.startswith("_pace.") and f.endswith(".so") and f != os.path.basename(dest):
            os.remove(os.path.join(pkg, f))
    print(dest)

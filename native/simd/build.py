"""cffi build script of the compiled module `hybridinfer._simd` (API mode), run by setup.py through
`cffi_modules=["native/simd/build.py:ffibuilder"]` (or directly: `python native/simd/build.py` builds it in
place for development).

One extension holds every ISA level: isa_scalar.c, isa_ssse3.c, isa_avx2.c and isa_avx512vnni.c include the
same kernel bodies (kernels_body.h with kernels_{quant,lanes,tiles}.h; dot_kquants.h with dot_q{4,5,6}_K.h)
under a `#pragma GCC target(...)` of their own, so every source file is compiled with the same (baseline
x86-64) flags and no per-file flags are needed; hi_cpu.c picks the level at run time from cpuid, hi_pool.c
is the thread pool, hi_ctx.c the context and hi_simd.c the entry points that split the work over it. The C
declarations come from hi_simd.h, the one header cffi and the C side share. gdn.c (the Gated DeltaNet layer,
plain float code) picks its avx2 or baseline loops itself; attn.c splits attention over the pool and runs the ISA
table's `attn`; ops.c has the small ops between the products, replay.c runs a recorded decode step, probe.c the
bandwidth probe, moe_rows.c the routed experts of several tokens grouped by expert, replica.c the per-node
weight copies' table, gemm.c the vision tower's float products, vattn.c its fused attention and vrows.c its
row ops (LayerNorm, GELUs, the rotary layout). (The GPU backend's bus pacing is its own module, native/pace.)
"""

from __future__ import annotations

import os
import re

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [
    "hi_simd.c", "hi_ctx.c", "hi_cpu.c", "hi_pool.c", "isa_scalar.c", "isa_ssse3.c", "isa_avx2.c", "isa_avx512vnni.c",
    "gdn.c", "attn.c", "rowops.c", "ops.c", "replay.c", "probe.c", "moe_rows.c", "replica.c", "gemm.c",
    "vattn.c",
    "vrows.c",
]
_HEADERS = [
    "hi_simd.h", "hi_ctx.h", "hi_internal.h", "hi_jobs.h", "hi_pool.h", "hi_replica.h", "blocks.h",
    "kernels_body.h", "kernels_quant.h", "kernels_lanes.h", "kernels_tiles.h", "kernels_rows.h",
    "kernels_rows_vnni.h", "kernels_rows_avx2.h", "kernels_rows_ssse3.h", "kernels_rows_small.h", "kernels_attn.h",
    "kernels_fa.h", "kernels_fa_vnni.h", "kernels_fa_tiled.h", "kernels_gemm.h", "kernels_vattn.h",
    "dot_kquants.h", "dot_q4_K.h", "dot_q5_K.h", "dot_q6_K.h", "dot_kq_shapes.h", "vrows_body.h",
]
COMPILE_ARGS = ["-std=gnu11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-Wno-unused-function"]


def _path(name: str, absolute: bool = False) -> str:
    """Relative to the working directory when below it (setuptools' preference), else absolute."""
    p = os.path.join(_HERE, name)
    rel = os.path.relpath(p)
    return p if absolute or rel.startswith("..") else rel


def _cdef() -> str:
    with open(os.path.join(_HERE, "hi_simd.h")) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return "\n".join(lines)


def make_ffi(absolute: bool = False) -> FFI:
    ffi = FFI()
    ffi.cdef(_cdef())
    ffi.set_source(
        "hybridinfer._simd",
        '#include "hi_simd.h"\n',
        sources=[_path(s, absolute) for s in _SOURCES],
        depends=[_path(h, absolute) for h in _HEADERS],
        include_dirs=[_path(".", absolute)],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-pthread"],
        libraries=["m"],
    )
    return ffi


ffibuilder = make_ffi()

if __name__ == "__main__":
    # development build (what `pip install -e .` also does): objects under build/simd-dev, the module
    # copied to hybridinfer/_simd*.so next to the package sources
    import shutil

    root = os.path.dirname(os.path.dirname(_HERE))
    os.chdir(root)
    built = make_ffi(absolute=True).compile(tmpdir=os.path.join("build", "simd-dev"), verbose=False)
    dest = os.path.join(root, "hybridinfer", os.path.basename(built))
    tmp = dest + ".tmp"
    shutil.copyfile(built, tmp)
    os.replace(tmp, dest)  # a new inode: processes that loaded the old module keep it intact
    # another build of the module (pip's _simd.abi3.so) would compete with this one: keep one
    pkg = os.path.dirname(dest)
    for f in os.listdir(pkg):
        if f.startswith("_simd.") and f.endswith(".so") and f != os.path.basename(dest):
            os.remove(os.path.join(pkg, f))
    print(dest)

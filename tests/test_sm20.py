"""The sm_20 rules, checked mechanically (CPU only): every kernel source compiles to sm_20 PTX with clang and
holds no instruction sm_20 lacks; planted violations are caught; nvcc compiles every source for its
default architecture."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tools.sm20check import check_sm20, forbidden_in_ptx

SRC = Path(__file__).resolve().parents[1] / "native" / "cuda_sm20"
SOURCES = sorted(SRC.glob("*.cu"))
CLANG = "clang-16"
needs_clang = pytest.mark.skipif(shutil.which(CLANG) is None,
                                 reason=f"{CLANG} not installed (apt-get install clang-16)")


def test_sources_exist():
    assert SOURCES, f"no kernel sources in {SRC}"


@needs_clang
@pytest.mark.parametrize("cu", SOURCES, ids=[p.name for p in SOURCES])
def test_source_is_sm20_clean(cu):
    found = check_sm20(cu, clang=CLANG)
    assert not found, f"{cu.name} uses instructions sm_20 lacks:\n" + "\n".join(found[:30])


SHFL_INTRINSIC = r"""
extern "C" __global__ void planted(float* x) {
    float v = x[threadIdx.x];
    v += __shfl_down_sync(0xffffffffu, v, 1);
    x[threadIdx.x] = v;
}
"""

SHFL_ASM = r"""
extern "C" __global__ void planted(float* x) {
    float v = x[threadIdx.x], w;
    asm volatile("shfl.sync.down.b32 %0, %1, 1, 31, -1;" : "=f"(w) : "f"(v));
    x[threadIdx.x] = v + w;
}
"""

DP4A_ASM = r"""
extern "C" __global__ void planted(int* y) {
    int r;
    asm volatile("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(y[0]), "r"(y[1]), "r"(y[2]));
    y[threadIdx.x] = r;
}
"""

CLEAN_HALF_CVT = r"""
extern "C" __global__ void planted(const unsigned short* h, float* x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h[threadIdx.x]));
    __syncthreads();
    atomicAdd(x, f);
}
"""


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "planted.cu"
    p.write_text(text)
    return p


@needs_clang
def test_planted_shfl_intrinsic_is_caught(tmp_path):
    # clang declares the *_sync shuffles only for sm_30+, so for sm_20 the source is rejected outright
    p = _write(tmp_path, SHFL_INTRINSIC)
    try:
        found = check_sm20(p, clang=CLANG)
    except RuntimeError as e:
        assert "__shfl_down_sync" in str(e)
    else:
        assert any("shfl" in f for f in found), found


@needs_clang
def test_planted_shfl_asm_is_caught(tmp_path):
    found = check_sm20(_write(tmp_path, SHFL_ASM), clang=CLANG)
    assert any("shfl.sync" in f for f in found), found


@needs_clang
def test_planted_dp4a_asm_is_caught(tmp_path):
    found = check_sm20(_write(tmp_path, DP4A_ASM), clang=CLANG)
    assert len(found) == 1 and "dp4a" in found[0], found


@needs_clang
def test_conversions_and_float_atomics_pass(tmp_path):
    assert check_sm20(_write(tmp_path, CLEAN_HALF_CVT), clang=CLANG) == []


def test_ptx_scan_rules():
    ok = """
    .reg .f32 %f<4>;
    $L__BB0_1:
        cvt.f32.f16 %f1, %rs1;
        cvt.rn.f16.f32 %rs2, %f1;
        ld.global.u16 %rs3, [%rd1];
        bar.sync 0;
        vote.ballot.b32 %r1, %p1;
        atom.global.add.f32 %f2, [%rd2], %f1;
        @%p1 bra $L__BB0_1;
        { fma.rn.f32 %f3, %f1, %f2, %f3; }
    """
    assert forbidden_in_ptx(ok) == []
    bad = [
        "shfl.down.b32 %r1, %r2, 1, 31;",
        "shfl.sync.bfly.b32 %r1, %r2, 1, 31, -1;",
        "dp2a.lo.s32.s32 %r1, %r2, %r3, %r4;",
        "add.f16 %rs1, %rs2, %rs3;",
        "fma.rn.f16x2 %r1, %r2, %r3, %r4;",
        "mul.rn.bf16 %rs1, %rs2, %rs3;",
        "@!%p2 setp.lt.f16 %p1, %rs1, %rs2;",
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};",
        "wmma.load.a.sync.aligned.row.m16n16k16.f16 {%r1}, [%rd1];",
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1}, [%r2];",
        "cp.async.ca.shared.global [%r1], [%rd1], 16;",
        "redux.sync.add.s32 %r1, %r2, -1;",
        "vote.sync.ballot.b32 %r1, %p1, -1;",
        "match.any.sync.b32 %r1, %r2, -1;",
        "bar.warp.sync -1;",
        "atom.global.add.f64 %fd1, [%rd1], %fd2;",
        "ld.global.nc.f32 %f1, [%rd1];",
    ]
    for line in bad:
        assert len(forbidden_in_ptx(line)) == 1, line


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("cu", SOURCES, ids=[p.name for p in SOURCES])
def test_nvcc_compiles_for_default_arch(cu, tmp_path):
    r = subprocess.run([NVCC, "-c", "-O3", "-I", str(SRC), str(cu), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]

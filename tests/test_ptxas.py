"""ptxas in CI, no GPU: every kernel source compiled by clang-16 for each kernel class and assembled by CUDA 11.8's
ptxas for the class's archs (sm_35, sm_37, sm_50, sm_52, sm_60; the 63-register class for sm_35 at
--maxrregcount 63, as its Fermi and GK10x cards hold every thread). The committed table ptxas_table.py must be
what ptxas reports (k_gemm.choose_tile trusts it), and no kernel a class runs may spill or exceed its shared memory.

CUDA 11.8's ptxas comes from the pip package nvidia-cuda-nvcc-cu11 (.ci/run installs it; the test extra names
it). Its measurement runs once a session (about 100 s on two cores)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from hybridinfer.backends.gpu import cards, kclass
from hybridinfer.backends.gpu.k_gemm import GEMM_TYPES, TILES_BY_CLASS, choose_tile
from hybridinfer.backends.gpu.ptxas_table import USAGE
from hybridinfer.format import quant
from tools import ptxcheck

SRC = Path(__file__).resolve().parents[1] / "native" / "cuda_sm20"
PTXAS = ptxcheck.find_ptxas()
pytestmark = [
    pytest.mark.skipif(shutil.which("clang-16") is None, reason="clang-16 not installed (apt-get install clang-16)"),
    pytest.mark.skipif(PTXAS is None, reason="CUDA 11.8's ptxas not found (pip install nvidia-cuda-nvcc-cu11)"),
]

@pytest.fixture(scope="session")
def measured():
    sources = sorted(SRC.glob("*.cu"))
    return {cls: ptxcheck.class_usage(sources, cls, PTXAS) for cls in kclass.CLASSES}


def _kernels_run(cls: str) -> set[str]:
    """The kernels a class launches: everything but the GEMM tiles choose_tile never picks for it."""
    names = set(USAGE[cls])
    gemm = {n for n in names if n.startswith("gemm_")}
    chosen = set()
    lim = cards.profile_limits("fermi" if cls == kclass.R63 else "kepler", 14)
    for q in GEMM_TYPES:
        for T, N, K, rpg in ((947, 8192, 2048, None), (7576, 512, 2048, 30.0), (8, 2048, 2048, None),
                             (128, 8192, 2048, None), (4096 * 8, 512, 2048, 128.0), (1024, 512, 2048, 4.0)):
            for sms in (8, 14, 56, 132):
                bm, bn = choose_tile(replace(lim, sm_count=sms), T, N, K, q, rpg)
                chosen.add(f"gemm_{GEMM_TYPES[q]}_b{bm}_n{bn}")
    return (names - gemm) | chosen


def test_table_is_what_ptxas_reports(measured):
    for cls in kclass.CLASSES:
        got = {k: (u.regs, u.spill, u.smem) for k, u in measured[cls].items()}
        diff = {k: (USAGE[cls].get(k), got.get(k)) for k in set(got) | set(USAGE[cls])
                if USAGE[cls].get(k) != got.get(k)}
        assert not diff, (f"ptxas_table.py is stale for class {cls} (table, ptxas); rerun "
                          f"python bench/ptxas_report.py --write: {sorted(diff.items())[:12]}")


@pytest.mark.parametrize("cls", kclass.CLASSES)
def test_no_kernel_a_class_runs_spills_or_overflows(measured, cls):
    lim = cards.profile_limits("fermi" if cls == kclass.R63 else "kepler", 14)
    bad = []
    for k in sorted(_kernels_run(cls)):
        u = measured[cls][k]
        if u.smem > lim.smem_per_block or u.regs > lim.regs_per_thread:
            bad.append(f"{k}: {u.regs} registers, {u.smem} B shared")
        elif u.spill:
            bad.append(f"{k}: spills {u.spill} B on {u.arch}")
    assert not bad, f"class {cls}:\n" + "\n".join(bad)


def test_every_gemm_tile_of_each_class_is_compiled(measured):
    for cls, tiles in TILES_BY_CLASS.items():
        for q, name in GEMM_TYPES.items():
            for bm, bn in tiles:
                assert f"gemm_{name}_b{bm}_n{bn}" in measured[cls], (cls, quant.type_name(q), (bm, bn))


def test_parse_ptxas_output():
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gemm_q4_k_b64_n64' for 'sm_35'
ptxas info    : Function properties for gemm_q4_k_b64_n64
    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 63 registers, 18720 bytes smem, 380 bytes cmem[0]
ptxas info    : Compiling entry function 'add_f32' for 'sm_52'
ptxas info    : Function properties for add_f32
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, 344 bytes cmem[0]
"""
    a, b = ptxcheck.parse_ptxas(text)
    assert (a.kernel, a.arch, a.regs, a.spill, a.smem) == ("gemm_q4_k_b64_n64", "sm_35", 63, 20, 18720)
    assert (b.kernel, b.arch, b.regs, b.spill, b.smem) == ("add_f32", "sm_52", 10, 0, 0)


def test_a_planted_spill_is_caught(tmp_path):
    """A kernel with 96 live values, at 63 registers, spills; unconstrained it does not."""
    cu = tmp_path / "planted.cu"
    cu.write_text("""
extern "C" __global__ void planted(const float* x, float* y, int n) {
    float v[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) v[i] = x[threadIdx.x + i * n];
    float s = 0.0f;
    for (int k = 0; k < n; ++k)
#pragma unroll
        for (int i = 0; i < 96; ++i) { v[i] = v[i] * v[(i + 1) % 96] + s; s += v[i]; }
#pragma unroll
    for (int i = 0; i < 96; ++i) y[threadIdx.x + i * n] = v[i];
}
""")
    ptx = ptxcheck.clang_ptx(cu, kclass.R255, PTXAS)
    (free,) = ptxcheck.assemble(ptx, "sm_35", PTXAS)
    (held,) = ptxcheck.assemble(ptx, "sm_35", PTXAS, maxreg=63)
    assert free.spill == 0 and free.regs > 63
    assert held.regs <= 63 and held.spill > 0

"""Register, spill and shared-memory use of every kernel per kernel class, without a GPU: clang-16 compiles each
source to PTX with the class's defines, CUDA 11.8's ptxas (pip package nvidia-cuda-nvcc-cu11) assembles it for
each arch the class is checked on (kclass.CHECK_ARCHS) and reports what each kernel uses.

The PTX is made once per (source, class) for sm_35, the oldest arch checked; ptxas assembles a PTX target for any
later arch. Clang links CUDA 11.8's libdevice (from the same pip package), so the kernels' expf and logf are
the code a real build has, and uses 32-bit shared-memory pointers as nvcc does.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hybridinfer.backends.gpu import kclass

from .sm20check import clang_device_ptx


@dataclass(frozen=True)
class Usage:
    kernel: str
    arch: str
    regs: int
    spill: int  # bytes of spill stores + loads a thread
    smem: int  # static shared memory, bytes


def find_ptxas() -> str | None:
    """CUDA 11.8's ptxas from the nvidia-cuda-nvcc-cu11 package, or $HYBRIDINFER_PTXAS; None when absent."""
    env = os.environ.get("HYBRIDINFER_PTXAS")
    if env:
        return env if Path(env).is_file() else None
    try:
        import nvidia.cuda_nvcc as pkg
    except ImportError:
        return None
    for d in getattr(pkg, "__path__", []):
        exe = Path(d, "bin", "ptxas")
        if exe.is_file():
            return str(exe)
    return None


def libdevice_of(ptxas: str) -> Path | None:
    p = Path(ptxas).resolve().parents[1] / "nvvm" / "libdevice" / "libdevice.10.bc"
    return p if p.is_file() else None


def clang_ptx(cu: Path, cls: str, ptxas: str, clang: str = "clang-16", arch: str = "sm_35") -> str:
    """PTX of `cu` for kernel class `cls` (its -D defines), with libdevice linked in."""
    libdevice = libdevice_of(ptxas)
    if libdevice is None:
        raise FileNotFoundError(f"no libdevice.10.bc beside {ptxas}")
    opts = ["-Xclang", "-mlink-builtin-bitcode", "-Xclang", str(libdevice), "-fcuda-short-ptr", "-mllvm",
            "--nvptx-short-ptr", "-O3", *kclass.DEFINES[cls]]
    return clang_device_ptx(cu, arch, opts, clang)


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> list[Usage]:
    """The kernels of `ptxas -v` output with their registers, spill bytes and static shared memory."""
    out, cur = [], None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = {"kernel": m.group(1), "arch": m.group(2), "spill": 0, "smem": 0}
            continue
        if cur is None:
            continue
        m = _SPILL.search(line)
        if m:
            cur["spill"] = int(m.group(1)) + int(m.group(2))
        m = _USED.search(line)
        if m:
            s = _SMEM.search(line)
            out.append(Usage(cur["kernel"], cur["arch"], int(m.group(1)), cur["spill"], int(s.group(1)) if s else 0))
            cur = None
    return out


def assemble(ptx: str, arch: str, ptxas: str, maxreg: int | None = None) -> list[Usage]:
    with tempfile.TemporaryDirectory(prefix="ptxcheck-") as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        cmd = [ptxas, f"-arch={arch}", "-v", str(src), "-o", os.devnull]
        if maxreg:
            cmd[2:2] = ["--maxrregcount", str(maxreg)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ptxas failed for {arch}:\n{r.stderr[-4000:]}")
        return parse_ptxas(r.stderr + r.stdout)


def class_usage(sources, cls: str, ptxas: str, clang: str = "clang-16", jobs: int | None = None) -> dict:
    """{kernel: Usage} of every kernel of `sources` under class `cls`, the worst over the class's archs
    (most registers, most spill; shared memory is the same on each)."""
    jobs = jobs or max(2, os.cpu_count() or 2)
    with ThreadPoolExecutor(jobs) as ex:
        ptxs = list(ex.map(lambda cu: clang_ptx(Path(cu), cls, ptxas, clang), sources))
        work = [(ptx, arch) for ptx in ptxs for arch in kclass.CHECK_ARCHS[cls]]
        results = ex.map(lambda w: assemble(w[0], w[1], ptxas, kclass.MAXREG[cls]), work)
        worst: dict[str, Usage] = {}
        for usages in results:
            for u in usages:
                w = worst.get(u.kernel)
                if w is None or (u.spill, u.regs) > (w.spill, w.regs):
                    worst[u.kernel] = u
    return worst

"""Mechanical check of the sm_20 rules (docs/sm20.md): compile one kernel source to sm_20 PTX
with clang and list the instructions in it that sm_20 does not have.

Clang emits inline asm verbatim into the PTX, so the scan catches hand-written instructions too. Allowed
half-precision instructions are conversions and moves (cvt.f32.f16, ld/st of 16-bit data); every other
instruction with an .f16/.bf16 type is arithmetic and reported.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

STUB_HEADERS = ("texture_fetch_functions.h", "curand_mtgp32_kernel.h")

# opcode prefixes (the part before the first '.') that are forbidden whatever their suffixes
_FORBIDDEN_BASE = {"shfl", "dp4a", "dp2a", "mma", "wmma", "ldmatrix", "stmatrix", "cp", "redux", "match",
                   "activemask", "elect", "wgmma", "tcgen05", "griddepcontrol"}
# half-precision types: allowed only on these opcodes (conversion, data movement)
_HALF_TYPES = {"f16", "f16x2", "bf16", "bf16x2"}
_HALF_OK = {"cvt", "ld", "st", "mov", "cvta"}
_PRED = re.compile(r"^@!?%?\w+\s+")


def default_cuda_path() -> str:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and Path(cand, "include", "cuda.h").is_file():
            return cand
    return "/usr/local/cuda"


def _instructions(ptx: str):
    """(line number, statement) for each instruction of the PTX text (directives and labels skipped)."""
    for no, line in enumerate(ptx.splitlines(), 1):
        line = line.split("//", 1)[0]
        for stmt in line.split(";"):
            s = stmt.strip().lstrip("{}").strip()
            if not s or s.startswith(".") or s.endswith(":") or s in ("{", "}"):
                continue
            s = _PRED.sub("", s)
            if s and s[0].isalpha():
                yield no, s


def forbidden_in_ptx(ptx: str) -> list[str]:
    """The forbidden instructions of a PTX text, each as 'line N: <instruction>'."""
    found = []
    for no, s in _instructions(ptx):
        opcode = s.split()[0]
        parts = opcode.split(".")
        base = parts[0]
        bad = base in _FORBIDDEN_BASE
        bad |= base == "vote" and "sync" in parts  # vote.sync.* (plain vote.* is sm_20)
        bad |= opcode.startswith("bar.warp") or opcode.startswith("barrier.cluster")
        bad |= base in ("atom", "red") and "f64" in parts  # double atomicAdd
        bad |= base == "ld" and "nc" in parts  # __ldg
        bad |= base not in _HALF_OK and any(p in _HALF_TYPES for p in parts[1:])
        if bad:
            found.append(f"line {no}: {s}")
    return found


def clang_device_ptx(cu_path, arch: str, options: list[str], clang: str = "clang-16",
                     cuda_path: str | None = None) -> str:
    """The PTX clang makes of `cu_path` for `arch` with extra `options` (its own directory on the include path,
    CUDA's texture and curand headers stubbed out). RuntimeError with clang's messages when it does not compile,
    FileNotFoundError without clang."""
    cu_path = Path(cu_path)
    exe = shutil.which(clang)
    if exe is None:
        raise FileNotFoundError(f"{clang} not found on PATH")
    with tempfile.TemporaryDirectory(prefix="clangptx-") as tmp:
        stubs = Path(tmp, "stubs")
        stubs.mkdir()
        for h in STUB_HEADERS:
            (stubs / h).write_text("")
        out = Path(tmp, "out.ptx")
        cmd = [exe, "-x", "cuda", "--cuda-device-only", f"--cuda-gpu-arch={arch}",
               f"--cuda-path={cuda_path or default_cuda_path()}", "--no-cuda-version-check", "-nocudalib", "-S",
               "-isystem", str(stubs), "-I", str(cu_path.parent), *options, str(cu_path), "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not out.is_file():
            raise RuntimeError(f"clang could not compile {cu_path.name} for {arch}:\n{r.stderr[-4000:]}")
        return out.read_text()


def compile_ptx(cu_path, clang: str = "clang-16", cuda_path: str | None = None,
                include_dirs: tuple = ()) -> str:
    """The sm_20 PTX clang makes of `cu_path` (its own directory is on the include path). Raises
    RuntimeError with clang's messages when it does not compile, FileNotFoundError without clang."""
    return clang_device_ptx(cu_path, "sm_20", [a for d in include_dirs for a in ("-I", str(d))], clang, cuda_path)


def check_sm20(cu_path, clang: str = "clang-16", cuda_path: str | None = None) -> list[str]:
    """Compile `cu_path` to sm_20 PTX with clang and return the forbidden instructions found ([] = clean)."""
    return forbidden_in_ptx(compile_ptx(cu_path, clang=clang, cuda_path=cuda_path))


if __name__ == "__main__":  # python -m tools.sm20check native/cuda_sm20/*.cu
    import sys

    bad = 0
    for p in sys.argv[1:]:
        found = check_sm20(p)
        bad += bool(found)
        print(f"{p}: {'ok' if not found else str(len(found)) + ' forbidden'}")
        for f in found[:20]:
            print("   ", f)
    sys.exit(1 if bad else 0)

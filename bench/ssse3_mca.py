"""Cycles per block of the SSSE3 K-quant dot kernels from llvm-mca, a port-pressure model of one core: no noise
from neighbours, so a kernel change can be weighed before it reaches a shared host.

    python bench/ssse3_mca.py [--cpu icelake-server] [--src native/simd]

Compiles a harness around isa_ssse3.c with the flags of native/simd/build.py (gcc -S), cuts each kernel's main
loop (its longest backward jump) out of the assembly, and runs llvm-mca on it. A loop may cover more than one
block (the Q4_K / Q5_K kernels take two at a time); it counts 16 pmaddubsw per block. Rows "repacked" are the
layout SimdLib.repack gives, "file" the GGUF's own (--weights mmap). The default model is Ice Lake server's,
the nearest llvm-mca has to the GPU host's Xeon (3 vector ALU ports), whose SSSE3 kernels are bound by them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "native", "simd"))
from build import COMPILE_ARGS  # noqa: E402

# (label, dot function, wz, block bytes)
KERNELS = [
    ("Q4_K repacked", "hi_dot_q4_K_z", 1, 144),
    ("Q4_K file", "hi_dot_q4_K_z", 0, 144),
    ("Q5_K repacked", "hi_dot_q5_K_z", 1, 176),
    ("Q6_K repacked", "hi_dot_q6_K_z", 1, 210),
    ("Q6_K file", "hi_dot_q6_K_z", 0, 210),
]


def harness() -> str:
    out = ['#include "isa_ssse3.c"']
    for i, (_, fn, wz, _) in enumerate(KERNELS):
        out.append(f"__attribute__((noinline, flatten)) float mca_k{i}(int n, const void *w, const hi_q8Kz *z) "
                   f"{{ return {fn}(n, w, z, {wz}); }}")
    return "\n".join(out) + "\n"


def main_loop(asm: str, name: str) -> list[str]:
    """The instructions of the longest loop (label .. backward jump to it) in function `name`."""
    lines = asm[asm.index(f"\n{name}:"):].splitlines()
    lines = lines[:next(i for i, x in enumerate(lines) if x.strip().startswith(".size"))]
    labels = {x[:-1]: i for i, x in enumerate(lines) if re.match(r"^\.L\w+:$", x)}
    best = None
    for i, x in enumerate(lines):
        m = re.match(r"\s+j\w+\s+(\.L\w+)", x)
        if m and labels.get(m.group(1), i) < i and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    if best is None:
        raise RuntimeError(f"no loop in {name}")
    return [x for x in lines[best[0] + 1:best[1] + 1] if not x.strip().startswith(".")]  # no labels, directives


def tool_args(ap: argparse.ArgumentParser) -> None:
    """The flags both llvm-mca benches take: the kernels' source, llvm-mca and the C compiler."""
    ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "native", "simd"))
    ap.add_argument("--llvm-mca", default="llvm-mca")
    ap.add_argument("--cc", default=os.environ.get("CC", "gcc"))


def find_mca(a) -> str | None:
    mca = shutil.which(a.llvm_mca)
    if not mca:
        print(f"{a.llvm_mca} not found (apt-get install llvm)", file=sys.stderr)
    return mca


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", default="icelake-server", help="llvm-mca's -mcpu")
    tool_args(ap)
    a = ap.parse_args(argv)
    mca = find_mca(a)
    if not mca:
        return 2
    with tempfile.TemporaryDirectory() as d:
        c, s = os.path.join(d, "h.c"), os.path.join(d, "h.s")
        with open(c, "w") as f:
            f.write(harness())
        subprocess.run([a.cc, *COMPILE_ARGS, "-I", a.src, "-S", "-o", s, c], check=True)
        asm = open(s).read()
        print(f"llvm-mca -mcpu={a.cpu}, gcc {' '.join(COMPILE_ARGS)}")
        print("| kernel | instructions / block | cycles / block | bytes / cycle |\n|---|---|---|---|")
        for i, (label, _, _, nbytes) in enumerate(KERNELS):
            body = main_loop(asm, f"mca_k{i}")
            blocks = sum("pmaddubsw" in x for x in body) / 16
            loop = os.path.join(d, f"k{i}.s")
            with open(loop, "w") as f:
                f.write("\n".join(body) + "\n")
            r = subprocess.run([mca, f"-mcpu={a.cpu}", "-iterations=300", loop], capture_output=True, text=True,
                               check=True).stdout
            cyc = int(re.search(r"Total Cycles:\s+(\d+)", r).group(1)) / 300 / blocks
            print(f"| {label} | {len(body) / blocks:.0f} | {cyc:.1f} | {nbytes / cyc:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cycles per weight block of the group kernels (kernels_rows_{avx2,vnni}.h) for 1-8 tokens, from llvm-mca: a
port-pressure model of one core, no noise from neighbours, and a model of the AVX-512 VNNI host's cores on a host
without AVX-512 (where those kernels cannot run). One token's row is the one-token kernel (dot_kq_shapes.h's
repacked Q4_K gemv, dot_kquants.h's Q5_K and Q6_K vec_dot); its loop may take several blocks (counted from its weight
pointer's step).

    python bench/rows_mca.py [--avx2-cpu znver3] [--vnni-cpu icelake-server] [--src native/simd]

A kernel's cycles for T tokens over its one-token cycles is what T rows cost over one where compute binds them (the
AVX-512 host's 16 threads at decode); where the weight stream binds (few threads) extra rows are cheaper.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "native", "simd"))
sys.path.insert(0, _HERE)
from build import COMPILE_ARGS  # noqa: E402
from ssse3_mca import find_mca, main_loop, tool_args  # noqa: E402

# (label, weight block bytes, tokens, call: n blocks of row w against group kg into os, or one token's y)
KERNELS = [
    ("Q4_K", 144, 1, "return hi_dot_q4_K_rp(n, w, y, 0);"),
    *[("Q4_K", 144, t, f"hi_rows_k4(0, HI_KS_REPACK, {g}, n, w, kg, os); return 0;") for t, g in
      ((2, 2), (3, 3), (4, 4), (8, 8))],
    ("Q5_K", 176, 1, "return hi_dot_q5_K_q8_K(n, w, y);"),
    *[("Q5_K", 176, t, f"hi_rows_k4(1, HI_KS_VEC, {g}, n, w, kg, os); return 0;") for t, g in
      ((2, 2), (3, 3), (4, 4), (8, 8))],
    ("Q6_K", 210, 1, "return hi_dot_q6_K_q8_K(n, w, y);"),
    *[("Q6_K", 210, t, f"hi_rows_q6(0, {g}, n, w, kg, os); return 0;") for t, g in ((2, 2), (3, 3), (4, 4), (8, 8))],
]


def harness(unit: str) -> str:
    out = [f'#include "{unit}"']
    for i, (_, _, t, call) in enumerate(KERNELS):
        if unit == "isa_avx2.c":  # that unit's kernels take 3 tokens as 4 (kernels_rows.h's dispatch)
            call = call.replace(", 3, n,", ", 4, n,")
        out.append(f"__attribute__((noinline, flatten)) float mca_k{i}(int n, const void *w, const void *y, "
                   f"const hi_kgrp *g, float *const *os) {{ hi_kgrp c = *g; c.cnt = {t}; const hi_kgrp *kg = &c; "
                   f"(void)kg; (void)y; (void)os; {call} }}")
    return "\n".join(out) + "\n"


def blocks(body: list[str], nbytes: int) -> int:
    """blocks per loop pass: the step of the pointer that moves by a multiple of the block size"""
    steps = [int(m.group(1)) for x in body if (m := re.search(r"add[ql]\s+\$(\d+),", x))]
    return max([s // nbytes for s in steps if s % nbytes == 0] or [1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--avx2-cpu", default="znver3")
    ap.add_argument("--vnni-cpu", default="icelake-server")
    tool_args(ap)
    a = ap.parse_args(argv)
    mca = find_mca(a)
    if not mca:
        return 2
    print("| unit (-mcpu) | type | tokens | cycles / block | x one token |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for unit, cpu in (("isa_avx2.c", a.avx2_cpu), ("isa_avx512vnni.c", a.vnni_cpu)):
            c, s = os.path.join(d, "h.c"), os.path.join(d, "h.s")
            with open(c, "w") as f:
                f.write(harness(unit))
            subprocess.run([a.cc, *COMPILE_ARGS, "-I", a.src, "-S", "-o", s, c], check=True)
            asm = open(s).read()
            cyc = {}
            for i, (qt, nbytes, t, _) in enumerate(KERNELS):
                if unit == "isa_avx2.c" and qt == "Q6_K" and t == 8:
                    cyc[qt, t] = 2 * cyc[qt, 4]  # two passes of 4 tokens (two loops): their sum
                else:
                    body = main_loop(asm, f"mca_k{i}")
                    loop = os.path.join(d, "loop.s")
                    with open(loop, "w") as f:
                        f.write("\n".join(body) + "\n")
                    r = subprocess.run([mca, f"-mcpu={cpu}", "-iterations=300", loop], capture_output=True,
                                       text=True, check=True).stdout
                    cyc[qt, t] = int(re.search(r"Total Cycles:\s+(\d+)", r).group(1)) / 300 / blocks(body, nbytes)
                print(f"| {unit[4:-2]} ({cpu}) | {qt} | {t} | {cyc[qt, t]:.1f} | {cyc[qt, t] / cyc[qt, 1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

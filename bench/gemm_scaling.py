"""How the SIMD library's float products (native/simd/gemm.c, what the CPU vision tower's weight products run on)
scale with threads, beside numpy's OpenBLAS on its own threads, on the tower's shapes: GFLOP/s of out[M, N] =
x[M, K] Wᵀ, median of `-r` calls after one warm-up, at each thread count.

    python3 bench/gemm_scaling.py [--threads 1,4,8,16] [--shapes 784x4304x1152,784x1152x4304,3072x3456x1152] [-r 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hybridinfer.backends.cpu import blas_threads  # noqa: E402
from hybridinfer.backends.cpu.simd import SimdLib  # noqa: E402


def _median(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--shapes", default="784x4304x1152,784x1152x4304,3072x3456x1152",
                    help="MxNxK products (the 448x448 image's MLP up and down, the 1024x768 image's qkv)")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--isa", default=None)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print("| M x N x K | threads | ours GFLOP/s | OpenBLAS GFLOP/s | ours / OpenBLAS |\n|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        M, N, K = (int(v) for v in shape.split("x"))
        x = rng.standard_normal((M, K), dtype=np.float32)
        w = rng.standard_normal((N, K), dtype=np.float32)
        wt = np.ascontiguousarray(w.T)
        out, ref = np.empty((M, N), np.float32), np.empty((M, N), np.float32)
        flops = 2.0 * M * N * K
        for t in (int(v) for v in a.threads.split(",")):
            lib = SimdLib(isa=a.isa, n_threads=t)
            p = lib.gemm_pack(w)
            ours = 0.0
            if p is not None:
                ours = flops / _median(lambda lib=lib, p=p, x=x, n=N, o=out: lib.gemm(x, p, n, o), a.reps) / 1e9
            lib.close()
            blas = float("nan")
            if blas_threads.available():
                get, put = blas_threads._funcs
                saved = get()
                put(t)
                blas = flops / _median(lambda x=x, wt=wt, o=ref: np.matmul(x, wt, out=o), a.reps) / 1e9
                put(saved)
                time.sleep(0.5)  # OpenBLAS's idle threads spin ~0.1 s after a product: not into the next timing
                err = float(np.abs(out - ref).max() / np.abs(ref).max()) if p is not None else 0.0
                assert err < 1e-4, (shape, t, err)
            print(f"| {shape} | {t} | {ours:.0f} | {blas:.0f} | {ours / blas:.2f} |")


if __name__ == "__main__":
    main()

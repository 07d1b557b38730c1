"""Cost of extra rows in decode's products: GGML_DECODE_ROWS time for 1, 3, 8, 16 rows (a verify step of k+1 rows,
batched decode of B sequences) on a 9B-shaped layer's FFN (hidden 4096, FFN 12288: gate/up Q4_K, down Q6_K, as a
Q4_K_M file mixes them) and on a 35B-A3B-shaped MoE layer's routed experts (256 experts, hidden 2048, FFN 512, k 8;
the rows' union of experts is read). Weights are random blocks made here.

    python bench/rows_cost.py [--isa avx2] [--threads 2] [--rows 1,3,8,16] [--reps 9]

Prints the median ms per call and its ratio to one row's; the MoE line also the union's expert count and ms per
expert (flat when the union's weight bytes, read once, set the time).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hybridinfer.backends.cpu.simd import GGML_DECODE_ROWS, SimdLib
from hybridinfer.backends.cpu.simd_native import act_row_bytes
from hybridinfer.format.quant import Q4_K, Q6_K, random_blocks


def median_ms(fn, args, reps: int) -> float:
    fn(*args)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def _line(name: str, Ts, ms, extra: str = "") -> None:
    cells = "  ".join(f"{T}:{m:7.2f}" for T, m in zip(Ts, ms, strict=True))
    ratios = " ".join(f"{m / ms[0]:.2f}" for m in ms)
    print(f"{name:24} ms {cells}   x one row: {ratios}{extra}", flush=True)


def dense(lib: SimdLib, Ts, reps: int, rng) -> None:
    x = rng.standard_normal((max(Ts), 12288)).astype(np.float32)
    for name, qt, rows, cols in (("Q4_K 12288x4096 (up)", Q4_K, 12288, 4096), ("Q6_K 4096x12288 (down)", Q6_K, 4096,
                                                                                12288)):
        w = random_blocks(qt, rows * cols // 256, rng).reshape(-1)
        xq = lib.quantize(np.ascontiguousarray(x[:, :cols]), qt)
        ms = []
        for T in Ts:
            out = np.zeros((T, rows), np.float32)
            ms.append(median_ms(lib.matmul, (w, qt, rows, cols, xq[:T], out, GGML_DECODE_ROWS), reps))
        _line(name, Ts, ms)


def moe(lib: SimdLib, Ts, reps: int, rng) -> None:
    ne, n_embd, n_ff, k = 256, 2048, 512, 8
    wg, wu = (random_blocks(Q4_K, ne * n_ff * n_embd // 256, rng).reshape(-1) for _ in range(2))
    wd = random_blocks(Q6_K, ne * n_embd * n_ff // 256, rng).reshape(-1)
    xq = lib.quantize(rng.standard_normal((max(Ts), n_embd)).astype(np.float32), Q4_K)
    ms, uni = [], []
    for T in Ts:
        idx = np.stack([rng.choice(ne, k, replace=False) for _ in range(T)]).astype(np.int32)
        n = T * k
        eg, eu = np.zeros((n, n_ff), np.float32), np.zeros((n, n_ff), np.float32)
        hq = np.zeros((n, act_row_bytes(Q6_K, n_ff)), np.uint8)
        ys = np.zeros((n, n_embd), np.float32)
        sc = np.zeros(lib.moe_rows_scratch(n, ne, Q4_K, n_embd), np.uint8)
        ms.append(median_ms(lib.moe_rows, ((wg, Q4_K), (wu, Q4_K), (wd, Q6_K), n_ff, n_embd, xq[:T], idx, eg, eu,
                                              hq, ys, sc, GGML_DECODE_ROWS), reps))
        uni.append(len(np.unique(idx)))
    per = " ".join(f"{m / u:.3f}" for m, u in zip(ms, uni, strict=True))
    _line("MoE experts (union)", Ts, ms, f"   experts {uni}, ms/expert {per}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,3,8,16")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    Ts = [int(t) for t in a.rows.split(",")]
    lib = SimdLib(a.isa, n_threads=a.threads, prefetch=None)
    print(f"{lib.isa}, {lib.n_threads} threads, rows {Ts}")
    rng = np.random.default_rng(0)
    dense(lib, Ts, a.reps, rng)
    moe(lib, Ts, a.reps, rng)
    lib.close()


if __name__ == "__main__":
    main()

"""Speed of GGML_DECODE_ROWS products (B sequences' decode tokens in one pass over the weights, each row in its
one-token float order) over T rows, per weight type, ISA and thread count; with --op mul_mat, of a prompt's
products in llama.cpp's shapes (repacked Q4_K gemm, tiled K-quants) instead.

    python bench/decode_rows_speed.py [--types Q4_K,Q6_K] [--isas avx512vnni,avx2] [--T 1,2,4,8,16]
                                      [--threads 1,2] [--rows 4096 --cols 4096] [--json out.json]

Reports the effective weight GB/s x T: weight bytes x T / time, i.e. token-weight products per second in bytes of
weights (at T = 1 the plain read rate). A kernel that unpacks each weight block once for all T tokens rises with T
until the integer dots bound it; one that repeats the unpacking per token stays flat.

Before / after a change: run it with another build first (say a copy of the package holding the older
_simd*.so, first on PYTHONPATH) with --json old.json, then with this one and --compare old.json.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hybridinfer.backends.cpu.simd import GGML_DECODE_ROWS, GGML_MUL_MAT, GGML_MUL_MAT_ID, GGML_NONE, SimdLib
from hybridinfer.format.quant import F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, random_blocks

OPS = {"decode_rows": GGML_DECODE_ROWS, "mul_mat": GGML_MUL_MAT, "mul_mat_id": GGML_MUL_MAT_ID, "none": GGML_NONE}
TYPES = {"F32": F32, "F16": F16, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q8_0": Q8_0,
         "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}


def _weights(qtype: int, rows: int, cols: int, rng) -> np.ndarray:
    if qtype in (F32, F16):
        return random_blocks(qtype, rows * cols, rng).reshape(-1)
    blk = 256 if qtype in (Q4_K, Q5_K, Q6_K) else 32
    return random_blocks(qtype, rows * cols // blk, rng).reshape(-1)


def time_call(lib: SimdLib, w, qtype, rows, cols, xq, out, min_s: float, op: int = GGML_DECODE_ROWS) -> float:
    """the best time of one call over repetitions lasting about min_s in all"""
    lib.matmul(w, qtype, rows, cols, xq, out, op)  # warm
    best, spent, n = float("inf"), 0.0, 0
    while spent < min_s or n < 3:
        t0 = time.perf_counter()
        lib.matmul(w, qtype, rows, cols, xq, out, op)
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--isas", default="avx512vnni,avx2")
    ap.add_argument("--T", default="1,2,4,8,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--min-s", type=float, default=0.3, help="seconds of repetitions per point")
    ap.add_argument("--op", default="decode_rows", choices=sorted(OPS), help="the ggml op whose float shape the "
                    "products take")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--compare", default=None, help="a --json file of an earlier run: print the speedups over it")
    a = ap.parse_args()
    old = {}
    if a.compare:
        with open(a.compare) as f:
            old = {(r["type"], r["isa"], r["threads"], r["T"]): r["s"] for r in json.load(f)["results"]}
    rng = np.random.default_rng(0)
    Ts = [int(t) for t in a.T.split(",")]
    res = []
    unit = "speedup over --compare" if old else "ms per call"
    op = OPS[a.op]
    print(f"{a.rows}x{a.cols}, {a.op}: effective weight GB/s x T ({unit})")
    print(f"{'type':6} {'isa':11} {'thr':>3} " + " ".join(f"{'T=' + str(t):>16}" for t in Ts))
    for tname in a.types.split(","):
        qtype = TYPES[tname]
        w = _weights(qtype, a.rows, a.cols, rng)
        x = (rng.standard_normal((max(Ts), a.cols)) * rng.uniform(0.1, 10, (max(Ts), 1))).astype(np.float32)
        for isa in a.isas.split(","):
            for nth in (int(n) for n in a.threads.split(",")):
                lib = SimdLib(isa, n_threads=nth, prefetch=0)
                xq = lib.quantize(x, qtype)
                cells = []
                for T in Ts:
                    out = np.zeros((T, a.rows), np.float32)
                    dt = time_call(lib, w, qtype, a.rows, a.cols, xq[:T], out, a.min_s, op)
                    gbs = w.nbytes * T / dt / 1e9
                    res.append({"type": tname, "isa": isa, "threads": nth, "T": T, "s": dt, "gbs_x_T": gbs})
                    was = old.get((tname, isa, nth, T))
                    cells.append(f"{gbs:7.2f} ({dt * 1e3:6.2f})" if was is None else f"{gbs:7.2f} (x{was / dt:4.2f})")
                lib.close()
                print(f"{tname:6} {isa:11} {nth:>3} " + " ".join(cells), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": a.rows, "cols": a.cols, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()

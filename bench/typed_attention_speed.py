"""One decode row of attention over a typed K/V cache (the 35B-A3B's shape: 16 query heads on 2 K/V heads of 256), at
several context lengths: the milliseconds of one attn_step (best of a few rounds, wall and this process's CPU time:
on a shared machine the CPU time is the steadier), per cache type.

    PYTHONPATH=. python bench/typed_attention_speed.py [--threads 2] [--types q8_0,f16,q4_0,lm4] [--n 1024,8192,32768]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hybridinfer.backends.cpu.simd import SimdLib
from hybridinfer.format.quant_types import cache_row, cache_type

ROTATED = ("q8_0", "q4_0", "lm3", "lm4")  # rotated as the engine rotates them (the op's cost is the same either way)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="q8_0,f16,q4_0,lm4")
    ap.add_argument("--n", default="1024,8192,32768", help="context lengths (positions)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--heads", default="16,2,256", help="query heads, K/V heads, head dim")
    args = ap.parse_args()
    H, Hkv, hd = (int(x) for x in args.heads.split(","))
    lib = SimdLib(n_threads=args.threads)
    rng = np.random.default_rng(0)
    print(f"{lib.isa}, {args.threads} threads, {H} heads on {Hkv}, hd {hd}")
    for kt in args.types.split(","):
        K = cache_type(kt).id
        kd, kr = cache_row(K, hd)
        for n in (int(x) for x in args.n.split(",")):
            kc, vc = np.zeros((n, Hkv, kr), kd), np.zeros((n, Hkv, kr), kd)
            for c in (kc, vc):  # small bytes: finite scales and values for every type
                c.view(np.uint8)[:] = rng.integers(0, 60, c.view(np.uint8).shape, dtype=np.uint8)
            scratch = np.zeros(lib.attention_scratch_size(n, hd, H // Hkv), np.float32)
            q = rng.standard_normal((1, H, hd)).astype(np.float32)
            k = rng.standard_normal((1, Hkv, hd)).astype(np.float32)
            out = np.zeros((1, H * hd), np.float32)
            rk, rv = (hd, 64) if kt in ROTATED else (0, 0)

            call = (k, k, kc, vc, n - 1, out, scratch, 2, 1.0e4, True, np.zeros(0, np.float32), 1, K, K, rk, rv)
            lib.attn_step(q.copy(), *call)
            reps = max(2, 20000 // n)
            wall = cpu = float("inf")
            for _ in range(args.rounds):
                t, c = time.perf_counter(), time.process_time()
                for _ in range(reps):
                    lib.attn_step(q.copy(), *call)
                wall = min(wall, (time.perf_counter() - t) / reps)
                cpu = min(cpu, (time.process_time() - c) / reps)
            print(f"{kt:5s} n={n:6d}: wall {wall * 1e3:7.2f} ms  cpu {cpu * 1e3:7.2f} ms  "
                  f"({(kc.nbytes + vc.nbytes) / wall / 1e9:.1f} GB/s of K/V)", flush=True)


if __name__ == "__main__":
    main()

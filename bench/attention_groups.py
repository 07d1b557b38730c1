"""CPU attention over a long cache with and without the query heads of one K/V head computed together.

For each head layout and query count T: attn_step (GGML_DECODE_ROWS) at position 2,000 of a 4,096-row cache, with
scratch for one row at a time (group 1) and for the heads of a K/V head together (group H / H_kv); the time per
call and per query row.

    python bench/attention_groups.py [-t THREADS] [--isa ISA]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    from hybridinfer.backends.cpu.simd import GGML_DECODE_ROWS, SimdLib

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--pos", type=int, default=2000)
    a = ap.parse_args()
    lib = SimdLib(a.isa, n_threads=a.threads)
    print(f"ISA {lib.isa}, cache position {a.pos}\n")
    print("| H / H_kv / head dim | T | group | ms per call | us per query row |")
    print("|---|---|---|---|---|")
    n_ctx, none = 4096, np.zeros(0, np.float32)
    for H, Hkv, hd in ((9, 3, 64), (8, 2, 256), (16, 2, 256)):
        rng = np.random.default_rng(0)
        K = rng.standard_normal((n_ctx, Hkv, hd), dtype=np.float32)
        V = rng.standard_normal((n_ctx, Hkv, hd), dtype=np.float32)
        for T in (1, 16, 64):
            q = rng.standard_normal((T, H, hd), dtype=np.float32)
            k = rng.standard_normal((T, Hkv, hd), dtype=np.float32)
            out = np.zeros((T, H * hd), np.float32)
            for group in sorted({1, H // Hkv}):
                scratch = np.zeros(lib.attention_scratch_size(n_ctx, hd, group), np.float32)

                args = (k, k, K, V, a.pos, out, scratch, hd, 10000.0, False, none, GGML_DECODE_ROWS)
                lib.attn_step(q.copy(), *args)
                t0, n = time.perf_counter(), 5
                for _ in range(n):
                    lib.attn_step(q.copy(), *args)
                dt = (time.perf_counter() - t0) / n
                print(f"| {H} / {Hkv} / {hd} | {T} | {group} | {dt * 1e3:.2f} | {dt / (T * H) * 1e6:.1f} |")
    lib.close()


if __name__ == "__main__":
    main()

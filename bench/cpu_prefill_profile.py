"""Where a CPU prefill's time goes: one prompt of T tokens through the CPU backend under cProfile, the native calls'
own time per entry point (products, the GDN layer, attention, norms...) and the Python share.

    python bench/cpu_prefill_profile.py MODEL.gguf [-T 512] [-t THREADS] [--isa ISA]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from hybridinfer.api import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-T", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--isa", default=None)
    a = ap.parse_args()
    eng = Engine.load(a.model, backend="cpu", n_threads=a.threads, n_ctx=a.T + 8, prefill_chunk=a.T, isa=a.isa)
    be = eng.backend
    ids = np.random.default_rng(0).integers(0, min(eng.args.n_vocab, 32000), a.T).tolist()
    be.forward(ids[:16], be.new_state(a.T + 8), all_logits=False)
    st = be.new_state(a.T + 8)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    be.forward(ids, st, all_logits=False)
    pr.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(pr).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    native = {k[2].split(".")[-1].rstrip(">"): v for k, v in stats.items() if k[0] == "~" and "hi_" in k[2]}
    total_native = sum(v[2] for v in native.values())
    print(f"{a.T} tokens in {wall:.3f} s ({a.T / wall:.1f} tok/s), {be.simd.n_threads} threads, ISA {be.simd.isa}")
    print("| native call | calls | s | share of wall |\n|---|---|---|---|")
    for name, v in sorted(native.items(), key=lambda kv: -kv[1][2]):
        print(f"| {name} | {v[1]} | {v[2]:.3f} | {v[2] / wall:.1%} |")
    print(f"| (Python and the rest) | | {wall - total_native:.3f} | {(wall - total_native) / wall:.1%} |")


if __name__ == "__main__":
    main()

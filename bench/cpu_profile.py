"""Where the CPU backend's time goes, under cProfile: the native calls' own time per entry point (products, the GDN
layer, attention, norms...) and the Python share, for one prompt of T tokens (prefill) or, with --batch B, for
--steps decode steps of B sequences at once (decode_batch).

    python bench/cpu_profile.py MODEL.gguf [-T 512] [-t THREADS] [--isa ISA] [--batch B --steps N]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from hybridinfer.engine.api import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-T", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--batch", type=int, default=0, help="profile decode_batch of this many sequences instead")
    ap.add_argument("--steps", type=int, default=8, help="decode steps profiled (--batch)")
    a = ap.parse_args()
    n_ctx = a.T + a.steps + 8
    eng = Engine.load(a.model, backend="cpu", n_threads=a.threads, n_ctx=n_ctx, prefill_chunk=a.T, isa=a.isa)
    be = eng.backend
    rng = np.random.default_rng(0)
    vocab = min(eng.args.n_vocab, 32000)
    ids = rng.integers(0, vocab, a.T).tolist()
    be.forward(ids[:16], be.new_state(n_ctx), all_logits=False)
    if a.batch:
        states = [be.new_state(n_ctx) for _ in range(a.batch)]
        for st in states:
            be.forward(rng.integers(0, vocab, 16).tolist(), st, all_logits=False)
        toks = [int(t) for t in rng.integers(0, vocab, a.batch)]
        be.decode_batch(toks, states)
        run = lambda: [be.decode_batch(toks, states) for _ in range(a.steps)]  # noqa: E731
        what = f"{a.steps} decode steps of {a.batch} sequences"
    else:
        st = be.new_state(n_ctx)
        run = lambda: be.forward(ids, st, all_logits=False)  # noqa: E731
        what = f"{a.T} prompt tokens"
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    run()
    pr.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(pr).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    native = {k[2].split(".")[-1].rstrip(">"): v for k, v in stats.items() if k[0] == "~" and "hi_" in k[2]}
    total_native = sum(v[2] for v in native.values())
    n = a.batch * a.steps if a.batch else a.T
    print(f"{what} in {wall:.3f} s ({n / wall:.1f} tok/s), {be.simd.n_threads} threads, ISA {be.simd.isa}")
    print("| native call | calls | s | share of wall |\n|---|---|---|---|")
    for name, v in sorted(native.items(), key=lambda kv: -kv[1][2]):
        print(f"| {name} | {v[1]} | {v[2]:.3f} | {v[2] / wall:.1%} |")
    print(f"| (Python and the rest) | | {wall - total_native:.3f} | {(wall - total_native) / wall:.1%} |")
    py = sorted(((v[2], k) for k, v in stats.items() if k[0] != "~"), reverse=True)[:8]
    print("Python functions by own time: " + ", ".join(f"{k[2]} ({k[0].split('/')[-1]}:{k[1]}) {t:.3f}s"
                                                       for t, k in py))


if __name__ == "__main__":
    main()

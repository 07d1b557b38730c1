"""GPU time of one prefill pass by kernel: events around every launch, summed by kernel name.

    python3 bench/gpu_kernel_profile.py -m model.gguf [--tokens 947] [--vram-budget 6GiB]

Events add a little time per launch, so the total is a bit above an unprofiled pass; the split is what
this is for. With no -m, a 4-layer model of the 35B-A3B shape (3 GDN + 1 attention layer, Q4_K_M) is
synthesized into /tmp first.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--tokens", type=int, default=947)
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--chunk", type=int, default=None, help="tokens per kernel call (GPUModel chunk)")
    ap.add_argument("--card-profile", default=None, help="run the kernels as on this card class (e.g. fermi)")
    ap.add_argument("--host", action="store_true", help="also profile the host side of a pass (cProfile)")
    a = ap.parse_args(argv)

    import pycuda.driver as drv

    from hybridinfer.backends.gpu import loader
    from hybridinfer.backends.gpu.backend import GPUModel
    from hybridinfer.cli import parse_size
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args

    path = a.model
    if not path:
        from hybridinfer.tools.synth import synth_model

        path = "/tmp/m35-4layer.gguf"
        if not os.path.exists(path):
            synth_model(path, "qwen35moe", {"base": "35b-a3b", "n_layer": 4}, quant="q4_k_m", seed=1)
    gm = GGUFModel(path)
    args = model_args(gm)
    kw = {"chunk": a.chunk} if a.chunk else {}
    if a.card_profile:
        kw["card_profile"] = a.card_profile
    m = GPUModel(gm, args, a.tokens + 8, vram_budget=parse_size(a.vram_budget) if a.vram_budget else None, **kw)
    ids = [int(x) for x in np.random.default_rng(0).integers(0, args.n_vocab, a.tokens)]
    m.forward(ids, m.new_state(a.tokens + 8), all_logits=False)  # compile and warm up

    if a.host:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        m.forward(ids, m.new_state(a.tokens + 8), all_logits=False)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(15)
    marks = []
    real = loader.launch

    def timed(family, name, grid, block, args_, shared=0, stream=None):
        e0, e1 = drv.Event(), drv.Event()
        e0.record(stream)
        real(family, name, grid, block, args_, shared=shared, stream=stream)
        e1.record(stream)
        marks.append((name, e0, e1))

    loader.launch = timed
    try:
        m.forward(ids, m.new_state(a.tokens + 8), all_logits=False)
    finally:
        loader.launch = real
    t = m.last_timing
    by = defaultdict(lambda: [0.0, 0])
    for name, e0, e1 in marks:
        by[name][0] += e1.time_since(e0) / 1e3
        by[name][1] += 1
    total = sum(v[0] for v in by.values())
    print(f"{path}: {a.tokens} tokens, {args.n_layer} layers; wall {t['wall_s'] * 1e3:.1f} ms, GPU span "
          f"{t['gpu_s'] * 1e3:.1f} ms, kernels {total * 1e3:.1f} ms in {len(marks)} launches")
    print("| kernel | calls | ms | % of kernel time | us per call |")
    print("|---|---|---|---|---|")
    for name, (s, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"| {name} | {n} | {s * 1e3:.2f} | {100 * s / total:.1f} | {s / n * 1e6:.1f} |")


if __name__ == "__main__":
    main()

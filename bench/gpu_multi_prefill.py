"""Several prompts in one streamed GPU pass against one pass per prompt (issue 20's GPU figure).

For each workload (COUNTxLENGTH, e.g. 8x128 and 4x947): random prompts prefilled one pass each, then all in one pass
(Backend.prefill_many), a few rounds of each alternating; prompt tokens/s of both, the ratio, and the bytes streamed
host-to-device per pass beside the transfer floor (those bytes at the pinned bandwidth the streamer measured).

    python3 bench/gpu_multi_prefill.py -m m35.gguf --vram-budget 6GiB --workloads 8x128,4x947 [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    from hybridinfer.cli.args import parse_size
    from hybridinfer.engine.api import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--vram-budget", type=parse_size, default=parse_size("6GiB"))
    ap.add_argument("--workloads", default="8x128,4x947")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()
    work = [tuple(int(v) for v in w.split("x")) for w in a.workloads.split(",")]
    n_ctx = max(c * n for c, n in work) + 16
    eng = Engine.load(a.model, backend="gpu", n_ctx=n_ctx, vram_budget=a.vram_budget, n_threads=a.threads,
                      max_seqs=max(c for c, _ in work))
    be, gpu = eng.backend, eng.backend.gpu
    rng = np.random.default_rng(0)
    be.forward([int(t) for t in rng.integers(0, eng.args.n_vocab, 64)], eng.new_state())  # kernels compiled
    rows = []
    for count, length in work:
        prompts = [[int(t) for t in rng.integers(0, eng.args.n_vocab, length)] for _ in range(count)]
        one, many, bytes_one, bytes_many = [], [], 0, 0
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for p in prompts:
                gpu.forward(p, eng.new_state(), all_logits=False)
            one.append(time.perf_counter() - t0)
            bytes_one = gpu.last_timing["bytes_h2d"] * count
            t0 = time.perf_counter()
            be.prefill_many([(p, eng.new_state(), (), None) for p in prompts])
            many.append(time.perf_counter() - t0)
            bytes_many = gpu.last_timing["bytes_h2d"]
        # the same through the public API, as a user runs it: one request at a time (Engine.generate), then all at
        # once (Engine.generate_batch: the scheduler admits them together into one pass); one token each
        api_one, api_many = [], []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for p in prompts:
                eng.generate(p, max_tokens=1, temperature=0)
            api_one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.generate_batch(prompts, max_tokens=1, temperature=0)
            api_many.append(time.perf_counter() - t0)
        tok = count * length
        rows.append({"workload": f"{count}x{length}", "tokens": tok, "api_one_at_a_time_s": min(api_one),
                     "api_generate_batch_s": min(api_many), "api_speedup": min(api_one) / min(api_many),
                     "one_pass_each_s": min(one),
                     "one_pass_s": min(many), "one_pass_each_tok_s": tok / min(one), "one_pass_tok_s": tok / min(many),
                     "speedup": min(one) / min(many), "h2d_gb_one_pass_each": bytes_one / 1e9,
                     "h2d_gb_one_pass": bytes_many / 1e9})
    print(f"model `{a.model}`; --vram-budget {a.vram_budget / 2**30:.1f} GiB; best of {a.rounds} rounds\n")
    print("| prompts | one pass per prompt: s, tok/s | one pass for all: s, tok/s | speedup | H2D GB (each / one) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['one_pass_each_s']:.3f}, {r['one_pass_each_tok_s']:.0f} | "
              f"{r['one_pass_s']:.3f}, {r['one_pass_tok_s']:.0f} | {r['speedup']:.2f}x | "
              f"{r['h2d_gb_one_pass_each']:.1f} / {r['h2d_gb_one_pass']:.1f} |")
    print("\nThrough the public API (one token each):\n")
    print("| prompts | Engine.generate one at a time: s, tok/s | Engine.generate_batch: s, tok/s | speedup |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['api_one_at_a_time_s']:.3f}, {r['tokens'] / r['api_one_at_a_time_s']:.0f} | "
              f"{r['api_generate_batch_s']:.3f}, {r['tokens'] / r['api_generate_batch_s']:.0f} | "
              f"{r['api_speedup']:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Batched decode through `Engine.generate_batch` with the file's MTP drafts on (the default) and off, measured on
two engines loaded side by side and run in turn, so a shared host's drift falls on both alike (two runs one after the
other differed by 7-15% on the 16-core host with no change between them).

    python bench/spec_batch_pair.py -m model.gguf -t 16 [--batch-sizes 1,8,16] [-n 32] [--rounds 4]

Per round and engine: `tools/benchmarks/batch_api.measure_api` (greedy, random 32-token prompts, n new tokens each,
end-of-generation masked); prints each round's all-decoding tok/s (every request decoding, as llama-batched-bench's
S_TG) and their median per engine and B, and the drafted and accepted counts.
"""

from __future__ import annotations

import argparse
import statistics

from hybridinfer.engine.api import Engine
from hybridinfer.tools.benchmarks.batch_api import measure_api


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,8,16")
    ap.add_argument("-n", type=int, default=32, help="new tokens per request (default: 32)")
    ap.add_argument("--rounds", type=int, default=4, help="runs of each engine, in turn (default: 4)")
    a = ap.parse_args(argv)
    sizes = tuple(int(x) for x in a.batch_sizes.split(","))
    engines = {label: Engine.load(a.model, backend="cpu", n_threads=a.threads, n_ctx=32 + a.n + 8, max_seqs=max(sizes),
                                  spec_type=spec) for label, spec in (("drafts off", "none"), ("default", None))}
    got: dict = {(label, B): [] for label in engines for B in sizes}
    try:
        for r in range(a.rounds):
            order = list(engines.items())
            for label, eng in order if r % 2 == 0 else order[::-1]:
                for row in measure_api(eng, sizes, a.n, 32, seed=r):
                    got[(label, row["batch"])].append(row["steady_tok_s"])
        print("| engine | B | all-decoding tok/s, each round | median |")
        print("|---|---|---|---|")
        for (label, B), v in got.items():
            seen = [x for x in v if x is not None]
            med = f"{statistics.median(seen):.1f}" if seen else "-"
            print(f"| {label} | {B} | {', '.join(f'{x:.1f}' for x in seen)} | {med} |")
        for label, eng in engines.items():
            if eng.spec is not None:
                print(f"{label}: {eng.spec.drafter.name} drafted {eng.spec.drafted}, accepted {eng.spec.accepted}")
    finally:
        for eng in engines.values():
            eng.close()


if __name__ == "__main__":
    main()

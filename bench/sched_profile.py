"""Where a scheduler run's time goes (prefill, restores, the recorded decode steps, sampling, Python), under
cProfile on the calling thread: N chat requests sharing a system prompt of about S tokens, max_tokens M, greedy.

    python bench/sched_profile.py MODEL.gguf [-t THREADS] [-n 24] [-S 2000] [-M 64] [--max-seqs 8]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main() -> None:
    from hybridinfer.engine.api import Engine
    from hybridinfer.engine.scheduler import Scheduler
    from hybridinfer.tools.benchmarks.serve import system_prompt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("-S", type=int, default=2000)
    ap.add_argument("-M", type=int, default=64)
    ap.add_argument("--max-seqs", type=int, default=8)
    a = ap.parse_args()
    eng = Engine.load(a.model, backend="cpu", n_threads=a.threads, n_ctx=a.S + 512, prefix_cache=True,
                      snapshot_stride=0, max_seqs=a.max_seqs)
    system = system_prompt(a.S)
    msgs = lambda i: [{"role": "system", "content": system},  # noqa: E731
                      {"role": "user", "content": f"Question {i}: what is {i} times {i + 3}, and why?"}]
    eng.generate_batch([{"messages": msgs(-1), "max_tokens": 2}])  # warm: kernels, workspaces, the system prompt
    sched = Scheduler(eng, max_seqs=a.max_seqs, worker=False)
    reqs = [eng.make_request(eng.chat_prompt(msgs(i)), a.M, temperature=0) for i in range(a.n)]
    for r in reqs:
        r.keep_ends = False
    sched.submit_many(reqs)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    steps = 0
    while not sched.idle():
        sched.step()
        steps += 1
    pr.disable()
    wall = time.perf_counter() - t0
    print(f"{a.n} requests, {steps} steps in {wall:.2f} s ({a.n * a.M / wall:.1f} generated tok/s at most)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()

"""Where the long token gaps of a serving load come from, per scheduler step: an agent-like load on the Engine (C
conversations of T turns on a shared ~S-token system prompt, each turn's history sent again, max_tokens M, greedy,
up to --max-seqs at once), every step's phases timed (restores, prompt chunks, first samples, the decode, the
end-of-reply snapshots, the prefix cache's flush) and every running sequence's token gaps counted in steps' time.

    python bench/itl_probe.py MODEL.gguf [-t THREADS] [-C 8] [-T 3] [-S 2000] [-M 48] [--max-seqs 8]

Prints the token-gap p50 / p99 (what a client would see with no text held back), the steps behind the gaps above
the p99, and their phases."""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict


def percentile(xs, q):
    import numpy as np

    return float(np.percentile(xs, q)) if xs else float("nan")


def trace(sched) -> dict:
    """Wrap the scheduler's phases so each step records their seconds and the token times of every sequence."""
    rec = {"steps": [], "tok": defaultdict(list)}
    cur: dict = {}

    def timed(name, fn):
        def wrap(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[name] = cur.get(name, 0.0) + time.perf_counter() - t
        return wrap

    eng = sched.engine
    if eng.spec is not None:
        for name in ("drafts", "verify"):
            setattr(eng.spec, name, timed("spec." + name, getattr(eng.spec, name)))
    eng.decode_step = timed("decode_step", eng.decode_step)
    eng.new_state = timed("restore.new_state", eng.new_state)  # a restore's parts: the state, the prefix's copy
    eng.restore = timed("restore.copy", eng.restore)
    for name in ("_restore", "_decode", "_flush_cache", "_complete", "_admit"):
        setattr(sched, name, timed(name, getattr(sched, name)))
    pre = sched._prefill_steps

    def pre_wrap(plan):
        chunks = [(x.state.pos, sched.engine.chunk_len(x.work, b)) for x, b in plan]
        guess = sched._cost.seconds(chunks)
        t = time.perf_counter()
        out = pre(plan)
        cur["predicted"] = guess
        cur["took"] = time.perf_counter() - t
        cur["limit"] = cur.get("limit_s")
        return out
    sched._prefill_steps = pre_wrap
    import hybridinfer.engine.scheduler as sch

    budget = sch.prompt_budget

    def budget_wrap(*a, **k):
        out = budget(*a, **k)
        cur["limit_s"] = out[1]
        return out
    sch.prompt_budget = budget_wrap
    sample = sched._sample

    def sample_wrap(s):
        out = sample(s)
        rec["tok"][id(s)].append(time.perf_counter())
        return out
    sched._sample = timed("_sample", sample_wrap)
    step = sched._step

    def step_wrap():
        cur.clear()
        t = time.perf_counter()
        before = len(sched._running)
        step()
        rec["steps"].append((t, time.perf_counter(), dict(cur), before))
    sched._step = step_wrap
    return rec


def main() -> None:
    from hybridinfer.engine.api import Engine
    from hybridinfer.tools.benchmarks.serve import PROMPTS, USER_TURNS, system_prompt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-C", type=int, default=8)
    ap.add_argument("-T", type=int, default=3)
    ap.add_argument("-S", type=int, default=2000)
    ap.add_argument("-M", type=int, default=48)
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--step-tokens", type=int, default=None)
    ap.add_argument("--chat", action="store_true", help="short chat prompts instead (bench serve's chat load)")
    ap.add_argument("--stall", type=float, default=None, help="compute.STALL for this run")
    ap.add_argument("--cold", action="store_true", help="no Engine.warm_states before the load (the server warms)")
    a = ap.parse_args()
    if a.stall is not None:
        import hybridinfer.engine.scheduler as sch

        base = sch.prompt_budget
        sch.prompt_budget = lambda t, r, d: base(t, r, d, stall=a.stall)
    kw = {} if a.step_tokens is None else {"step_tokens": a.step_tokens}
    eng = Engine.load(a.model, backend="cpu", n_threads=a.threads, n_ctx=a.S + 2048, prefix_cache=True,
                      max_seqs=a.max_seqs, **kw)
    if not a.cold:
        from hybridinfer.serving.serve.service import WARM_ROWS

        eng.warm_states(min(eng.n_ctx, WARM_ROWS))
    system = system_prompt(a.S)
    eng.generate([{"role": "system", "content": system}, {"role": "user", "content": "hi"}], max_tokens=2)
    rec = trace(eng.scheduler)

    def conv(i: int) -> None:
        if a.chat:
            for t in range(a.T):
                eng.generate([{"role": "user", "content": PROMPTS[(i * a.T + t) % len(PROMPTS)]}], max_tokens=a.M,
                             temperature=0)
            return
        msgs = [{"role": "system", "content": system}]
        for t in range(a.T):
            msgs.append({"role": "user", "content": f"[{i}] " + USER_TURNS[(i + t) % len(USER_TURNS)]})
            g = eng.generate(msgs, max_tokens=a.M, temperature=0)
            msgs.append({"role": "assistant", "content": g.text})

    t0 = time.perf_counter()
    th = [threading.Thread(target=conv, args=(i,)) for i in range(a.C)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    wall = time.perf_counter() - t0
    gaps = [(b - a_) for ts in rec["tok"].values() for a_, b in zip(ts, ts[1:], strict=False)]
    steps = rec["steps"]
    dur = [e - s for s, e, _, _ in steps]
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    print(f"{a.C} x {a.T} turns, {len(steps)} steps in {wall:.1f} s; token gaps {len(gaps)}: p50 {p50 * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms ({p99 / p50:.2f}x); step p50 {percentile(dur, 50) * 1e3:.1f} ms")
    slow = sorted((s for s in steps if s[3]), key=lambda s: s[0] - s[1])[: max(3, len(steps) // 50)]
    print("slowest steps with sequences decoding (ms): total | phases | decoding before")
    for s, e, ph, n in slow:
        print(f"  {(e - s) * 1e3:7.1f} | " + " ".join(f"{k.strip('_')}={v * 1e3:.1f}" for k, v in sorted(ph.items())
                                                   if v and v > 5e-4) + f" | {n}")
    tot = defaultdict(float)
    for _, _, ph, _ in steps:
        for k, v in ph.items():
            tot[k] += v or 0.0
    print("phase totals (s): " + " ".join(f"{k.strip('_')}={v:.2f}" for k, v in sorted(tot.items())))
    eng.close()


if __name__ == "__main__":
    main()

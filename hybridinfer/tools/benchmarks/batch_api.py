"""Batched decode through the public API, as a user runs it: B requests given to Engine.generate_batch at once
(greedy, random prompts of prompt_len tokens, exactly n_steps new tokens each: end-of-generation masked), timed
from the call to its return. Reported beside `bench batch`'s backend rows, so the cost of the scheduler (sampling,
text, per-sequence Python, prompt admission) shows as the gap between the two."""

from __future__ import annotations

import time

import numpy as np


class NoEnd:
    """A constraint that forbids the tokens that end a generation: every request runs to max_tokens. It also notes
    when each token is accepted (`times`), which is when its request's sampler took it."""

    def __init__(self, stop_ids):
        self.stop = np.array(sorted(set(int(t) for t in stop_ids)), np.int64)
        self.times: list[float] = []

    def mask(self, logits) -> None:
        logits[self.stop] = -np.inf

    def accept(self, token: int) -> bool:
        self.times.append(time.perf_counter())
        return True


def all_decoding_tok_s(times: list[list[float]]) -> float | None:
    """Tokens per second while every request decodes, from the step that gave the last request its first token to
    the step that gave the first request to end its last, as llama-batched-bench's S_TG (all prompts processed
    first); with chunked prefill a request's own decode window also holds the steps that prefilled the others.
    A scheduler step takes its requests' tokens back to back, so tokens closer than a quarter of a request's median
    gap between tokens are one step's. None when no step lies past the window's start."""
    if not times or any(not t for t in times):
        return None
    gaps = [b - a for t in times for a, b in zip(t, t[1:], strict=False)]
    if not gaps:
        return None
    near = 0.25 * float(np.median(gaps))
    flat = sorted(x for t in times for x in t)
    steps, last = [[flat[0]]], flat[0]  # a step: its tokens' times
    for x in flat[1:]:
        if x - last > near:
            steps.append([])
        steps[-1].append(x)
        last = x
    def step_of(x: float) -> int:
        return next(i for i, st in enumerate(steps) if st[0] <= x <= st[-1])
    i0, i1 = max(step_of(t[0]) for t in times), min(step_of(t[-1]) for t in times)
    if i1 <= i0:
        return None
    n = sum(len(st) for st in steps[i0 + 1 : i1 + 1])
    return n / max(steps[i1][-1] - steps[i0][-1], 1e-12)


def measure_api(engine, batch_sizes=(1, 2, 4, 8, 16), n_steps: int = 32, prompt_len: int = 32,
                seed: int = 0) -> list[dict]:
    """For each B: one warm-up call (B requests, 2 tokens), then one timed generate_batch of B requests. Row:
    wall seconds, tok/s (B * n_steps over the wall), decode tok/s (tokens after each request's first over the
    longest decode window: prefill excluded), steady tok/s (all_decoding_tok_s), mean prefill seconds, x vs B=1.
    The engine's max_seqs must be at least max(batch_sizes), its n_ctx at least prompt_len + n_steps."""
    vocab = min(engine.args.n_vocab, 32000)
    end = NoEnd(getattr(engine.tokenizer, "stop_ids", ()))
    rows = []
    for B in batch_sizes:
        rng = np.random.default_rng([seed, B, 7])
        prompts = [[int(x) for x in rng.integers(3, vocab, prompt_len)] for _ in range(B)]
        engine.generate_batch([{"prompt": p, "max_tokens": 2} for p in prompts], temperature=0, constraint=end)
        prompts = [[int(x) for x in rng.integers(3, vocab, prompt_len)] for _ in range(B)]  # not cached
        ends = [NoEnd(end.stop) for _ in prompts]
        t0 = time.perf_counter()
        gens = engine.generate_batch([{"prompt": p, "constraint": e} for p, e in zip(prompts, ends, strict=True)],
                                     max_tokens=n_steps, temperature=0)
        wall = time.perf_counter() - t0
        n = sum(len(g.tokens) for g in gens)
        dec = max(g.timings["decode_s"] for g in gens)
        rows.append({"batch": B, "seconds": wall, "tokens": n, "tok_s": n / wall,
                     "decode_tok_s": (n - B) / dec if dec > 0 else None,
                     "steady_tok_s": all_decoding_tok_s([e.times for e in ends]),
                     "prefill_s": float(np.mean([g.timings["prefill_s"] for g in gens]))})
    base = next((r for r in rows if r["batch"] == 1), None)
    for r in rows:
        r["speedup"] = r["tok_s"] / base["tok_s"] if base else None
        r["decode_speedup"] = (r["decode_tok_s"] / base["decode_tok_s"]
                               if base and base["decode_tok_s"] and r["decode_tok_s"] else None)
        r["steady_speedup"] = (r["steady_tok_s"] / base["steady_tok_s"]
                               if base and base["steady_tok_s"] and r["steady_tok_s"] else None)
    return rows


def markdown(rows: list[dict], prompt_len: int, n_steps: int) -> str:
    out = [f"Through `Engine.generate_batch` (B requests at once, greedy, {prompt_len}-token prompts, {n_steps} new "
           "tokens each, timed from call to return; decode tok/s leaves out each request's prefill; all-decoding "
           "tok/s is over the window where every request decodes, as llama-batched-bench's S_TG):", "",
           "| B | wall s | tok/s | x vs B=1 | decode tok/s | x vs B=1 | all-decoding tok/s | x vs B=1 | "
           "mean prefill s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = (lambda x, s="": "" if x is None else f"{x:.2f}{s}")  # noqa: E731
        out.append(f"| {r['batch']} | {r['seconds']:.2f} | {r['tok_s']:.2f} | {f(r['speedup'], 'x')} | "
                   f"{f(r['decode_tok_s'])} | {f(r['decode_speedup'], 'x')} | {f(r.get('steady_tok_s'))} | "
                   f"{f(r.get('steady_speedup'), 'x')} | {r['prefill_s']:.3f} |")
    return "\n".join(out)

"""Batched decode through the public API, as a user runs it: B requests given to Engine.generate_batch at once
(greedy, random prompts of prompt_len tokens, exactly n_steps new tokens each: end-of-generation masked), timed
from the call to its return. Reported beside `bench batch`'s backend rows, so the cost of the scheduler (sampling,
text, per-sequence Python, prompt admission) shows as the gap between the two."""

from __future__ import annotations

import time

import numpy as np


class NoEnd:
    """A constraint that forbids the tokens that end a generation: every request runs to max_tokens."""

    def __init__(self, stop_ids):
        self.stop = np.array(sorted(set(int(t) for t in stop_ids)), np.int64)

    def mask(self, logits) -> None:
        logits[self.stop] = -np.inf

    def accept(self, token: int) -> bool:
        return True


def measure_api(engine, batch_sizes=(1, 2, 4, 8, 16), n_steps: int = 32, prompt_len: int = 32,
                seed: int = 0) -> list[dict]:
    """For each B: one warm-up call (B requests, 2 tokens), then one timed generate_batch of B requests. Row:
    wall seconds, tok/s (B * n_steps over the wall), decode tok/s (tokens after each request's first over the
    longest decode window: prefill excluded), mean prefill seconds, x vs B=1. The engine's max_seqs must be at
    least max(batch_sizes), its n_ctx at least prompt_len + n_steps."""
    vocab = min(engine.args.n_vocab, 32000)
    end = NoEnd(getattr(engine.tokenizer, "stop_ids", ()))
    rows = []
    for B in batch_sizes:
        rng = np.random.default_rng([seed, B, 7])
        prompts = [[int(x) for x in rng.integers(3, vocab, prompt_len)] for _ in range(B)]
        engine.generate_batch([{"prompt": p, "max_tokens": 2} for p in prompts], temperature=0, constraint=end)
        prompts = [[int(x) for x in rng.integers(3, vocab, prompt_len)] for _ in range(B)]  # not cached
        t0 = time.perf_counter()
        gens = engine.generate_batch([{"prompt": p} for p in prompts], max_tokens=n_steps, temperature=0,
                                     constraint=end)
        wall = time.perf_counter() - t0
        n = sum(len(g.tokens) for g in gens)
        dec = max(g.timings["decode_s"] for g in gens)
        rows.append({"batch": B, "seconds": wall, "tokens": n, "tok_s": n / wall,
                     "decode_tok_s": (n - B) / dec if dec > 0 else None,
                     "prefill_s": float(np.mean([g.timings["prefill_s"] for g in gens]))})
    base = next((r for r in rows if r["batch"] == 1), None)
    for r in rows:
        r["speedup"] = r["tok_s"] / base["tok_s"] if base else None
        r["decode_speedup"] = (r["decode_tok_s"] / base["decode_tok_s"]
                               if base and base["decode_tok_s"] and r["decode_tok_s"] else None)
    return rows


def markdown(rows: list[dict], prompt_len: int, n_steps: int) -> str:
    out = [f"Through `Engine.generate_batch` (B requests at once, greedy, {prompt_len}-token prompts, {n_steps} new "
           "tokens each, timed from call to return; decode tok/s leaves out each request's prefill):", "",
           "| B | wall s | tok/s | x vs B=1 | decode tok/s | x vs B=1 | mean prefill s |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = (lambda x, s="": "" if x is None else f"{x:.2f}{s}")  # noqa: E731
        out.append(f"| {r['batch']} | {r['seconds']:.2f} | {r['tok_s']:.2f} | {f(r['speedup'], 'x')} | "
                   f"{f(r['decode_tok_s'])} | {f(r['decode_speedup'], 'x')} | {r['prefill_s']:.3f} |")
    return "\n".join(out)

"""Speculative decoding benchmark (`hybridinfer bench spec`): the machinery's speed as a function of acceptance.

Random weights make any real drafter's acceptance meaningless, so the drafter here is engine/spec.ScriptedDrafter: it
knows the greedy continuation (from a run without drafts) and proposes it with each token kept with probability
`acceptance`, else replaced. For each draft length k and acceptance the table gives decode tok/s and its ratio to decode
without drafts (runs without drafts alternate with each row's runs; the ratio is the best of each run's to the no-draft
run just before it, so a host whose speed drifts between runs does not mix their sides; the first run's apart: its
speculator starts cold, the later ones keep the step costs and acceptance it measured, as a server's engine does), with
the acceptance actually seen (drafts after the first rejection of a step are never looked at, so it is below the nominal
one) and a check that the tokens are the no-draft ones; and the cost of one verify step of k+1 rows (rollback included)
against one ordinary decode step. The `auto<=K` rows let the engine choose each step's draft length up to the largest K
by its measured cost model (what `--spec-type` runs), which stops drafting where drafts do not pay.

`batch` B > 1: B sequences, each with its own random prompt, decoded together through the scheduler as one user's
`Engine.generate_batch` (every prompt prefilled in the first step, so every decode starts together); tok/s is the tokens
of all B over the decode window (first token to last), and the step costs are a decode step of B rows and a verify step
where one sequence drafts k and the others verify their token alone (what one drafting sequence costs the whole
batch)."""

from __future__ import annotations

import time

import numpy as np

from . import pyplot

ACCEPTS = (0.0, 0.5, 0.7, 0.9, 1.0)


class NoStop:
    """A constraint that masks the end-of-generation tokens, so every run makes its n tokens (random weights pick
    them early and at random, and a sequence that ends leaves a smaller batch behind): llama-bench's ignore-eos."""

    def __init__(self, stop_ids):
        self.ids = np.array(sorted(stop_ids), np.int64)

    def mask(self, logits: np.ndarray) -> None:
        logits[self.ids] = -np.inf

    def accept(self, token: int) -> None:
        pass


def _median_s(fn, reps: int) -> float:
    fn()  # the first call records and binds
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def step_costs(eng, prompts: list[list[int]], ks, reps: int) -> dict:
    """Seconds of one decode step of len(prompts) rows and of one verify step where the first sequence drafts k
    (k+1 rows, the others one each; undone to each one's first row, as a fully rejected draft is) at the end of the
    prompts, medians of `reps`."""
    sts = [eng.new_state() for _ in prompts]
    for p, st in zip(prompts, sts, strict=True):
        eng.prefill(p, st)
    p0 = [st.pos for st in sts]

    def rewind():
        for st, p in zip(sts, p0, strict=True):
            st.pos = p

    def decode():
        eng.decode_step([5] * len(sts), sts)
        rewind()

    out = {"decode_s": _median_s(decode, reps)}
    for k in ks:
        def verify(k=k):
            _, undos = eng.verify_rows([([5] + [7] * k * (j == 0), st) for j, st in enumerate(sts)])
            with eng.lock:
                for u in undos:
                    u(1)
            rewind()

        out[f"verify_{k + 1}_s"] = _median_s(verify, reps)
    for st in sts:
        eng.release(st)
    return out


def decode_tok_s(gens) -> float:
    """Tokens of all `gens` over their decode window, from the first sequence's first token to the last one's end
    (their admissions are one scheduler step, so each one's timings start together); one sequence: its
    decode_tok_per_s."""
    t = [g.timings for g in gens]
    window = max(x["prefill_s"] + x["decode_s"] for x in t) - min(x["prefill_s"] for x in t)
    return sum(max(len(g.tokens), 1) for g in gens) / max(window, 1e-9)


def run(model: str, threads: int, n: int, ks, accepts, prompt_len: int, isa: str | None, seed: int,
        reps: int = 3, llama_server: str | None = None, batch: int = 1, fixed: bool = True) -> dict:
    """`fixed` False: the auto<=K rows alone (no fixed-k rows)."""
    from ...engine.api import Engine
    from ...engine.compute import DEFAULT_STEP_TOKENS
    from ...engine.spec import ScriptedDrafter, Speculator

    opts = {"n_threads": threads} | ({"isa": isa} if isa else {})
    # every prompt in the first step's budget: the B decodes start together
    eng = Engine.load(model, backend="cpu", n_ctx=prompt_len + n + 8, max_seqs=batch, spec_type="none",
                      step_tokens=max(DEFAULT_STEP_TOKENS, batch * (prompt_len + 1)), **opts)
    try:
        V = eng.args.n_vocab
        rng = np.random.default_rng(seed)
        prompts = [[int(x) for x in rng.integers(3, V, prompt_len)] for _ in range(batch)]

        nostop = NoStop(eng.tokenizer.stop_ids)

        def gen():
            return eng.generate_batch(prompts, max_tokens=n, temperature=0, constraint=nostop)

        eng.spec = None
        base = [gen() for _ in range(reps)]
        refs = [g.tokens for g in base[0]]
        res = {"model": model, "threads": threads, "batch": batch, "n": len(refs[0]), "prompt_len": prompt_len,
               "isa": eng.backend.numeric_path, "no_draft_tok_s": max(decode_tok_s(gs) for gs in base), "rows": []}
        plan = [(k, a, False) for k in ks for a in accepts if fixed] + [(max(ks), a, True) for a in accepts]
        for k, a, adaptive in plan:
            best, plain, seen, same, drafted, cold, last, ratios = 0.0, 0.0, 0.0, True, 0, 0.0, None, []
            for r in range(reps):
                eng.spec = None  # a no-draft run beside each: the ratio holds while a shared host's load drifts
                plain_r = decode_tok_s(gen())
                plain = max(plain, plain_r)
                # later runs: new sequences, the step costs and acceptance learned before (as a server's engine)
                eng.spec = Speculator(ScriptedDrafter([p + t for p, t in zip(prompts, refs, strict=True)], a,
                                                      seed=r), k, adaptive=adaptive, learned=last)
                gs, last = gen(), eng.spec
                same = same and [g.tokens for g in gs] == refs
                best = max(best, decode_tok_s(gs))
                ratios.append(decode_tok_s(gs) / plain_r)
                cold = cold or ratios[0]
                seen = eng.spec.accepted / max(eng.spec.drafted, 1)
                drafted = eng.spec.drafted
            res["no_draft_tok_s"] = max(res["no_draft_tok_s"], plain)
            res["rows"].append({"k": f"auto<={k}" if adaptive else k, "acceptance": a, "seen": seen, "tok_s": best,
                                # each run over the no-draft run beside it, the best of them: the best tok/s over
                                # the best no-draft tok/s mixed runs on either side of a drift of the host
                                "no_draft_tok_s": plain, "speedup": max(ratios), "ratios": ratios,
                                "cold_speedup": cold,
                                "same_tokens": same, "drafted_per_token": drafted / sum(len(t) for t in refs)})
        eng.spec = None
        res["costs"] = step_costs(eng, prompts, ks, max(reps, 5))
    finally:
        eng.close()
    if llama_server:  # after ours is closed: the two never share the cores or the page cache's hot set
        from . import spec_llama

        res["llama"] = spec_llama.run(llama_server, model, threads, prompts[0], n, ks, reps, refs[0])
    return res


def markdown(res: dict) -> str:
    c, B = res["costs"], res.get("batch", 1)
    seqs = f"{B} sequences x " if B > 1 else ""
    lines = [f"speculative decoding, {res['model']} ({res['isa']}, {res['threads']} threads, {seqs}{res['n']} tokens "
             f"after {res['prompt_len']} prompt tokens): no drafts {res['no_draft_tok_s']:.2f} tok/s"
             + (" (summed over the sequences)" if B > 1 else ""), "",
             "| k | acceptance | seen | drafted/token | tok/s | x no-draft | x no-draft, first run | same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['k']} | {r['acceptance']:.1f} | {r['seen']:.2f} | {r.get('drafted_per_token', 0):.2f} | "
                     f"{r['tok_s']:.2f} | {r['speedup']:.2f} | {r.get('cold_speedup', 0):.2f} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    others = f" + {B - 1} x 1" if B > 1 else ""
    lines += ["", "| step | ms | x decode step |", "|---|---|---|",
              f"| decode ({B} row{'s' * (B > 1)}) | {c['decode_s'] * 1e3:.2f} | 1.00 |"]
    for key in sorted(k for k in c if k.startswith("verify_")):
        rows = key.split("_")[1]
        lines.append(f"| verify ({rows}{others} rows, rolled back) | {c[key] * 1e3:.2f} | "
                     f"{c[key] / c['decode_s']:.2f} |")
    if res.get("llama"):
        from . import spec_llama

        lines.append(spec_llama.markdown(res["llama"]))
    return "\n".join(lines)


def plot(res: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in dict.fromkeys(r["k"] for r in res["rows"]):
        pts = [(r["acceptance"], r["speedup"]) for r in res["rows"] if r["k"] == k]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"k={k}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft acceptance (nominal)")
    ax.set_ylabel("decode speed / no drafts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True

"""Speculative decoding benchmark (`hybridinfer bench spec`): the machinery's speed as a function of acceptance.

Random weights make any real drafter's acceptance meaningless, so the drafter here is engine/spec.ScriptedDrafter:
it knows the greedy continuation (from a run without drafts) and proposes it with each token kept with probability
`acceptance`, else replaced. For each draft length k and acceptance the table gives decode tok/s and its ratio to
decode without drafts, with the acceptance actually seen (drafts after the first rejection of a step are never
looked at, so it is below the nominal one) and a check that the tokens are the no-draft ones; and the cost of one
verify step of k+1 rows (rollback included) against one ordinary decode step. The `auto<=K` rows let the engine
choose each step's draft length up to the largest K by its measured cost model (what `--spec-type` runs), which
stops drafting where drafts do not pay."""

from __future__ import annotations

import time

import numpy as np

from . import pyplot

ACCEPTS = (0.0, 0.5, 0.7, 0.9, 1.0)


def _median_s(fn, reps: int) -> float:
    fn()  # the first call records and binds
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def step_costs(eng, prompt: list[int], ks, reps: int) -> dict:
    """Seconds of one decode step and of one verify step of k+1 rows (undone to its first row, as a fully rejected
    draft is) at the end of `prompt`, medians of `reps`."""
    st = eng.new_state()
    eng.prefill(prompt, st)
    p0 = st.pos

    def decode():
        eng.decode_step([5], [st])
        st.pos = p0

    out = {"decode_s": _median_s(decode, reps)}
    for k in ks:
        def verify(k=k):
            _, undos = eng.verify_rows([([5] + [7] * k, st)])
            with eng.lock:
                undos[0](1)
            st.pos = p0

        out[f"verify_{k + 1}_s"] = _median_s(verify, reps)
    eng.release(st)
    return out


def run(model: str, threads: int, n: int, ks, accepts, prompt_len: int, isa: str | None, seed: int,
        reps: int = 3, llama_server: str | None = None) -> dict:
    from ...engine.api import Engine
    from ...engine.spec import ScriptedDrafter, Speculator

    opts = {"n_threads": threads} | ({"isa": isa} if isa else {})
    eng = Engine.load(model, backend="cpu", n_ctx=prompt_len + n + 8, max_seqs=1, **opts)
    try:
        V = eng.args.n_vocab
        prompt = [int(x) for x in np.random.default_rng(seed).integers(3, V, prompt_len)]

        def gen():
            return eng.generate(prompt, max_tokens=n, temperature=0)

        eng.spec = None
        base = [gen() for _ in range(reps)]
        ref = base[0].tokens
        res = {"model": model, "threads": threads, "n": len(ref), "prompt_len": prompt_len,
               "isa": eng.backend.numeric_path, "no_draft_tok_s": max(g.timings["decode_tok_per_s"] for g in base),
               "rows": []}
        plan = [(k, a, False) for k in ks for a in accepts] + [(max(ks), a, True) for a in accepts]
        for k, a, adaptive in plan:
            best, seen, same = 0.0, 0.0, True
            for r in range(reps):
                eng.spec = Speculator(ScriptedDrafter([prompt + ref], a, seed=r), k, adaptive=adaptive)
                g = gen()
                same = same and g.tokens == ref
                best = max(best, g.timings["decode_tok_per_s"])
                seen = eng.spec.accepted / max(eng.spec.drafted, 1)
            res["rows"].append({"k": f"auto<={k}" if adaptive else k, "acceptance": a, "seen": seen, "tok_s": best,
                                "speedup": best / res["no_draft_tok_s"], "same_tokens": same})
        eng.spec = None
        res["costs"] = step_costs(eng, prompt, ks, max(reps, 5))
    finally:
        eng.close()
    if llama_server:  # after ours is closed: the two never share the cores or the page cache's hot set
        from . import spec_llama

        res["llama"] = spec_llama.run(llama_server, model, threads, prompt, n, ks, reps, ref)
    return res


def markdown(res: dict) -> str:
    c = res["costs"]
    lines = [f"speculative decoding, {res['model']} ({res['isa']}, {res['threads']} threads, {res['n']} tokens after "
             f"{res['prompt_len']} prompt tokens): no drafts {res['no_draft_tok_s']:.2f} tok/s", "",
             "| k | acceptance | seen | tok/s | x no-draft | same tokens |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['k']} | {r['acceptance']:.1f} | {r['seen']:.2f} | {r['tok_s']:.2f} | {r['speedup']:.2f} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    lines += ["", "| step | ms | x decode step |", "|---|---|---|",
              f"| decode (1 row) | {c['decode_s'] * 1e3:.2f} | 1.00 |"]
    for key in sorted(k for k in c if k.startswith("verify_")):
        rows = key.split("_")[1]
        lines.append(f"| verify ({rows} rows, rolled back) | {c[key] * 1e3:.2f} | {c[key] / c['decode_s']:.2f} |")
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

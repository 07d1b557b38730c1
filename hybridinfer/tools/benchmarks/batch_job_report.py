"""The batch-job benchmark's figures (batch_job.py): rates and ratios of each row, the markdown table, the targets
and the plot."""

from __future__ import annotations

from . import pyplot
from .serve import LLAMA, OURS

PREFILL_ONCE = 1.1  # target: re-processed prompt tokens at most this many times the unique ones
SPEEDUP = 2.0  # target: requests/s at least this many times llama-server's


def derive(rows: list[dict], unique: int) -> list[dict]:
    """Each row with req_s, gen_tok_s, reprocessed_ratio (to the unique prompt tokens) and x_llama (req/s over
    llama-server's) added; a figure that cannot be had (a failed run, no llama-server) is None."""
    def rate(n, wall):
        return n / wall if n is not None and wall else None

    out = [dict(r, req_s=rate(r["answered"], r["wall_s"]), gen_tok_s=rate(r["generated"], r["wall_s"]),
                reprocessed_ratio=r["reprocessed"] / unique if r["reprocessed"] is not None and unique else None)
           for r in rows]
    ref = next((r["req_s"] for r in out if r["engine"] == LLAMA), None)
    for r in out:
        r["x_llama"] = r["req_s"] / ref if r["req_s"] is not None and ref else None
    return out


def targets(rows: list[dict]) -> list[str]:
    """The issue's two targets, met or not, for the scheduler row (reported, not asserted)."""
    sched = next((r for r in rows if r["engine"] == OURS and r["config"].startswith("scheduler (")), None)
    if sched is None:
        return []
    out = []
    ratio = sched["reprocessed_ratio"]
    if ratio is not None:
        out.append(f"- prefill once: re-processed / unique prompt tokens {ratio:.2f} (target <= {PREFILL_ONCE}): "
                   + ("met" if ratio <= PREFILL_ONCE else "not met"))
    x = sched["x_llama"]
    if x is not None:
        out.append(f"- requests/s {sched['req_s']:.3f} vs llama-server's {sched['req_s'] / x:.3f}: {x:.2f}x "
                   f"(target >= {SPEEDUP}x): " + ("met" if x >= SPEEDUP else "not met"))
    return ["", f"targets ({sched['config']}):", *out] if out else []


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _answers(r: dict) -> str:
    bad = [f"{r[k]} {k.replace('_', ' ')}" for k in ("missing", "duplicates", "not_ok", "unknown") if r[k]]
    return f"{r['answered']}/{r['requests']}" + (f" ({', '.join(bad)})" if bad else "")


def markdown(res: dict) -> str:
    m = res["meta"]
    rows = derive(res["rows"], m["unique_prompt_tokens"])
    out = [f"model: {m['model']}, threads {m['threads']}, backend {m['backend']}; {m['requests']} requests sharing "
           f"a {m['system_tokens_actual']}-token system prompt, questions {m['question_tokens'][0]}-"
           f"{m['question_tokens'][1]} tokens, max_tokens {m['max_tokens']}, temperature 0, n_ctx {m['n_ctx']} per "
           f"sequence; NUMA nodes on this host: {m['numa_nodes']} ({m['numa_mem_nodes']} with memory)",
           f"prompt tokens (this engine's tokenizer and template): {m['prompt_tokens']}, unique (a shared prefix "
           f"counted once): {m['unique_prompt_tokens']}", "",
           "| configuration | answered | wall s | load + wall s | req/s | prompt tok | re-processed tok | "
           "re-processed / unique | generated tok | gen tok/s | x llama-server | notes |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        notes = [r["numa_status"]] if r.get("numa_status") else []
        if r["error"] and not (notes and notes[0].startswith("refused:")):
            notes.append(f"error: {r['error']}")  # a refused policy's error repeats what the status says
        if r["prompt_tokens"] is not None and r["prompt_tokens"] != m["prompt_tokens"]:
            notes.append(f"prompt tokens differ from the job's {m['prompt_tokens']} (its template or tokenizer)")
        note = "; ".join(notes)
        out.append(f"| {r['config']} | {_answers(r)} | {_f(r['wall_s'])} | {_f(r['process_s'])} | "
                   f"{_f(r['req_s'], '.3f')} | {_f(r['prompt_tokens'], 'd')} | {_f(r['reprocessed'], 'd')} | "
                   f"{_f(r['reprocessed_ratio'], '.2f')} | {_f(r['generated'], 'd')} | {_f(r['gen_tok_s'])} | "
                   f"{_f(r['x_llama'], '.2f')} | {note.replace('|', '/')} |")
    out += ["", "wall s: the requests only (this engine: its batch summary, after the model load; 2 shards: the "
                "slower of the two, which ran at once; llama-server: first request to last answer); load + wall: "
                "process start to exit (llama-server: start to /health, then the requests). Re-processed: prompt "
                "tokens computed, not restored (llama-server: sum of timings.prompt_n)."]
    return "\n".join(out + targets(rows))


def plot(res: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    m = res["meta"]
    rows = derive(res["rows"], m["unique_prompt_tokens"])
    names = [r["config"] for r in rows]
    colors = ["C1" if r["engine"] == LLAMA else "C0" for r in rows]
    y = list(range(len(rows)))
    fig, ax = plt.subplots(1, 3, figsize=(17, 1.2 + 0.45 * len(rows)), sharey=True)
    for a, key, title in ((ax[0], "req_s", "requests/s"), (ax[1], "reprocessed_ratio",
                                                           "re-processed / unique prompt tokens"),
                          (ax[2], "gen_tok_s", "generated tok/s")):
        a.barh(y, [r[key] or 0 for r in rows], color=colors)
        for i, r in enumerate(rows):
            a.annotate(_f(r[key], ".2f") if r[key] is not None else "failed", (r[key] or 0, i), va="center",
                       fontsize=7, xytext=(3, 0), textcoords="offset points")
        a.set_xlabel(title)
    ax[1].axvline(PREFILL_ONCE, color="k", ls="--", lw=0.8)
    ax[0].set_yticks(y, names, fontsize=8)
    ax[0].invert_yaxis()
    fig.suptitle(f"{m['model']}, {m['threads']} threads: {m['requests']} requests, ~{m['system_tokens_actual']}-token "
                 f"shared system prompt, max_tokens {m['max_tokens']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

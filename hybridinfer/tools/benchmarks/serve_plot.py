"""The PNG of `bench serve`: tok/s, TTFT and inter-token latency per concurrency, and the agent run's TTFT of cold
and cached requests."""

from __future__ import annotations

import numpy as np

from . import pyplot


def plot(res: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = res["rows"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    for i, e in enumerate(engines):
        chat = [r for r in rows if r["engine"] == e and r["workload"] == "chat"]
        x, col = [r["concurrency"] for r in chat], f"C{i}"
        ax[0].plot(x, [r["tok_s"] for r in chat], "o-", color=col, label=e)
        for j, k in ((1, "ttft"), (2, "itl")):
            ax[j].plot(x, [r[f"{k}_p50_ms"] or np.nan for r in chat], "o-", color=col, label=f"{e} p50")
            ax[j].plot(x, [r[f"{k}_p99_ms"] or np.nan for r in chat], "x--", color=col, label=f"{e} p99")
    for a, t in zip(ax[:3], ("aggregate generated tok/s", "time to first token (ms)", "inter-token latency (ms)"),
                    strict=True):
        a.set_xscale("log", base=2)
        a.set_xticks(res["meta"]["concurrency"], [str(c) for c in res["meta"]["concurrency"]])
        a.set_xlabel("concurrent clients")
        a.set_ylabel(t)
        a.legend(fontsize=7)
    agent = [r for r in rows if r["workload"] == "agent"]
    x = np.arange(len(agent))
    ax[3].bar(x - 0.2, [r["cold_ttft_p50_ms"] or 0 for r in agent], 0.4, label="cold requests")
    ax[3].bar(x + 0.2, [r["cached_ttft_p50_ms"] or 0 for r in agent], 0.4, label="cached requests")
    for i, r in enumerate(agent):
        ax[3].annotate(f"re-processed\n{r['reprocessed']} / {r['prompt_tokens']}", (i, 0), ha="center",
                       va="bottom", fontsize=7, xytext=(0, 4), textcoords="offset points")
    ax[3].set_xticks(x, [r["engine"] for r in agent])
    ax[3].set_ylabel("agent TTFT p50 (ms)")
    ax[3].legend(fontsize=7)
    fig.suptitle(f"{res['meta']['model']}, {res['meta']['threads']} threads, max_seqs {res['meta']['max_seqs']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

"""`bench context`'s markdown table and plot (the measurements: context.py)."""

from __future__ import annotations

from ...engine.context import size_text
from .context import fa_values


def _num(x, fmt: str = ".1f") -> str:
    return "" if x is None else format(x, fmt)


def _llama_cell(r: dict, what: str) -> str:
    """llama.cpp's tok/s with flash attention off / on ("-" for a setting not run: off with a quantized V)."""
    if r.get("llama_note"):
        return "n/a"
    if "llama" not in r:
        return ""
    got = r["llama"]
    if not got and r.get("llama_error"):
        return "failed"
    cells = []
    for fa in (0, 1):
        x = got.get(str(fa), {}).get(f"{what}_tok_s")
        cells.append("-" if x is None and fa not in fa_values(r["k"], r["v"]) else _num(x) or "?")
    return " / ".join(cells)


def _floor_cell(r: dict) -> str:
    """This engine's tg fraction of its floor, and in brackets llama.cpp's at its faster setting."""
    frac = r.get("tg_floor_frac")
    peer = max((x for x in (r.get("llama") or {}).values() if "tg_floor_frac" in x),
               key=lambda x: x["tg_tok_s"], default=None)
    return (("" if frac is None else f"{100 * frac:.0f}%")
            + ("" if peer is None else f" (llama.cpp {100 * peer['tg_floor_frac']:.0f}%)"))


def markdown(res: dict) -> str:
    weights, rec = res["weights_bytes_per_token"], res["recurrent_bytes"]
    head = (f"model `{res['model']}` ({res['arch']}), backend {res['backend']}"
            + (f" ({res['isa']})" if res.get("isa") else "") + f", {res['threads']} threads; at each depth D (after "
            f"D tokens of context, prefilled untimed): pp = prefill of {res['prompt']} more tokens, tg = "
            f"{res['gen']} greedy decode steps, each from the state at D, mean of {res['reps']} runs (llama-bench's "
            f"avg_ts). A decoded token reads {weights / 1e9:.3f} GB of weights, {size_text(rec)} of recurrent state "
            f"and the K/V rows before it; % of floor: those bytes over the read bandwidth measured around the timed "
            f"steps (llama.cpp's: around its call). pp GFLOP/s counts the products and the attention over the depth.")
    if res.get("llama_bench"):
        head += (f" llama.cpp: `llama-bench -p {res['prompt']} -n {res['gen']} -d D -ctk K -ctv V -fa 0,1 "
                 f"-t {res['threads']} -r {res['reps']} -o json` (-fa 1 only for a quantized V; f32 not run: its -ctk"
                 f" takes no f32), shown as fa 0 / fa 1;"
                 f" x llama.cpp: against its faster setting.")
    elif res.get("llama_bench_cuda"):
        head += (f" llama.cpp: a CUDA build, `llama-bench -p 0 -n {res['gen']} -d D -ctk K -ctv V -fa F -ngl 99,0 "
                 f"--no-host 1 -t {res['threads']} -r {res['reps']} -o json`, one call per depth and -fa value: the "
                 "-ngl 99 instance prefills the depth on the card, the -ngl 0 instance restores it from llama-bench's "
                 "depth cache and decodes on the CPU with repacked weights; only its n_gpu_layers 0 rows are shown "
                 "(tg alone: at -ngl 0 a prompt batch goes to the card), as fa 0 / fa 1;"
                 " x llama.cpp: against its faster setting.")
    first = min((r["depth"] for r in res["rows"] if "tg_tok_s" in r), default=None)
    out = [head, "",
           "| K/V | depth | K/V B/token | K/V total | K/V read/token | pp tok/s | pp GFLOP/s | tg tok/s | "
           f"tg x depth {first or '-'} | tg % of floor | llama.cpp pp (fa 0 / 1) | llama.cpp tg (fa 0 / 1) | "
           "pp x llama.cpp | tg x llama.cpp |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in res["rows"]:
        cells = [r["type"], str(r["depth"]), str(r["kv_bytes_per_token"]), size_text(r["kv_bytes"])]
        if "tg_tok_s" not in r:
            why = r.get("skipped") or "not measured"
            notes.append(f"{r['type']} at {r['depth']}: skipped, {why}")
            cells += ["", "skipped", "", "", "", "", "", "", "", ""]
        else:
            cells += [size_text(int(r["kv_read_per_token"])), _num(r["pp_tok_s"]), _num(r.get("pp_gflop_s")),
                      _num(r["tg_tok_s"], ".2f"), _num(r.get("tg_vs_first"), ".2f"), _floor_cell(r),
                      _llama_cell(r, "pp"), _llama_cell(r, "tg"),
                      _num(r.get("pp_vs_llama"), ".2f"), _num(r.get("tg_vs_llama"), ".2f")]
        why = r.get("llama_error") or r.get("llama_note")
        if why:
            notes.append(f"llama-bench, {r['type']} at {r['depth']}: {why}")
        out.append("| " + " | ".join(cells) + " |")
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    return "\n".join(out)


def plot(res: dict, png: str) -> bool:
    """pp and tg tok/s against depth, one line per cache type and engine (llama.cpp: its faster flash-attention
    setting); False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, what in zip(axes, ("pp", "tg"), strict=True):
        for i, t in enumerate(res["cache_types"]):
            rows = [r for r in res["rows"] if r["type"] == t]
            ours = [(r["depth"], r[f"{what}_tok_s"]) for r in rows if f"{what}_tok_s" in r]
            peer = [(r["depth"], max(x[f"{what}_tok_s"] for x in r["llama"].values() if f"{what}_tok_s" in x))
                    for r in rows if any(f"{what}_tok_s" in x for x in (r.get("llama") or {}).values())]
            for pts, style, who in ((ours, "-o", "hybridinfer"), (peer, "--s", "llama.cpp")):
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=f"C{i}", label=f"{who} {t}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylabel(f"{what} tok/s")
        ax.set_title(f"{'prefill' if what == 'pp' else 'decode'} at depth, {res['threads']} threads")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True

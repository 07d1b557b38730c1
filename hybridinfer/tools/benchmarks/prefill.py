"""GPU prefill benchmark: tokens/s of one-pass prefill under a VRAM budget and with the whole model resident;
time split into transfer, compute and idle; achieved host-to-device GB/s against the bus rate (measured pinned
bandwidth, or `bus_bw` when the stream is paced to an old card's bus); FLOP/s against the card's measured fp32
FMA peak; llama.cpp (CPU-only, and CUDA) in the same run.

FLOPs and bytes are the engine's own counts of what it ran and streamed (GPUModel.last_timing["work"] and
"bytes_h2d"; gpu/work.py says what is counted), checked against the pure count the time model uses
(gpu/work.prefill_work, Placement.stream_bytes_per_pass): each row says whether they agree.
Floors: transfer = bytes streamed per prompt / bus rate; compute = counted FLOPs / FMA peak. The target is
wall time / max(transfer, compute). The efficiencies `hybridinfer plan` is calibrated by (gpu/calibration.py)
are printed last: compute = counted FLOPs / compute time / FMA peak with the whole model resident, bus = bytes /
copy-stream time / bus rate under the budget.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Row:
    engine: str
    config: str
    tokens: int
    tok_s: float
    wall_s: float = 0.0
    transfer_s: float = 0.0  # copy stream busy
    compute_s: float = 0.0  # compute stream span (kernels and waits for uploads)
    idle_s: float = 0.0  # wall - compute span: host work (embedding, launches, state hand-off)
    h2d_gb_s: float = 0.0
    h2d_frac: float = 0.0  # of the bus rate (pinned bandwidth or the paced rate), over the copy stream's busy time
    gemm_tflops: float = 0.0  # counted FLOPs (all kinds) / compute time
    fma_frac: float = 0.0
    floor_ratio: float = 0.0  # wall / max(transfer floor, compute floor)
    vram_peak_gib: float = 0.0
    flops: float = 0.0  # counted by the engine
    h2d_bytes: int = 0  # streamed, counted by the engine
    counts_agree: bool = False  # engine's FLOPs and bytes == gpu/work.prefill_work's and the placement's


def gemm_flops(gm, args, T: int) -> float:
    """FLOPs of the prompt's matrix products, dense and grouped (head: last token only): gpu/work.py's count."""
    from ...backends.gpu.work import prefill_work

    w = prefill_work(gm, args, T)
    return w.gemm + w.moe


def cards_floor(cards: list[dict], bw: float, peak: float) -> float:
    """Seconds no pass over these cards can beat: the slowest card's longer of its bus time (the weights it streamed,
    `bytes_h2d`, and the rows that come up to it from the others, `up_bytes`, over the bus rate `bw`) and its
    compute time (its counted `flops` over the FMA peak)."""
    return max(max((c["bytes_h2d"] + c.get("up_bytes", 0)) / bw, c["flops"] / peak) for c in cards)


def card_figures(t: dict, bw: float, peak: float, up_rows_bytes: int = 0) -> dict:
    """Row figures of a pass's last_timing over cards (t["cards"]; none: one card): summed bus GB/s and its share of
    the cards' bus rate, FLOP/s and its share of their peak, wall over cards_floor. up_rows_bytes: the hidden rows
    a later card of the layer pipeline takes up (the expert split's partials are in its cards' "up_bytes")."""
    cards = t.get("cards") or [{"bytes_h2d": t["bytes_h2d"], "flops": t["work"]["flops"], "copy_s": t["copy_s"]}]
    cards = [dict(c, up_bytes=c.get("up_bytes", up_rows_bytes if k else 0)) for k, c in enumerate(cards)]
    n = len(cards)
    gb_s = sum(c["bytes_h2d"] / c["copy_s"] for c in cards if c["copy_s"] > 0) / 1e9
    tflops = t["work"]["flops"] / max(t["gpu_s"], 1e-9) / 1e12
    return {"h2d_gb_s": gb_s, "h2d_frac": gb_s * 1e9 / (n * bw), "gemm_tflops": tflops,
            "fma_frac": tflops * 1e12 / (n * peak), "floor_ratio": t["wall_s"] / cards_floor(cards, bw, peak)}


def run_ours(path: str, prompts, budget: int | None, config: str, bw: float, peak: float, seed: int = 0,
             bus_bw: float | None = None, card_profile: str | None = None, kv_stream: bool | None = None):
    import pycuda.driver as drv

    from ...backends.gpu import loader
    from ...backends.gpu.backend import GPUModel
    from ...backends.gpu.work import prefill_work
    from ...format.gguf_model import GGUFModel
    from ...models import model_args

    gm = GGUFModel(path)
    args = model_args(gm)
    n_ctx = max(prompts) + 8
    t0 = time.perf_counter()
    loader.init()
    free0, _ = drv.mem_get_info()
    m = GPUModel(gm, args, n_ctx, vram_budget=budget, bus_bw=bus_bw, card_profile=card_profile, kv_stream=kv_stream)
    load_s = time.perf_counter() - t0
    phases, host = {}, {}
    rows = []
    rng = np.random.default_rng(seed)
    for T in prompts:
        ids = [int(x) for x in rng.integers(0, args.n_vocab, T)]
        for _ in range(2):  # the first pass compiles kernels and warms the caches
            st = m.new_state(n_ctx)
            m.forward(ids, st, all_logits=False)
        t = m.last_timing
        host[T] = {k: round(v, 4) for k, v in t["host_s"].items()}
        m.profile = True  # one more pass with phase events (they add sync points, so not the timed one)
        m.forward(ids, m.new_state(n_ctx), all_logits=False)
        m.profile = False
        phases[T] = {k: round(v, 4) for k, v in m.last_timing["phases"].items()}
        free1, _ = drv.mem_get_info()
        flops = t["work"]["flops"]
        agree = (abs(flops - prefill_work(gm, args, T).flops) <= 1e-9 * flops
                 and t["bytes_h2d"] == m.placement.stream_bytes_per_pass)
        rows.append(Row("hybridinfer", config, T, T / t["wall_s"], t["wall_s"], t["copy_s"], t["gpu_s"],
                        max(0.0, t["wall_s"] - t["gpu_s"]), vram_peak_gib=(free0 - free1) / 2**30, flops=flops,
                        h2d_bytes=t["bytes_h2d"], counts_agree=agree, **card_figures(t, bw, peak)))
    from ...backends.gpu.loader import describe_compiles

    info = {"config": config, "budget": budget, "load_s": load_s, "compile": describe_compiles(m.compiled),
            "allocated_gib": m.allocated_bytes / 2**30,
            "stream_gib_per_pass": m.placement.stream_bytes_per_pass / 2**30,
            "resident_gib": m.placement.resident_bytes / 2**30, "phases_s": phases, "host_s": host,
            "chunk": m.chunk, "kv_streamed": bool(m.buf.kv_stream), "pass_plan": vars(m.plan)}
    del m
    gc.collect()
    return rows, info


def llama_bench(exe: str | None, path: str, T: int, threads: int, extra: list[str], label: str) -> Row | None:
    exe = shutil.which(exe) or exe if exe else None
    if not exe:
        return None
    cmd = [exe, "-m", path, "-p", str(T), "-n", "0", "-t", str(threads), "-o", "json", "-r", "1", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{label}: {exe} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
        return None
    try:
        return Row("llama.cpp", label, T, float(json.loads(r.stdout)[-1]["avg_ts"]))
    except (ValueError, KeyError, IndexError):
        return None


def run(path: str, prompts=(128, 947, 4096), budget: int | None = 6 << 30, resident: bool = True,
        threads: int = 16, llama_cpu: str | None = None, llama_cuda: str | None = None,
        bus_bw: float | None = None, card_profile: str | None = None, kv_stream: bool | None = None,
        devices: list[int] | None = None, split_modes=("auto",)) -> dict:
    """devices: also prefill on devices[0] alone and over all of them (prefill_cards.py), each card under `budget`,
    once in each of split_modes (multi_gpu.open_cards's: auto, layer, expert).
    bus_bw: pace the weight stream to this many bytes/s (an old card's bus; None: the card's own, or the card
    profile's bus); card_profile: compile and tile as for that class of card (gpu/cards.py PROFILES); kv_stream:
    GPUModel's (None: K/V streamed through the card only for passes too long to keep them there; True: always)."""
    from ...backends.gpu.k_peak import fma_peak_flops, pinned_h2d_bytes_per_s

    pinned, peak = pinned_h2d_bytes_per_s(), fma_peak_flops()
    from ...backends.gpu.cards import paced_bus

    bus_bw = paced_bus(card_profile, bus_bw)  # as GPUModel paces it
    bw = min(pinned, bus_bw) if bus_bw else pinned
    rows, infos = [], []
    configs = ([(budget, f"--vram-budget {budget / 2**30:g}GiB")] if budget else []) + (
        [(None, "whole model resident")] if resident else [])
    for b, label in configs:
        r, info = run_ours(path, prompts, b, label, bw, peak, bus_bw=bus_bw, card_profile=card_profile,
                           kv_stream=kv_stream)
        rows += r
        infos.append(info)
    if devices:
        from .prefill_cards import run_cards

        r, info = run_cards(path, prompts, devices, budget or None, card_profile, bus_bw, kv_stream,
                            split_modes=split_modes, bw=bw, peak=peak)
        rows += r
        infos += info
    for T in prompts:
        for exe, extra, label in ((llama_cpu, [], f"CPU only, {threads} threads"),
                                  (llama_cuda, ["-ngl", "99", "-ot", "exps=CPU"], "CUDA, experts on CPU"),
                                  (llama_cuda, ["-ngl", "99"], "CUDA, all resident")):
            row = llama_bench(exe, path, T, threads, extra, label)
            if row:
                rows.append(row)
    out = {"model": path, "pinned_h2d_gb_s": pinned / 1e9, "fma_peak_tflops": peak / 1e12, "configs": infos,
           "card_profile": card_profile,
           "bus_gb_s": bw / 1e9, "bus_paced": bool(bus_bw), "rows": [asdict(r) for r in rows]}
    out["efficiency"] = efficiencies(out["rows"])
    return out


def efficiencies(rows: list[dict]) -> dict:
    """Per prompt length: the time model's calibration figures from this run's rows. compute: the fraction of the
    fp32 FMA peak the whole pass reaches with the model resident (no waits for the stream); bus: the fraction of
    the bus rate the stream reaches under the budget (over the copy stream's busy time). The `--devices` rows
    (prefill_cards.py) are not one card's figures."""
    ours = [r for r in rows if r["engine"] == "hybridinfer" and "--devices" not in r["config"]]
    out: dict = {}
    for r in ours:
        e = out.setdefault(r["tokens"], {})
        if r["config"] == "whole model resident":
            e["compute"] = r["fma_frac"]
        elif r["h2d_frac"]:
            e["bus"] = r["h2d_frac"]
            e.setdefault("compute_streamed", r["fma_frac"])
    return out


def markdown(res: dict) -> str:
    out = [f"model `{res['model']}`; pinned H2D {res['pinned_h2d_gb_s']:.1f} GB/s; fp32 FMA peak "
           f"{res['fma_peak_tflops']:.1f} TFLOP/s (measured)"
           + (f"; weight stream paced to {res['bus_gb_s']:.1f} GB/s" if res.get("bus_paced") else "")]
    for c in res["configs"]:
        out.append(f"- {c['config']}: {c['resident_gib']:.2f} GiB resident, {c['stream_gib_per_pass']:.2f} GiB "
                   f"streamed per prompt, {c['allocated_gib']:.2f} GiB allocated, load {c['load_s']:.1f} s; "
                   f"{c.get('chunk')} tokens per kernel call; GPU time by phase (s): {c['phases_s']}; host time "
                   f"(s): {c.get('host_s')}"
                   + ("; K/V streamed through the card" if c.get("kv_streamed") else "")
                   + (f"; passes: {c['pass_plan']}" if c.get("pass_plan") else ""))
    out += ["", "| engine | config | prompt | tok/s | wall s | transfer s | compute s | idle s | H2D GB/s "
            "(% bus) | TFLOP/s counted (% peak) | wall / floor | VRAM GiB | GFLOP, GiB streamed (= model) |",
            "|---" * 13 + "|"]
    for r in res["rows"]:
        if r["engine"] == "llama.cpp":
            out.append(f"| llama.cpp | {r['config']} | {r['tokens']} | {r['tok_s']:.0f} | | | | | | | | | |")
            continue
        out.append(f"| hybridinfer | {r['config']} | {r['tokens']} | {r['tok_s']:.0f} | {r['wall_s']:.3f} | "
                   f"{r['transfer_s']:.3f} | {r['compute_s']:.3f} | {r['idle_s']:.3f} | {r['h2d_gb_s']:.1f} "
                   f"({100 * r['h2d_frac']:.0f}%) | {r['gemm_tflops']:.2f} ({100 * r['fma_frac']:.0f}%) | "
                   f"{r['floor_ratio']:.2f} | {r['vram_peak_gib']:.2f} | {r['flops'] / 1e9:.1f}, "
                   f"{r['h2d_bytes'] / 2**30:.2f} "
                   f"({'yes' if r['counts_agree'] else 'NO'}) |")
    eff = res.get("efficiency", {})
    if eff:
        out += ["", "calibration (gpu/calibration.py): " + "; ".join(
            f"{T} tokens: compute {e.get('compute', float('nan')):.3f} of FMA peak, bus "
            f"{e.get('bus', float('nan')):.3f} of {res.get('bus_gb_s', res['pinned_h2d_gb_s']):.1f} GB/s"
            for T, e in sorted(eff.items()))]
    return "\n".join(out)


def plot(res: dict, png: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = sorted({(r["engine"], r["config"]) for r in res["rows"]})
    prompts = sorted({r["tokens"] for r in res["rows"]})
    width = 0.8 / max(1, len(labels))
    for j, (eng, cfg) in enumerate(labels):
        ys = [next((r["tok_s"] for r in res["rows"] if (r["engine"], r["config"], r["tokens"]) == (eng, cfg, T)), 0)
              for T in prompts]
        ax.bar(np.arange(len(prompts)) + j * width, ys, width, label=f"{eng}: {cfg}")
    ax.set_xticks(np.arange(len(prompts)) + 0.4 - width / 2, [str(T) for T in prompts])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tok/s")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return True

"""Decode benchmark: tokens/s against the memory-bandwidth floor, side by side with llama.cpp.

floor = (bytes of weights one token reads) / (measured read bandwidth, all threads). One token reads every
dense matrix, the k routed experts' share of each expert tensor, the shared expert and the LM head; the
embedding contributes one row. The bandwidth is read just before and just after each engine's timed steps (for
this engine also between runs of them), and each row is set against the readings around its own timing
(effective_bandwidth): on a shared host the bandwidth moves by half within minutes (91 to 176 GB/s seen in one
run on 16 cores), so one reading for the whole table would rate an engine against a moment it did not run in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass

import numpy as np

from ...format.gguf_model import GGUFModel
from ...models import model_args


def bytes_per_token(gm: GGUFModel, args) -> int:
    """Weight bytes one decode step reads."""
    k = getattr(args, "n_expert_used", 0)
    E = getattr(args, "n_expert", 0)
    total = 0
    for name, t in gm.tensors.items():
        if name == "token_embd.weight":
            total += t.nbytes if args.tied_output else t.nbytes // t.ne[1]
        elif name.endswith("_exps.weight"):
            total += t.nbytes * k // E
        elif name.startswith("blk."):
            layer = int(name.split(".")[1])
            if layer < args.n_layer:
                total += t.nbytes
        else:
            total += t.nbytes
    return total


def l3_bytes() -> int:
    """The largest last-level cache of /sys (0 where unknown)."""
    import glob

    best = 0
    for p in glob.glob("/sys/devices/system/cpu/cpu*/cache/index*/size"):
        try:
            with open(p) as f:
                txt = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
        try:
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best


def probe_bytes(l3: int | None = None, available: int | None = None) -> int:
    """Buffer size for the read-bandwidth probe: at least 1 GiB and 8x the last-level cache (a cache that keeps
    part of a cyclically read buffer would inflate the figure: a 1 GiB probe read 122-168 GB/s on a host
    with a 300 MiB L3), at most a quarter of the available memory."""
    from ...backends.cpu.weights import mem_available

    l3 = l3_bytes() if l3 is None else l3
    available = mem_available() if available is None else available
    n = max(1 << 30, 8 * l3)
    if available:
        n = min(n, max(1 << 30, available // 4))
    return int(n)


@dataclass
class Row:
    engine: str
    isa: str
    threads: int
    tok_s: float
    gb_s: float  # weight bytes per token * tok/s
    floor_frac: float  # of bytes per token * tok/s over probe_gb_s
    note: str = ""
    python_share: float | None = None  # of decode time, upper bound (cProfile)
    probe_gb_s: float | None = None  # the bandwidth over its timing (effective_bandwidth of the readings around it)
    probe_readings_gb_s: list[float] | None = None
    # this engine, run by run of its steps: each run's fraction of its own floor (run_floor_fracs)
    run_floor_fracs: list[float] | None = None


def run_floor_fracs(readings: list[float], counts: list[int], seconds: list[float],
                    bytes_per_token: int) -> list[float]:
    """Each run's fraction of its floor: run k read counts[k] tokens' bytes in seconds[k], its floor time being
    those bytes over the mean of the readings around it (as effective_bandwidth). Runs of no steps are left out.
    Shows whether a row's fraction moved with the host's bandwidth or with the engine."""
    floor = _floor_times(readings, counts)
    if len(seconds) != len(counts) or min(seconds) <= 0:
        raise ValueError(f"need a positive time per run of steps, got {seconds} for runs of {counts} steps")
    return [f * bytes_per_token / s for f, s, n in zip(floor, seconds, counts, strict=True) if n]


def llama_kv(kv: dict | None, fa: tuple[str, str] = ("0", "1"), f32: bool = True) -> tuple[list[str], dict | None]:
    """llama.cpp's flags and environment for this engine's K/V settings (kv: Engine.load's cache_type_k,
    cache_type_v, cache_rotate; None or empty: each engine's own defaults, no flags): -ctk / -ctv, flash attention
    (fa: its off / on values) on for any type but f32, since this engine then attends in the order of llama.cpp's CPU
    flash attention (and llama.cpp needs it for a quantized V), and LLAMA_ATTN_ROT_DISABLE=1 where ours keeps the
    rows unrotated. f32=False: the tool takes no f32 cache type (llama-bench), so f32 K/V pass no -ctk / -ctv and
    llama.cpp keeps its f16 default."""
    if not kv:
        return [], None
    k, v = kv.get("cache_type_k", "f32"), kv.get("cache_type_v", "f32")
    env = None if kv.get("cache_rotate", True) else dict(os.environ, LLAMA_ATTN_ROT_DISABLE="1")
    types = [] if not f32 and "f32" in (k, v) else ["-ctk", k, "-ctv", v]
    return [*types, "-fa", fa[(k, v) != ("f32", "f32")]], env


def measure_ours(path: str, isa: str | None, threads: int, n_tokens: int, context: int, seed: int = 0,
                 weights: str = "auto", probe=None, segments: int = 4,
                 kv: dict | None = None) -> tuple[float, float, str, list[float], list[int], list[float]]:
    """Decode tokens/s of the CPU backend after a `context`-token prompt (greedy; time of n_tokens steps), the
    share of Python in it, where the weights were read from ("copy" or "mmap"), probe()'s readings (none
    without a probe): one before the steps, one after, and one between each of `segments` equal runs of them,
    so that the floor follows a host whose bandwidth its neighbours take a varying share of (the time counts
    the steps only), the steps in each run and each run's seconds."""
    from ...engine.api import Engine

    eng = Engine.load(path, backend="cpu", isa=isa, n_threads=threads, n_ctx=context + 2 * n_tokens + 16,
                      weights=weights, **(kv or {}))
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(0, min(eng.args.n_vocab, 32000), max(context, 1))]
    st = eng.new_state()
    logits = eng.prefill(ids, st)[-1]
    be = eng.backend
    t = int(np.argmax(logits))
    be.forward([t], st, all_logits=False)  # warm-up step (numba, caches)
    segments = max(1, min(segments, n_tokens)) if probe else 1
    bw = [probe()] if probe else []
    counts = [n_tokens * (k + 1) // segments - n_tokens * k // segments for k in range(segments)]
    secs = []
    for n in counts:
        t, dt = greedy_steps(be, st, t, n)
        secs.append(dt)
        if probe:
            bw.append(probe())
    return n_tokens / sum(secs), python_share(be, st, t, max(4, n_tokens // 4)), be.weights, bw, counts, secs


def greedy_steps(be, st, t: int, n: int) -> tuple[int, float]:
    """n greedy decode steps of backend be on state st from token t: the last token and the seconds they took."""
    t0 = time.perf_counter()
    for _ in range(n):
        t = int(np.argmax(be.forward([t], st, all_logits=False)[-1]))
    return t, time.perf_counter() - t0


def _floor_times(readings: list[float], counts: list[int]) -> list[float]:
    """Per run of steps (counts[k] steps between readings[k] and readings[k + 1]): its floor time per byte of a
    step, its steps over the mean of the two readings around it."""
    if len(readings) != len(counts) + 1 or sum(counts) < 1 or min(counts) < 0 or min(readings) <= 0:
        raise ValueError(f"need one more positive reading than runs of steps, got readings {readings} for "
                         f"runs of {counts} steps")
    return [n / ((readings[k] + readings[k + 1]) / 2) for k, n in enumerate(counts)]


def effective_bandwidth(readings: list[float], counts: list[int]) -> float:
    """The read bandwidth a run of steps had: steps in runs of counts[k] with readings[k] before run k and
    readings[k + 1] after it, the floor time of run k is its bytes over the mean of those two, and this is the
    bandwidth that reads all the steps' bytes in the sum of those times (a weighted harmonic mean): a run's
    fraction of its floor is then the floor time over the time it took."""
    return sum(counts) / sum(_floor_times(readings, counts))


def python_share(be, st, t: int, n: int) -> float:
    """Share of decode time spent in Python code (an upper bound: the profiler's own cost lands there too).
    Time inside native calls (cffi functions, numba's compiled code, numpy) is what cProfile books to
    built-ins (file '~'); everything else is interpreter time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    greedy_steps(be, st, t, n)
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    py = sum(v[2] for k, v in stats.items() if k[0] != "~")
    return min(1.0, py / wall)


def measure_llama(llama_bench: str, path: str, threads: int, n_tokens: int, context: int,
                  mmap: bool = True, prompt: int = 0, kv: dict | None = None) -> float | None:
    """llama.cpp's `llama-bench -p P -n N -t T [-d ctx] [-lm none]` tokens/s (-lm none: weights read into
    buffers instead of mapped; P = 0 and N > 0: decode, N = 0 and P > 0: prompt processing), or None if it is
    missing or fails."""
    exe = shutil.which(llama_bench) or (llama_bench if llama_bench and shutil.os.path.exists(llama_bench) else None)
    if not exe:
        return None
    cmd = [exe, "-m", path, "-p", str(prompt), "-n", str(n_tokens), "-t", str(threads), "-o", "json", "-r", "2"]
    if context:
        cmd += ["-d", str(context)]
    if not mmap:
        cmd += ["-lm", "none"]
    flags, env = llama_kv(kv, f32=False)  # llama-bench's -ctk has no f32
    r = subprocess.run(cmd + flags, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(f"{exe} failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        return None
    try:
        rows = json.loads(r.stdout)
        return float(rows[-1]["avg_ts"])
    except (ValueError, KeyError, IndexError):
        return None


def run(path: str, threads: int, n_tokens: int = 32, context: int = 0, isas: tuple[str, ...] = ("native",),
        llama_bench: str | None = None, llama_bench_sse: str | None = None, bw_bytes: int | None = None,
        weights: tuple[str, ...] = ("auto",), llama_no_mmap: bool = False, segments: int = 4,
        kv: dict | None = None) -> dict:
    """One run of the table: each ISA level x each weights mode of this engine, then llama.cpp (native build,
    also with -lm none if llama_no_mmap, and the SSE4.2 build). Each row's floor comes from the bandwidth readings
    taken around its timing, for this engine also between `segments` runs of its steps (effective_bandwidth).
    kv: both engines' K/V cache types and rotation (llama_kv; None: each one's defaults)."""
    from ...backends.cpu.simd import SimdLib, best_isa

    gm = GGUFModel(path)
    args = model_args(gm)
    bpt = bytes_per_token(gm, args)
    bw_bytes = probe_bytes() if bw_bytes is None else bw_bytes
    probe = SimdLib(n_threads=threads)
    readings: list[float] = []

    def read_bw() -> float:
        readings.append(probe.read_bandwidth(bw_bytes))
        return readings[-1]

    measured: list[tuple] = []

    def add(engine, isa, tok_s, bw, counts, py=None, note="", secs=None):
        if tok_s is not None:
            measured.append((engine, isa, tok_s, (bw, counts, secs), note, py))

    def llama(exe, **kw):
        b0 = read_bw()
        tok_s = measure_llama(exe, path, threads, n_tokens, context, kv=kv, **kw)
        return tok_s, [b0, read_bw()], [n_tokens]

    for isa in isas:
        real = best_isa() if isa == "native" else isa
        for mode in weights:
            tok_s, py, used, bw, counts, secs = measure_ours(path, None if isa == "native" else isa, threads,
                                                             n_tokens, context, weights=mode, probe=read_bw,
                                                             segments=segments, kv=kv)
            add("hybridinfer", real, tok_s, bw, counts, py, f"weights: {used}", secs)
    if llama_bench:
        add("llama.cpp", "native", *llama(llama_bench), note="mmap")
        if llama_no_mmap:
            add("llama.cpp", "native", *llama(llama_bench, mmap=False), note="-lm none")
    if llama_bench_sse:
        add("llama.cpp", "sse4.2 (no AVX)", *llama(llama_bench_sse))
    if not readings:  # no engine timed: the floor from one reading
        read_bw()
    probe.close()
    bw = max(readings)
    rows = []
    for e, i, t, (b, counts, secs), n, py in measured:
        eff = effective_bandwidth(b, counts)
        runs = run_floor_fracs(b, counts, secs, bpt) if secs and len(secs) > 1 else None
        rows.append(Row(e, i, threads, t, t * bpt / 1e9, t * bpt / eff, n, py, eff / 1e9, [x / 1e9 for x in b], runs))
    return {"model": path, "arch": args.arch, "bytes_per_token": bpt, "read_bw_gb_s": bw / 1e9,
            "read_bw_readings_gb_s": [x / 1e9 for x in readings], "floor_tok_s": bw / bpt,
            "threads": threads, "context": context, "kv": kv or None, "rows": [asdict(r) for r in rows]}


def markdown(res: dict) -> str:
    rd = res.get("read_bw_readings_gb_s") or [res["read_bw_gb_s"]]
    out = [f"model `{res['model']}` ({res['arch']}); {res['bytes_per_token'] / 1e9:.3f} GB of weights per token; "
           f"read bandwidth with {res['threads']} threads {min(rd):.1f}-{max(rd):.1f} GB/s over {len(rd)} readings "
           f"(best: floor {res['floor_tok_s']:.2f} tok/s); each row against the readings taken before, after and "
           f"(this engine) between runs of its timed steps, each run's floor time at the mean of the two around it "
           f"(probe: the bandwidth of those floor times, the readings' range in brackets; % of floor: the row's, "
           f"and in brackets the range of its runs' own fractions); "
           f"context {res['context']}", "",
           "| engine | ISA | weights | threads | tok/s | weight GB/s | probe GB/s | % of floor "
           "| vs llama.cpp (same ISA, its best) | Python share |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    base: dict[str, float] = {}
    for r in res["rows"]:
        if r["engine"] == "llama.cpp":
            base[r["isa"]] = max(base.get(r["isa"], 0.0), r["tok_s"])
    for r in res["rows"]:
        ref = base.get("sse4.2 (no AVX)") if r["isa"] in ("ssse3", "scalar") else base.get("native")
        vs = f"{r['tok_s'] / ref:.2f}x" if ref and r["engine"] != "llama.cpp" else ""
        pg, pr = r.get("probe_gb_s"), r.get("probe_readings_gb_s") or []
        probe = "" if pg is None else f"{pg:.1f}" + (f" ({min(pr):.0f}-{max(pr):.0f})" if len(pr) > 1 else "")
        rf = r.get("run_floor_fracs") or []
        runs = f" ({100 * min(rf):.0f}-{100 * max(rf):.0f})" if rf else ""
        out.append(f"| {r['engine']} | {r['isa']} | {r.get('note', '')} | {r['threads']} | {r['tok_s']:.2f} | "
                   f"{r['gb_s']:.1f} | {probe} | {100 * r['floor_frac']:.0f}%{runs} | {vs} | "
                   f"{_pct(r.get('python_share'))} |")
    return "\n".join(out)


def _pct(x) -> str:
    return "" if x is None else f"<= {100 * x:.1f}%"


def plot(res: dict, png: str) -> bool:
    """Bar chart of tok/s with the floor; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    labels = [f"{r['engine']}\n{r['isa']}\n{r.get('note', '')}" for r in rows]
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 4))
    ax.bar(labels, [r["tok_s"] for r in rows], color=["C0" if r["engine"] == "hybridinfer" else "C1" for r in rows])
    ax.axhline(res["floor_tok_s"], color="k", ls="--", label=f"bandwidth floor {res['floor_tok_s']:.1f} tok/s")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"{res['arch']} decode, {res['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return True

"""Batched decode benchmark: one decode token for each of B sequences per step (`Backend.decode_batch`), its
aggregate and per-sequence tok/s against B = 1 and the weight bytes a step reads, side by side with llama.cpp's
`llama-batched-bench` (S_TG, its decode tok/s over all sequences).

A dense step reads every matrix once whatever B is (bytes_per_token of the decode bench), so aggregate tok/s can
grow with B until compute, not memory bandwidth, bounds the step. An MoE step reads the dense part once and each
expert that any of its B sequences routes to once: the union of their selections. On the CPU backend the union is
counted per layer from the routing of every timed step (the MoE block is wrapped while the steps run); elsewhere
the table gives the expectation under uniform routing, n_expert * (1 - (1 - k / n_expert)^B) per layer, and says so.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager

import numpy as np

from ...format.gguf_model import GGUFModel
from .batch_api import markdown as api_markdown
from .batch_api import measure_api
from .decode import bytes_per_token, llama_kv

UNIFORM_NOTE = ("Synthetic routing is uniform (random router weights), the worst case for sharing experts between "
                "sequences; a trained model's skewed routing lets a batch share more of them.")


def uniform_distinct(n_expert: int, k: int, B: int) -> float:
    """Expected distinct experts in one layer when B tokens each pick k of n_expert uniformly (each expert is
    missed by a token with probability 1 - k / n_expert, independently across tokens)."""
    return n_expert * (1.0 - (1.0 - k / n_expert) ** B) if n_expert else 0.0


def step_bytes(gm: GGUFModel, args, distinct: dict[int, float] | float | None = None) -> float:
    """Weight bytes one batched decode step reads: bytes_per_token with each expert tensor of layer i read for
    distinct[i] experts instead of k (a float: the same for every layer; None or a layer not given: k, one token's
    selection). The embedding's one row stands for the B rows a step gathers (a row is kilobytes)."""
    total = float(bytes_per_token(gm, args))
    k, E = getattr(args, "n_expert_used", 0), getattr(args, "n_expert", 0)
    if not E or distinct is None:
        return total
    for name, t in gm.tensors.items():
        if not name.endswith("_exps.weight"):
            continue
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        d = distinct if isinstance(distinct, float | int) else distinct.get(layer, k)
        total += t.nbytes * d / E - t.nbytes * k // E
    return total


@contextmanager
def routed_experts(backend):
    """While inside, each MoE layer call of the CPU backend appends (layer, its routing (T, k)) to the yielded list;
    None where the backend is not the CPU one (or wraps it), whose routing is not seen. The routing is copied, not
    reduced, inside the timed steps to keep them as they are."""
    from ...backends.cpu.backend import CPUModel

    cpu = getattr(backend, "cpu", backend)
    if not isinstance(cpu, CPUModel) or not cpu.args.is_moe:
        yield None
        return
    seen: list[tuple[int, np.ndarray]] = []
    orig = cpu._moe

    def moe(ops, x, *args):
        out = orig(ops, x, *args)
        seen.append((ops.i, ops.ws.route_idx[: x.shape[0]].copy()))
        return out

    cpu._moe = moe
    try:
        yield seen
    finally:
        del cpu._moe  # the class's method again


def _forget_recorded_steps(backend) -> None:
    """The CPU backend's recorded decode steps dropped, so that the next step runs (and records) through Python."""
    for ws in getattr(getattr(backend, "cpu", backend), "_ws", {}).values():
        ws.replays.clear()


def _distinct_per_layer(seen: list[tuple[int, np.ndarray]]) -> dict[int, float]:
    """Mean over the recorded steps of the distinct experts each layer's step routed to."""
    per: dict[int, list[int]] = {}
    for i, idx in seen:
        per.setdefault(i, []).append(int(np.unique(idx).size))
    return {i: float(np.mean(v)) for i, v in per.items()}


def _greedy(logits) -> list[int]:
    """The argmax token of each row of (B, n_vocab) logits (one row: (n_vocab,))."""
    return [int(x) for x in np.argmax(np.atleast_2d(logits), axis=-1)]


def measure_batch_decode(engine, batch_sizes=(1, 2, 4, 8, 16), n_steps: int = 32, prompt_len: int = 128,
                         seed: int = 0) -> list[dict]:
    """For each B: B fresh states, each prefilled with its own random prompt of prompt_len tokens, one warm-up
    step, then n_steps timed calls of engine.backend.decode_batch (greedy tokens fed back). One row per B:
    aggregate tok/s (B * steps / time), per-sequence tok/s, weight bytes per step and, for an MoE, the distinct
    experts per layer a step read (measured: the routing of up to 4 more steps of the same sequences; uniform: the
    expectation) next to the
    uniform-routing expectation. The engine's n_ctx must hold prompt_len + n_steps + 1 tokens."""
    gm, args, be = engine.gm, engine.args, engine.backend
    k, E = getattr(args, "n_expert_used", 0), getattr(args, "n_expert", 0)
    vocab = min(args.n_vocab, 32000)
    rows = []
    for B in batch_sizes:
        rng = np.random.default_rng([seed, B])
        states = [engine.new_state() for _ in range(B)]
        toks = [_greedy(engine.prefill([int(x) for x in rng.integers(0, vocab, prompt_len)], st)[-1])[0]
                for st in states]
        toks = _greedy(be.decode_batch(toks, states))  # warm-up: numba, workspaces, the recorded step
        t0 = time.perf_counter()
        for _ in range(n_steps):
            toks = _greedy(be.decode_batch(toks, states))
        dt = time.perf_counter() - t0
        # the routing, from more steps of the same sequences run through Python (a replayed step is not seen)
        with routed_experts(be) as seen:
            for _ in range(min(n_steps, 4) if seen is not None else 0):
                _forget_recorded_steps(be)
                toks = _greedy(be.decode_batch(toks, states))
        row = {"batch": B, "steps": n_steps, "seconds": dt, "tok_s": B * n_steps / dt, "per_seq_tok_s": n_steps / dt}
        if E:
            row["uniform_distinct_experts"] = uniform_distinct(E, k, B)
            if B == 1:  # one token's k experts are distinct
                row["experts_source"], row["distinct_experts"] = "measured", float(k)
                row["step_bytes"] = step_bytes(gm, args)
            elif seen:
                per = _distinct_per_layer(seen)
                row["experts_source"], row["distinct_experts"] = "measured", float(np.mean(list(per.values())))
                row["step_bytes"] = step_bytes(gm, args, per)
            else:
                row["experts_source"] = "uniform"
                row["distinct_experts"] = row["uniform_distinct_experts"]
                row["step_bytes"] = step_bytes(gm, args, row["distinct_experts"])
        else:
            row["step_bytes"] = step_bytes(gm, args)
        row["weight_gb_s"] = row["step_bytes"] * n_steps / dt / 1e9
        rows.append(row)
        del states
    base = next((r["tok_s"] for r in rows if r["batch"] == 1), None)
    for r in rows:
        r["speedup"] = r["tok_s"] / base if base else None
    return rows


# llama.cpp's llama-batched-bench --------------------------------------------------------------------------------

_MD_ROW = re.compile(r"^\|\s*\d+\s*\|")
_MD_KEYS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")


def parse_batched_bench(text: str) -> dict[int, dict]:
    """llama-batched-bench's results by parallel sequences (pl, its B): its jsonl lines (`--output-format jsonl`)
    or the rows of its markdown table (PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s),
    each as a dict with the jsonl keys (speed_tg: decode tok/s over all B sequences). A later row for the same
    pl (another pp or tg) replaces an earlier one."""
    out: dict[int, dict] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and "pl" in d and "speed_tg" in d:
                out[int(d["pl"])] = d
        elif _MD_ROW.match(line):
            cells = [c.strip() for c in line.strip("|").split("|")]
            try:
                vals = [float(c) for c in cells]
            except ValueError:
                continue
            if len(vals) == len(_MD_KEYS):
                d = dict(zip(_MD_KEYS, vals, strict=True))
                for key in ("pp", "tg", "pl", "n_kv"):
                    d[key] = int(d[key])
                out[d["pl"]] = d
    return out


def batched_bench_cmd(exe: str, path: str, threads: int, batch_sizes, prompt_len: int, n_steps: int,
                      kv: dict | None = None) -> list[str]:
    """The llama-batched-bench command line. Its context must hold every sequence's prompt and tokens at the
    largest B (it skips a B whose pl * (pp + tg) exceeds it, without a word). kv: the K/V types (decode.llama_kv)."""
    ctx = max(batch_sizes) * (prompt_len + n_steps)
    return [exe, "-m", path, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg",
            str(n_steps), "-npl", ",".join(str(b) for b in batch_sizes), "-t", str(threads),
            *(llama_kv(kv, ("off", "on"))[0] or ["-fa", "off"]), "--output-format", "jsonl"]


def measure_llama_batched(exe: str, path: str, threads: int, batch_sizes, prompt_len: int,
                          n_steps: int, kv: dict | None = None) -> dict[int, dict] | None:
    """llama-batched-bench's rows by B, or None if it is missing or fails."""
    found = shutil.which(exe) or (exe if exe and os.path.exists(exe) else None)
    if not found:
        return None
    r = subprocess.run(batched_bench_cmd(found, path, threads, batch_sizes, prompt_len, n_steps, kv),
                       capture_output=True, text=True, env=llama_kv(kv)[1])
    if r.returncode != 0:
        print(f"{found} failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        return None
    # its results go to stdout, its log to stderr; a build that logs elsewhere is read from both
    return parse_batched_bench(r.stdout) or parse_batched_bench(r.stderr) or None


# the run, the table, the plot -----------------------------------------------------------------------------------

def run(path: str, threads: int, batch_sizes=(1, 2, 4, 8, 16), n_steps: int = 32, prompt_len: int = 128,
        llama_batched_bench: str | None = None, weights: str = "auto", seed: int = 0, prefill_tokens: int = 0,
        llama_bench: str | None = None, llama_bench_sse: str | None = None, api: bool = True,
        kv: dict | None = None) -> dict:
    """This engine's batched decode on the CPU backend, then llama-batched-bench with the same B, prompt length
    and decode steps; with prefill_tokens, CPU prefill of one prompt that long (prefill_cpu) against llama-bench.
    kv: both engines' K/V cache types and rotation (decode.llama_kv; None: each one's defaults)."""
    from ...engine.api import Engine

    eng = Engine.load(path, backend="cpu", n_threads=threads, n_ctx=prompt_len + n_steps + 8, weights=weights,
                      max_seqs=max(batch_sizes), **(kv or {}))
    rows = measure_batch_decode(eng, batch_sizes, n_steps, prompt_len, seed)
    api_rows = measure_api(eng, batch_sizes, n_steps, prompt_len, seed) if api else None
    args = eng.args
    res = {"model": path, "arch": args.arch, "is_moe": bool(getattr(args, "n_expert", 0)),
           "n_expert": getattr(args, "n_expert", 0), "n_expert_used": getattr(args, "n_expert_used", 0),
           "bytes_per_token": bytes_per_token(eng.gm, args), "threads": threads, "isa": eng.backend.simd.isa,
           "weights": eng.backend.weights, "prompt_len": prompt_len, "steps": n_steps, "rows": rows,
           "llama_batched_bench": None, "api": api_rows, "kv": kv or None}
    del eng
    gc.collect()  # the weights' copy goes before llama.cpp loads its own
    if llama_batched_bench:
        lrows = measure_llama_batched(llama_batched_bench, path, threads, batch_sizes, prompt_len, n_steps, kv)
        if lrows is not None:
            res["llama_batched_bench"] = {"cmd": batched_bench_cmd(llama_batched_bench, path, threads, batch_sizes,
                                                                   prompt_len, n_steps, kv),
                                          "rows": {str(b): v for b, v in lrows.items()}}
            for r in rows:
                lr = lrows.get(r["batch"])
                r["llama_tok_s"] = float(lr["speed_tg"]) if lr else None
                r["ratio"] = r["tok_s"] / r["llama_tok_s"] if r["llama_tok_s"] else None
    if prefill_tokens:
        from . import prefill_cpu

        res["prefill"] = prefill_cpu.run(path, threads, prefill_tokens, llama_bench, llama_bench_sse, kv=kv)
    return res


def _f(x, fmt: str = ".2f", suffix: str = "") -> str:
    return "" if x is None else f"{x:{fmt}}{suffix}"


def markdown(res: dict) -> str:
    moe = res["is_moe"]
    uniform = any(r.get("experts_source") == "uniform" for r in res["rows"])
    what = ("the dense part once and, per layer, each expert any sequence routed to (the union, "
            + ("the uniform-routing expectation n_expert * (1 - (1 - k/n_expert)^B)" if uniform else
               "counted from the routing of steps after the timed ones, mean over steps") + ")") \
        if moe else "every matrix once"
    out = [f"model `{res['model']}` ({res['arch']}"
           + (f", {res['n_expert_used']} of {res['n_expert']} experts" if moe else "")
           + f"); {res['threads']} threads, ISA {res['isa']}, weights: {res['weights']}; prompt {res['prompt_len']} "
           f"tokens per sequence, {res['steps']} decode steps timed; a step reads {what}", ""]
    head = ["B", "this engine aggregate tok/s", "per-seq tok/s", "x vs B=1", "weight GB read per step"]
    if moe:
        head.append("experts/layer (uniform expectation)" + ("*" if uniform else ""))
    head += ["llama.cpp S_TG tok/s", "ratio"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        cells = [str(r["batch"]), _f(r["tok_s"]), _f(r["per_seq_tok_s"]), _f(r.get("speedup"), ".2f", "x"),
                 _f(r["step_bytes"] / 1e9, ".4f")]
        if moe:
            cells.append(f"{r['distinct_experts']:.2f} ({r['uniform_distinct_experts']:.2f})")
        cells += [_f(r.get("llama_tok_s")), _f(r.get("ratio"), ".2f", "x")]
        out.append("| " + " | ".join(cells) + " |")
    if moe:
        out.append("")
        if uniform:
            out.append("* the backend's routing is not seen: the experts per layer and the GB per step are the "
                       "uniform-routing expectation.")
        out.append(UNIFORM_NOTE)
    if res.get("api"):
        out += ["", api_markdown(res["api"], res["prompt_len"], res["steps"])]
    if res.get("prefill"):
        from . import prefill_cpu

        out += ["", prefill_cpu.markdown(res["prefill"])]
    return "\n".join(out)


def plot(res: dict, png: str) -> bool:
    """Aggregate tok/s against B (this engine, llama.cpp) and the weight GB a step reads; False without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    bs = [r["batch"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax.plot(bs, [r["tok_s"] for r in rows], "o-", label="hybridinfer (decode_batch)")
    lb = [(r["batch"], r["llama_tok_s"]) for r in rows if r.get("llama_tok_s")]
    if lb:
        ax.plot(*zip(*lb, strict=True), "s-", label="llama.cpp (llama-batched-bench S_TG)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("sequences per step (B)")
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_title(f"{res['arch']} batched decode, {res['threads']} threads")
    ax.legend(fontsize=8)
    ax2.plot(bs, [r["step_bytes"] / 1e9 for r in rows], "o-", color="C2")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(bs, [str(b) for b in bs])
    ax2.set_xlabel("sequences per step (B)")
    ax2.set_ylabel("weight GB read per step")
    ax2.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True

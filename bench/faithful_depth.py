"""Full-depth faithfulness: four engines score the same fixed token sequence (teacher forcing), pairwise compared.

    python bench/faithful_depth.py -m tame.gguf --llama-tf .llamabin/llama-teacher-forced [--prefill 32 -n 64]

Engines (each gives one logits row per position of the same n tokens):
  cpu        this engine's CPU backend: the first --prefill tokens in one prefill, then one decode step per token
  gpu        backend "gpu": GPU prefill of the same first tokens, then CPU decode steps (--no-gpu leaves it out)
  cpu-ISA    as cpu, with the SIMD path forced to ISA (--isa, repeatable; e.g. ssse3)
  llama-b    llama.cpp, all n tokens in one batch (bench/llama_teacher_forced.cpp, UBATCH 0)
  llama-1    llama.cpp, one token per llama_decode (UBATCH 1)
llama.cpp runs with F32 K/V and no flash attention, as this engine keeps its cache. The table gives, per pair, top-1
agreement over the n positions and max |logit difference| as a fraction of max |logit|. On a deep synthetic file
this only means something when the file is depth-scaled (`hybridinfer synth --residual-scale auto`): a plain
random one is chaotic, and even llama.cpp's two paths then disagree on most positions.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def token_ids(n_vocab: int, n: int, seed: int = 5) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, min(n_vocab, 1 << 16), n)]


def engine_logits(path: str, ids: list[int], n_prefill: int, backend: str, threads: int | None,
                  isa: str | None = None) -> np.ndarray:
    """Rows for every position: a prefill of ids[:n_prefill] (all logits), then one decode step per later token."""
    from hybridinfer.engine.api import Engine

    eng = Engine.load(path, backend=backend, n_ctx=len(ids) + 16, n_threads=threads, isa=isa)
    st = eng.new_state()
    rows = [np.asarray(eng.prefill(ids[:n_prefill], st, all_logits=True), np.float32)]
    for t in ids[n_prefill:]:
        rows.append(np.asarray(eng.backend.forward([t], st, all_logits=False)[-1:], np.float32).copy())
    out = np.concatenate(rows)
    del eng, st
    gc.collect()
    return out


def llama_logits(binary: str, path: str, ids: list[int], ubatch: int, threads: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        tok, out = os.path.join(d, "ids.i32"), os.path.join(d, "logits.f32")
        np.asarray(ids, np.int32).tofile(tok)
        r = subprocess.run([binary, path, tok, out, str(ubatch), str(threads)], capture_output=True, text=True,
                           errors="replace")
        if r.returncode != 0:
            raise RuntimeError(f"{binary} failed ({r.returncode}): {r.stderr[-800:]}")
        return np.fromfile(out, np.float32).reshape(len(ids), -1)


def pair_table(res: dict[str, np.ndarray]) -> tuple[str, list[dict]]:
    """Markdown table and records of top-1 agreement and max |d| / max |logit| for every pair of engines."""
    names = list(res)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            x, y = res[a], res[b]
            scale = float(max(np.abs(x).max(), np.abs(y).max()))
            rows.append({"a": a, "b": b, "top1": float(np.mean(x.argmax(-1) == y.argmax(-1))),
                         "max_abs_diff": float(np.abs(x - y).max()), "max_abs_logit": scale})
    lines = ["| engine A | engine B | top-1 agreement | max abs diff | of max abs logit |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r['a']} | {r['b']} | {r['top1']:.1%} | {r['max_abs_diff']:.3g} | "
              f"{r['max_abs_diff'] / r['max_abs_logit']:.2%} |" for r in rows]
    return "\n".join(lines), rows


def margins(x: np.ndarray) -> tuple[float, float]:
    """Median and 10th percentile over positions of the top-1 logit minus the next lower value (a synthetic head
    repeats rows, so equal logits are common and say nothing about how close a top-1 call is)."""
    top = x.max(-1, keepdims=True)
    m = (top - np.where(x < top, x, -np.inf).max(-1, keepdims=True))[:, 0]
    return float(np.median(m)), float(np.percentile(m, 10))


def report(a, args, res: dict[str, np.ndarray]) -> None:
    table, rows = pair_table(res)
    med, p10 = margins(res["cpu"])
    head = (f"{os.path.basename(a.model)}: {args.n_layer} layers, vocab {args.n_vocab}; {a.n} positions "
            f"(prefill {a.prefill}, then decode), top-1 margin median {med:.3g}, 10th percentile {p10:.3g}")
    print(head + "\n\n" + table, flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "faithful_depth.md"), "w") as f:
            f.write(head + "\n\n" + table + "\n")
        with open(os.path.join(a.out, "faithful_depth.json"), "w") as f:
            json.dump({"model": a.model, "n": a.n, "prefill": a.prefill, "margin_median": med, "margin_p10": p10,
                       "pairs": rows}, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama-tf", default=None, help="bench/llama_teacher_forced.cpp's binary (omit: no llama.cpp)")
    ap.add_argument("-n", type=int, default=64, help="positions scored")
    ap.add_argument("--prefill", type=int, default=32, help="positions scored by a prefill (the rest by decode)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--isa", action="append", default=[], help="also the CPU engine at this forced SIMD path")
    ap.add_argument("--out", default=None, help="write the table (.md) and records (.json) under this folder")
    a = ap.parse_args(argv)
    if not 0 < a.prefill <= a.n:
        ap.error(f"--prefill must be in 1..n ({a.n}), got {a.prefill}")
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args

    args = model_args(GGUFModel(a.model))
    ids = token_ids(args.n_vocab, a.n)
    threads = a.threads or os.cpu_count() or 1
    runs = [("cpu", lambda: engine_logits(a.model, ids, a.prefill, "cpu", a.threads))]
    if not a.no_gpu:
        runs.append(("gpu", lambda: engine_logits(a.model, ids, a.prefill, "gpu", a.threads)))
    if a.llama_tf:
        runs.append(("llama-b", lambda: llama_logits(a.llama_tf, a.model, ids, 0, threads)))
        runs.append(("llama-1", lambda: llama_logits(a.llama_tf, a.model, ids, 1, threads)))
    for isa in a.isa:
        runs.append((f"cpu-{isa}", lambda isa=isa: engine_logits(a.model, ids, a.prefill, "cpu", a.threads, isa)))
    res: dict[str, np.ndarray] = {}
    for name, fn in runs:  # the table so far after each engine: a run cut short still reports
        t0 = time.perf_counter()
        res[name] = fn()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        report(a, args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

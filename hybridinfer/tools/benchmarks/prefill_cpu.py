"""CPU prefill, part of `bench batch`: one prompt of P tokens through the CPU backend at its best ISA and forced to
SSSE3, next to llama.cpp's `llama-bench -p P -n 0` built natively and built for SSE4.2 (no AVX), same GGUF, same
threads, in one run. The products' FLOPs (2 x matrix elements x tokens, experts at k of their n, the head once)
over the time give the GFLOP/s each engine reached; the ratio to llama.cpp is the figure that matters, since
both run the same integer products (llama.cpp's float order is the one this engine reproduces)."""

from __future__ import annotations

import gc
import time

import numpy as np

from .decode import measure_llama
from .prefill import gemm_flops


def measure_ours(path: str, isa: str | None, threads: int, tokens: int, reps: int = 2, seed: int = 0,
                 kv: dict | None = None) -> dict:
    """The best of `reps` cold prefills of one random prompt (one forward call of all its tokens, last logits only)
    after a short warm-up: the engine, the ISA it ran, tok/s and seconds."""
    from ...engine.api import Engine

    eng = Engine.load(path, backend="cpu", n_threads=threads, n_ctx=tokens + 8, prefill_chunk=tokens, isa=isa,
                      **(kv or {}))
    be = eng.backend
    ids = np.random.default_rng(seed).integers(0, min(eng.args.n_vocab, 32000), tokens).tolist()
    be.forward(ids[:16], be.new_state(tokens + 8), all_logits=False)
    best = float("inf")
    for _ in range(reps):
        st = be.new_state(tokens + 8)
        t0 = time.perf_counter()
        be.forward(ids, st, all_logits=False)
        best = min(best, time.perf_counter() - t0)
    row = {"engine": "hybridinfer", "build": be.simd.isa, "tok_s": tokens / best, "seconds": best}
    del eng, be
    gc.collect()
    return row


def run(path: str, threads: int, tokens: int = 512, llama_bench: str | None = None,
        llama_bench_sse: str | None = None, isas: tuple[str | None, ...] = (None, "ssse3"),
        kv: dict | None = None) -> dict:
    """Rows for this engine at each ISA (None: the best this CPU runs) and llama-bench's builds; each of this
    engine's rows gets its ratio to the llama.cpp build of its class (SSSE3 against the SSE4.2 build). kv: both
    engines' K/V cache types and rotation (decode.llama_kv; None: each one's defaults)."""
    from ...format.gguf_model import GGUFModel
    from ...models import model_args

    gm = GGUFModel(path)
    flops = gemm_flops(gm, model_args(gm), tokens)
    del gm
    rows = [measure_ours(path, isa, threads, tokens, kv=kv) for isa in isas]
    for r in rows:
        r["gflop_s"] = flops / r["seconds"] / 1e9
    llama = {}
    for name, exe in (("native", llama_bench), ("sse4.2", llama_bench_sse)):
        tok_s = measure_llama(exe, path, threads, 0, 0, prompt=tokens, kv=kv) if exe else None
        if tok_s:
            llama[name] = tok_s
            rows.append({"engine": "llama.cpp", "build": name, "tok_s": tok_s, "seconds": tokens / tok_s,
                         "gflop_s": flops * tok_s / tokens / 1e9})
    for r in rows:
        if r["engine"] == "hybridinfer":
            ref = llama.get("sse4.2" if r["build"] in ("ssse3", "scalar") else "native")
            r["vs_llama"] = r["tok_s"] / ref if ref else None
    return {"tokens": tokens, "threads": threads, "rows": rows}


def markdown(res: dict) -> str:
    out = [f"CPU prefill of one {res['tokens']}-token prompt, {res['threads']} threads (llama.cpp: `llama-bench "
           f"-p {res['tokens']} -n 0`; this engine at SSSE3 against llama.cpp's SSE4.2 build)", "",
           "| engine | build / ISA | tok/s | GFLOP/s of the products | x llama.cpp |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        vs = r.get("vs_llama")
        out.append(f"| {r['engine']} | {r['build']} | {r['tok_s']:.1f} | {r['gflop_s']:.1f} | "
                   + (f"{vs:.2f}x" if vs else "") + " |")
    return "\n".join(out)

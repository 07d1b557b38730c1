"""Prefill and decode at context depth (`hybridinfer bench context`), per K/V cache type, beside llama.cpp's
`llama-bench -d DEPTH` in the same run.

At each depth D this engine first prefills D random tokens, untimed (llama-bench -d prefills its depth untimed too),
then times a P-token prefill (pp) and N greedy decode steps (tg), each started from the state at D: between timings
the state is rewound to D. Rewinding copies back only the recurrent arrays, since K/V rows before D never change once
written. One state per cache type grows from depth to depth (chunking changes no bit, docs/numerics.md), so the
depth prefill costs the largest depth once rather than the sum of all of them.

Floors: a decoded token reads the weights one token reads (decode.bytes_per_token), the recurrent state and the K/V
rows of every position before it. Those bytes over the read bandwidth measured just before and after the timed steps
give the row's fraction of its floor. Prefill has no bandwidth floor; its GFLOP/s counts the products and the
attention over the depth (gpu/work.prefill_work at pos0 = D).

llama.cpp at depth with a CUDA build (llama_bench_cuda): a CPU-only llama-bench prefills the depth on the CPU, which
at 32K-128K takes far longer than the decode it measures. llama-bench keeps the depth's state in one cache across its
test instances (tools/llama-bench: ctx_state, restored with llama_state_seq_set_data when the depth matches), so
`-ngl 99,0 --no-host 1 -p 0` prefills the depth once on the card (-ngl 99) and restores it into the -ngl 0 instance,
whose decode runs on the CPU (a batch of one is never offloaded). --no-host 1 keeps that instance's weights in the
CPU's repacked buffers, as a CPU-only build does, rather than unrepacked in pinned host memory. Only rows with
n_gpu_layers 0 are llama.cpp's CPU figures. One call per depth and -fa value: the cache holds one depth, and a state
saved with flash attention off (V transposed) is not restored into an instance with it on, which would prefill again
on the CPU. No pp: a prompt batch at -ngl 0 is offloaded to the card.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import numpy as np

from ...errors import ParameterError
from ...format.quant_types import CACHE_TYPES, cache_type
from ...models.state_kinds import layer_arrays, state_bytes, with_cache_types
from .decode import bytes_per_token, effective_bandwidth, greedy_steps, probe_bytes

DEFAULT_DEPTHS = (1024, 8192, 32768, 131072)
DEFAULT_CACHE_TYPES = "f32,f16,q8_0,q4_0"
# what llama-bench's -ctk / -ctv take (tools/llama-bench: ggml_type_from_name): no f32, unlike llama-cli's
LLAMA_BENCH_KV = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")


def parse_cache_types(spec: str) -> list[tuple[str, str]]:
    """--cache-types: comma-separated entries, each a type for both K and V ("q8_0") or a K/V pair ("q8_0/q4_0")."""
    out: list[tuple[str, str]] = []
    for item in (x.strip() for x in str(spec).split(",")):
        if not item:
            continue
        parts = [p.strip().lower() for p in item.split("/")]
        if len(parts) > 2 or any(p not in CACHE_TYPES for p in parts):
            raise ParameterError(f"--cache-types entry {item!r}: give a type or a K/V pair such as q8_0/q4_0, each "
                                 f"one of {', '.join(CACHE_TYPES)}")
        pair = (parts[0], parts[-1])
        if pair not in out:
            out.append(pair)
    if not out:
        raise ParameterError(f"--cache-types names no cache type: {spec!r}")
    return out


def type_label(k: str, v: str) -> str:
    return k if k == v else f"{k}/{v}"


def kv_bytes(args, n_tokens: int) -> int:
    """Bytes of the per-token (K/V) rows of n_tokens positions over every layer that keeps them, in args' types."""
    return sum(s.nbytes(args, n_tokens) for _, s in layer_arrays(args.layer_types) if s.per_token)


def llama_knows(t: str) -> bool:
    return t in LLAMA_BENCH_KV


def fa_values(k: str, v: str) -> tuple[int, ...]:
    """llama-bench's -fa values for these types: llama.cpp refuses a quantized V without flash attention."""
    return (1,) if cache_type(v).block > 1 else (0, 1)


class Mark:
    """A state's position and a copy of its recurrent arrays: enough to rewind it there later."""

    def __init__(self, st):
        self.pos = st.pos
        self.saved = [(s.name, i, a.copy()) for s, i, a in st.held(per_token=False)]

    def rewind(self, st) -> None:
        # in place, so the backend's recorded decode step (bound to these arrays) stays valid
        st.pos = self.pos
        for name, i, a in self.saved:
            st.arrays[name][i][...] = a


def _simd_isa(be) -> str | None:
    simd = getattr(be, "simd", None) or getattr(getattr(be, "cpu", None), "simd", None)
    return getattr(simd, "isa", None)


def plan_depths(args, depths, prompt: int, gen: int, room: int | None) -> tuple[list[int], dict[int, str]]:
    """The depths one state can be taken to (ascending) and why each other one is skipped: beyond the model's trained
    context, or a state larger than the memory available (room: bytes, None where unknown)."""
    keep, skipped = [], {}
    trained = int(args.context_length)
    for d in sorted(set(depths)):
        need = d + prompt + gen + 1
        if need > trained:
            skipped[d] = f"{d} + {prompt} + {gen} tokens exceed the trained context of {trained}"
        elif room is not None and state_bytes(args, need) > room:
            skipped[d] = (f"the state at {need} tokens ({state_bytes(args, need) / 2**30:.1f} GiB) exceeds the "
                          f"{room / 2**30:.1f} GiB of memory available")
        else:
            keep.append(d)
    return keep, skipped


def measure_ours(path: str, backend: str, k: str, v: str, depths: list[int], prompt: int, gen: int, threads: int,
                 isa: str | None, reps: int, probe=None, seed: int = 0) -> tuple[list[dict], str | None]:
    """This engine at each depth (ascending): rows of depth, pp and tg seconds per rep, their tok/s (the mean of
    the reps' rates, as llama-bench's avg_ts) and probe()'s readings around the timed decode steps; and the ISA."""
    from ...engine.api import Engine

    opts = {} if backend == "reference" else {"n_threads": threads, "isa": isa}
    eng = Engine.load(path, backend=backend, n_ctx=max(depths) + prompt + gen + 8, cache_type_k=k, cache_type_v=v,
                      **opts)
    rows = []
    try:
        be = eng.backend
        rng = np.random.default_rng(seed)
        vocab = min(eng.args.n_vocab, 32000)
        st = eng.new_state()
        warm = False
        for d in depths:
            if d + prompt + gen + 1 > eng.n_ctx:  # a backend that took fewer tokens (a GPU's VRAM budget)
                rows.append({"depth": d, "skipped": eng.ctx_note or f"the engine holds {eng.n_ctx} tokens"})
                continue
            n, t0 = d - st.pos, time.perf_counter()
            last = eng.prefill(rng.integers(0, vocab, n).tolist(), st)[-1]
            depth_s = time.perf_counter() - t0
            mark = Mark(st)
            ids = rng.integers(0, vocab, prompt).tolist()
            if not warm:  # first use of the prompt's work buffers, untimed (llama-bench's warm-up run)
                eng.prefill(ids, st)
                mark.rewind(st)
                warm = True
            pp = []
            for _ in range(reps):
                t0 = time.perf_counter()
                eng.prefill(ids, st)
                pp.append(time.perf_counter() - t0)
                mark.rewind(st)
            tok = int(np.argmax(last))
            be.forward([tok], st, all_logits=False)  # records the decode step at this depth, untimed
            mark.rewind(st)
            tg, bw = [], [probe()] if probe else []
            for _ in range(reps):
                tg.append(greedy_steps(be, st, tok, gen)[1])
                mark.rewind(st)
                if probe:
                    bw.append(probe())
            rows.append({"depth": d, "depth_prefill_tokens": n, "depth_prefill_s": depth_s, "pp_s": pp, "tg_s": tg,
                         "pp_tok_s": float(np.mean([prompt / s for s in pp])),
                         "tg_tok_s": float(np.mean([gen / s for s in tg])), "readings": bw})
        return rows, _simd_isa(be)
    finally:
        eng.close()


def llama_cmd(exe: str, path: str, threads: int, prompt: int, gen: int, depth: int, k: str, v: str,
              reps: int, cuda: bool = False, fa: int | None = None) -> list[str]:
    """llama-bench at one depth: pp and tg there with each flash-attention setting llama.cpp takes for the types;
    cuda (a CUDA build): tg alone at -fa fa, the depth prefilled on the card (-ngl 99) and restored into a CPU
    instance (-ngl 0, --no-host 1: weights in the CPU's repacked buffers), as the module's docstring says."""
    fas = ",".join(map(str, fa_values(k, v) if fa is None else (fa,)))
    if cuda:
        return [exe, "-m", path, "-p", "0", "-n", str(gen), "-d", str(depth), "-ctk", k, "-ctv", v, "-fa", fas,
                "-ngl", "99,0", "--no-host", "1", "-t", str(threads), "-r", str(reps), "-o", "json"]
    return [exe, "-m", path, "-p", str(prompt), "-n", str(gen), "-d", str(depth), "-ctk", k, "-ctv", v,
            "-fa", fas, "-t", str(threads), "-r", str(reps), "-o", "json"]


def parse_llama_json(text: str) -> list[dict]:
    """The test objects of llama-bench's `-o json` (a list) or jsonl output; from a run cut short (llama-bench exits
    mid-list on a failure), the objects it printed before it stopped."""
    dec, out, i = json.JSONDecoder(), [], 0
    while (j := text.find("{", i)) >= 0:
        try:
            obj, i = dec.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        if isinstance(obj, dict) and "avg_ts" in obj:
            out.append(obj)
    return out


def llama_results(rows: list[dict], depth: int, k: str, v: str, cpu_only: bool = False) -> dict[str, dict]:
    """{fa: {"pp_tok_s", "tg_tok_s"}} of llama-bench's objects at this depth and these types (fa as "0" / "1");
    cpu_only: those with n_gpu_layers 0 alone (a CUDA build's -ngl 99,0: the -ngl 99 rows are the card's)."""
    got: dict[str, dict] = {}
    for r in rows:
        if int(r.get("n_depth", depth)) != depth or (r.get("type_k", k), r.get("type_v", v)) != (k, v):
            continue
        if cpu_only and int(r.get("n_gpu_layers", -1)) != 0:
            continue
        n_p, n_g = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
        what = "pp_tok_s" if n_p > 0 and n_g == 0 else "tg_tok_s" if n_g > 0 and n_p == 0 else None
        if what:  # flash_attn: an int (-1 auto, 0, 1) in today's llama-bench, a bool in older ones
            got.setdefault(str(int(r.get("flash_attn", -1))), {})[what] = float(r["avg_ts"])
    return got


def _llama_call(cmd: list[str], exe: str) -> tuple[list[dict], str | None]:
    """One llama-bench run: the test objects it printed, and what went wrong (None: nothing)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        return [], f"could not run {exe}: {e.strerror or e}"
    if not r.returncode:
        return parse_llama_json(r.stdout), None
    tail = (r.stderr.strip().splitlines() or [""])[-1][-200:]
    how = f"exit status {r.returncode}"
    if r.returncode < 0:
        try:
            how = f"killed by {signal.Signals(-r.returncode).name}"
        except ValueError:
            pass
    return parse_llama_json(r.stdout), (f"{how}" + (f": {tail}" if tail else "")
                                        + (" (built for another CPU?)" if r.returncode == -signal.SIGILL else ""))


def measure_llama(exe: str, path: str, threads: int, prompt: int, gen: int, depth: int, k: str, v: str,
                  reps: int, cuda: bool = False) -> tuple[dict[str, dict], str | None]:
    """llama-bench's tok/s at one depth by flash-attention setting, and what went wrong (None: nothing). cuda: a
    CUDA build, one call per -fa value, its n_gpu_layers 0 rows alone (llama_cmd, llama_results)."""
    exe_path = shutil.which(exe) or exe
    calls = ([llama_cmd(exe_path, path, threads, prompt, gen, depth, k, v, reps, True, fa) for fa in fa_values(k, v)]
             if cuda else [llama_cmd(exe_path, path, threads, prompt, gen, depth, k, v, reps)])
    got: dict[str, dict] = {}
    errs = []
    for cmd in calls:
        rows, err = _llama_call(cmd, exe)
        for fa, x in llama_results(rows, depth, k, v, cpu_only=cuda).items():
            got.setdefault(fa, {}).update(x)
        if err:
            errs.append(err if len(calls) == 1 else f"-fa {cmd[cmd.index('-fa') + 1]}: {err}")
        if err and err.startswith("could not run"):
            break
    if not errs and not got:
        errs.append("no results at this depth and these types in its output"
                    + (" with n_gpu_layers 0" if cuda else ""))
    return got, "; ".join(errs) or None


def decode_bytes(weights: int, recurrent: int, kv_per_token: int, depth: int, gen: int) -> tuple[float, float]:
    """(K/V bytes one decoded token reads, all bytes it reads) over steps at positions depth .. depth + gen - 1: the
    step at position p reads p + 1 rows (its own included), depth + (gen + 1) / 2 on average."""
    kv = kv_per_token * (depth + (gen + 1) / 2)
    return kv, weights + recurrent + kv


def run(path: str, threads: int, depths=DEFAULT_DEPTHS, cache_types=(("f32", "f32"),), prompt: int = 512,
        gen: int = 32, backend: str = "cpu", isa: str | None = None, llama_bench: str | None = None, reps: int = 2,
        bw_bytes: int | None = None, seed: int = 0, llama_bench_cuda: str | None = None) -> dict:
    """Every cache type x depth: this engine's pp and tg, and llama-bench's where given (llama_bench_cuda: a CUDA
    build instead, its depth prefilled on the card and its tg on the CPU, as the module's docstring says). bw_bytes:
    the read-bandwidth probe's buffer (None: decode.probe_bytes(); 0: no probe, no floors)."""
    if llama_bench and llama_bench_cuda:
        raise ParameterError("give llama-bench (CPU build) or llama-bench-cuda, not both")
    peer = llama_bench_cuda or llama_bench
    from ...backends.cpu.simd import SimdLib
    from ...backends.gpu.work import prefill_work
    from ...engine.context import room_beside
    from ...format.gguf_model import GGUFModel
    from ...models import model_args

    gm = GGUFModel(path)
    base = model_args(gm)
    weights = bytes_per_token(gm, base)
    recurrent = state_bytes(base, 0)
    bw_bytes = probe_bytes() if bw_bytes is None else bw_bytes
    lib = SimdLib(n_threads=threads) if bw_bytes else None
    probe = (lambda: lib.read_bandwidth(bw_bytes)) if lib else None
    rows, ran_isa = [], None
    try:
        for k, v in cache_types:
            args = with_cache_types(base, k, v)
            keep, skipped = plan_depths(args, depths, prompt, gen, room_beside(gm.file_size))
            ours, ran_isa = (measure_ours(path, backend, k, v, keep, prompt, gen, threads, isa, reps, probe, seed)
                             if keep else ([], ran_isa))
            by_depth = {r["depth"]: r for r in ours}
            kvpt = kv_bytes(args, 1)
            for d in sorted(set(depths)):
                row = {"type": type_label(k, v), "k": k, "v": v, "depth": d, "kv_bytes_per_token": kvpt,
                       "kv_bytes": kv_bytes(args, d), "state_bytes": state_bytes(args, d)}
                m = by_depth.get(d, {"skipped": skipped.get(d)})
                row.update(m)
                readings = row.pop("readings", None)
                if "pp_tok_s" in row:
                    work = prefill_work(gm, args, prompt, pos0=d)
                    row["pp_gflop_s"] = work.flops * row["pp_tok_s"] / prompt / 1e9
                    kv_read, total = decode_bytes(weights, recurrent, kvpt, d, gen)
                    row.update(kv_read_per_token=kv_read, tg_bytes_per_token=total)
                    if readings:
                        bw = effective_bandwidth(readings, [gen] * reps)
                        row.update(probe_gb_s=bw / 1e9, readings_gb_s=[x / 1e9 for x in readings],
                                   tg_floor_frac=row["tg_tok_s"] * total / bw)
                if peer and not row.get("skipped") and not (llama_knows(k) and llama_knows(v)):
                    row["llama_note"] = (f"not run: llama-bench takes no {k if not llama_knows(k) else v} K/V "
                                         f"(its types: {', '.join(LLAMA_BENCH_KV)})")
                elif peer and not row.get("skipped"):
                    b0 = probe() if probe else None
                    got, err = measure_llama(peer, path, threads, prompt, gen, d, k, v, reps, bool(llama_bench_cuda))
                    row["llama"], row["llama_error"] = got, err
                    if probe and got:
                        bw = (b0 + probe()) / 2  # the llama-bench call's timings lie somewhere between them
                        for r in got.values():
                            if "tg_tok_s" in r:
                                r["tg_floor_frac"] = r["tg_tok_s"] * row.get("tg_bytes_per_token", 0) / bw
                rows.append(row)
    finally:
        if lib is not None:
            lib.close()
    _relative(rows)
    return {"model": path, "arch": base.arch, "backend": backend, "isa": ran_isa, "threads": threads,
            "prompt": prompt, "gen": gen, "reps": reps, "depths": sorted(set(depths)),
            "cache_types": [type_label(k, v) for k, v in cache_types], "weights_bytes_per_token": weights,
            "recurrent_bytes": recurrent, "llama_bench": llama_bench, "llama_bench_cuda": llama_bench_cuda,
            "rows": rows}


def _relative(rows: list[dict]) -> None:
    """Each measured row's tg against the shallowest measured depth of its type, and this engine against
    llama.cpp's faster flash-attention setting at the same depth and types."""
    first: dict[str, float] = {}
    for r in rows:
        if "tg_tok_s" in r:
            first.setdefault(r["type"], r["tg_tok_s"])
            r["tg_vs_first"] = r["tg_tok_s"] / first[r["type"]]
        for what in ("pp", "tg"):
            best = max((x.get(f"{what}_tok_s", 0.0) for x in (r.get("llama") or {}).values()), default=0.0)
            if best and f"{what}_tok_s" in r:
                r[f"{what}_vs_llama"] = r[f"{what}_tok_s"] / best

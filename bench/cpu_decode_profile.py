"""Where a CPU decode step's time goes: every native call of `forward` timed by call site.

    python bench/cpu_decode_profile.py -m model.gguf -t 16 [-n 16] [--isa native] [--pool]

Times n real decode steps (with --rows R, verify steps of R rows; with --batch B, decode steps of B sequences; one
native call each after the first), then records the step afresh with every call labelled, turns on the native
step's own clock (hi_replay_run: two clock reads per call), runs n more and prints, per kind of call, the time per
token, its share of the step, and for weight products the weight bytes read and the GB/s they ran at (against the
machine's read bandwidth measured by the same library). "Outside the native calls" is the wall time no call
accounts for (Python, the embedding row, sampling, a verify step's rollback). --pool instead runs plain steps with
the thread pool's clocks on (SimdLib.pool_stats) and prints where a pooled call's wall time goes besides its
chunks' work.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from hybridinfer.backends.cpu.replay import Steps
from hybridinfer.backends.cpu.simd import KQ_ZIPPED, base_type
from hybridinfer.engine.api import Engine
from hybridinfer.format.quant import type_name as _type_name
from hybridinfer.tools.benchmarks.decode import greedy_steps


def type_name(q: int) -> str:
    """A qtype's name, "z" appended for rows repacked zipped (SimdLib.repack)."""
    return _type_name(base_type(q)) + ("z" if q & KQ_ZIPPED else "")


def _pool_round_trip(simd, reps: int = 2000) -> tuple[float, float]:
    """Microseconds of one pooled product too small to matter (1024 x 256 Q4_K, just above the size run on the
    calling thread alone) minus the same on the calling thread: the pool's wake-up and join."""
    from hybridinfer.backends.cpu.simd import SimdLib

    rows, cols = 1024, 256
    w = np.zeros(rows * cols // 256 * 144, np.uint8)
    out = np.zeros(rows, np.float32)
    res = []
    for lib in (simd, SimdLib(simd.isa, n_threads=1)):
        xq = lib.quantize(np.ones(cols, np.float32), 12)
        f = lib.bind("matmul", w, 12, rows, cols, xq, out)
        for _ in range(100):
            f()
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            f()
        res.append((time.perf_counter_ns() - t0) / reps / 1e3)
    return res[0], res[1]


def _start(eng, prompt=(1, 2, 3, 4)):
    """A new sequence after a short prompt: its state and the greedy next token."""
    st = eng.new_state()
    return st, int(np.argmax(eng.prefill(list(prompt), st)[-1]))


def _steps_fn(eng, R: int, B: int):
    """n steps of R rows from token t: plain greedy decode steps (R 1), or verify steps of R rows of one sequence
    (its token and R - 1 drafts, every row rejected and rolled back as a fully missed draft is: the state's
    position moves on by one a step); with B > 1, batched decode steps of B sequences of their own (st unused), each
    from its own prompt and on its own greedy tokens: sequences fed the same token would route every row of an MoE
    layer to the same experts, which a batch of real requests does not (random routing reads ~56 experts a layer
    for 8 rows of the 35B-A3B, not 8)."""
    be = eng.backend
    if B > 1:
        starts = [_start(eng, (1 + b, 2 + 3 * b, 3 + 5 * b, 4 + 7 * b)) for b in range(B)]
        sts, toks = [s for s, _ in starts], [t for _, t in starts]

        def batch(st, t, n):
            nonlocal toks
            t0 = time.perf_counter()
            for _ in range(n):
                toks = [int(x) for x in np.argmax(be.decode_batch(toks, sts), axis=-1)]
            return toks[0], time.perf_counter() - t0
        return batch
    if R == 1:
        return lambda st, t, n: greedy_steps(be, st, t, n)

    def steps(st, t, n):
        t0 = time.perf_counter()
        for _ in range(n):
            out, undos = be.forward_rows([([t] + [t] * (R - 1), st)], undo=True)
            undos[0](1)
            t = int(np.argmax(out[0][0]))
        return t, time.perf_counter() - t0
    return steps


def _sweep(eng, dists: list[int], n: int, rounds: int) -> None:
    be = eng.backend
    st, t = _start(eng)
    be.forward([t], st, all_logits=False)
    res: dict[int, list[float]] = defaultdict(list)
    for _ in range(rounds):
        for d in dists:
            be.simd.prefetch = d
            if st.pos + n + 2 > st.n_ctx:
                st = eng.new_state()
                be.forward([t], st, all_logits=False)
            t, dt = greedy_steps(be, st, t, n)
            res[d].append(n / dt)
    print(f"{be.simd!r}, weights {be.weights}: prefetch distance -> tok/s ({rounds} interleaved runs; median)")
    for d in dists:
        print(f"  {d:8d} B: " + ", ".join(f"{x:.2f}" for x in res[d]) + f"  ({np.median(res[d]):.2f})")


def _pool(eng, n: int) -> None:
    """The pool's own clocks over n plain decode steps: where a pooled call's wall time goes."""
    be = eng.backend
    st, t = _start(eng)
    t, _ = greedy_steps(be, st, t, 3)
    be.simd.pool_stats(True)
    t, dt = greedy_steps(be, st, t, n)
    res = be.simd.pool_stats(False)
    print(f"{be.simd!r}: {n / dt:.2f} tok/s with the pool's clocks on (two clock reads per chunk)")
    print("| pooled calls | per token | chunks | wall us | busy us/thread | start us (mean / latest) | spread us | "
          "idle share |\n|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        if r["tasks"]:
            idle = 1 - r["busy_us"] / r["wall_us"]
            print(f"| {name} | {r['tasks'] / n:.0f} | {r['chunks']:.0f} | {r['wall_us']:.1f} | {r['busy_us']:.1f} | "
                  f"{r['start_us']:.2f} / {r['start_max_us']:.2f} | {r['spread_us']:.2f} | {100 * idle:.0f}% |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-n", "--tokens", type=int, default=16)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--rows", type=int, default=1,
                    help="profile verify steps of this many rows of one sequence (rolled back to one) instead of "
                         "plain decode steps")
    ap.add_argument("--batch", type=int, default=1,
                    help="profile batched decode steps of this many sequences (decode_batch) instead")
    ap.add_argument("--weights", default="auto", choices=["auto", "copy", "mmap"])
    ap.add_argument("--sweep-prefetch", default="",
                    help="comma-separated prefetch distances (bytes): time plain decode steps at each, --rounds "
                         "times, interleaved, instead of the per-call table")
    ap.add_argument("--rounds", type=int, default=2, help="--sweep-prefetch: interleaved runs per distance")
    ap.add_argument("--pool", action="store_true",
                    help="time plain decode steps with the pool's clocks on: per pooled call its wall time, the "
                         "threads' busy time, their start delay and finish spread, instead of the per-call table")
    a = ap.parse_args(argv)
    eng = Engine.load(a.model, backend="cpu", isa=None if a.isa in (None, "native") else a.isa,
                      n_threads=a.threads, n_ctx=256, weights=a.weights, max_seqs=max(a.batch, 1) + 1)
    be = eng.backend
    if a.sweep_prefetch:
        _sweep(eng, [int(x) for x in a.sweep_prefetch.split(",")], a.tokens, a.rounds)
        return
    if a.pool:
        _pool(eng, a.tokens)
        return
    simd = be.simd
    n_exp = getattr(eng.args, "n_expert", 1) or 1
    step = _steps_fn(eng, a.rows, a.batch)
    st, t = _start(eng)
    t, _ = step(st, t, 1)  # recorded here
    t, dt = step(st, t, a.tokens)  # the plain step first, for comparison
    real = dt * 1e9 / a.tokens
    labels: dict[int, tuple[str, int]] = {}  # id(Bound) -> (label, weight bytes it reads)
    real_bind = simd.bind

    def bind(method, *args):
        f = real_bind(method, *args)
        b = 0
        label = method
        if method == "matmul":
            w, q, rows, cols = args[:4]
            label, b = f"matmul {type_name(q)} {rows}x{cols}", w.nbytes
        elif method == "matmul_many":
            items = args[2]
            label = "many " + "+".join(f"{type_name(q)}:{r}" for _, q, r, _ in items) + f" x{args[1]}"
            b = sum(w.nbytes for w, *_ in items)
        elif method == "moe_gate_up":
            w, q, rows, cols, idx = args[0], args[1], args[4], args[5], args[7]
            shared = args[11] if len(args) > 11 else None  # (w_sg, _, w_su, ...): the shared expert's rows
            b = 2 * w.nbytes // n_exp * len(idx) + (shared[0].nbytes + shared[2].nbytes if shared else 0)
            label = f"moe_gate_up {type_name(q)} {rows}x{cols} k={len(idx)}" + (" +shared" if shared else "")
        elif method == "moe_down":
            w, q, rows, cols, idx = args[0], args[1], args[2], args[3], args[5]
            shared = args[8] if len(args) > 8 else None  # (w_s, ...)
            b = w.nbytes // n_exp * len(idx) + (shared[0].nbytes if shared else 0)
            label = f"moe_down {type_name(q)} {rows}x{cols} k={len(idx)}" + (" +shared" if shared else "")
        elif method == "quantize":
            label = f"quantize {args[0].shape[-1]}"
        labels[id(f)] = (label, b)
        return f

    simd.bind = bind
    for ws in be._ws.values():  # rebind every call site so that each is labelled
        ws.calls.clear()
        ws.replays.clear()
    t, _ = step(st, t, 1)
    simd.bind = real_bind
    runs = [seg for ws in be._ws.values() for p in ws.replays.values() for seg in p.segments if type(seg) is Steps]
    for seg in runs:
        seg.ns = np.zeros(len(seg.calls), np.int64)
    t, dt = step(st, t, a.tokens)
    wall = dt * 1e9 / a.tokens
    times: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    for seg in runs:
        for call, ns in zip(seg.calls, seg.ns, strict=True):
            label, b = labels[id(call)]
            times[label] += float(ns)
            nbytes[label] += b * a.tokens
            counts[label] += a.tokens
    bw = simd.read_bandwidth(1 << 30)
    n = a.tokens
    rows = sorted(times, key=lambda k: -times[k])
    print(f"{simd!r}, {a.rows} row(s) of {a.batch} sequence(s) a step: {1e9 / real:.2f} steps/s "
          f"({real / 1e6:.2f} ms/step; {wall / 1e6:.2f} "
          f"with each call clocked in the native step, as the table), read bandwidth {bw / 1e9:.1f} GB/s")
    tot_b = sum(nbytes.values()) / n
    print(f"weights per token {tot_b / 1e9:.4g} GB (the products') -> floor {bw / tot_b:.1f} tok/s")
    print("| call | calls/tok | ms/tok | share | GB/tok | GB/s | % bw |\n|---|---|---|---|---|---|---|")
    for k in rows:
        ms = times[k] / n / 1e6
        gb = nbytes[k] / n / 1e9
        rate = nbytes[k] / times[k] if times[k] else 0
        print(f"| {k} | {counts[k] / n:.0f} | {ms:.3f} | {100 * times[k] / n / wall:.1f}% | {gb:.4f} | "
              f"{rate:.1f} | {100 * rate * 1e9 / bw:.0f}% |" if gb else
              f"| {k} | {counts[k] / n:.0f} | {ms:.3f} | {100 * times[k] / n / wall:.1f}% | | | |")
    acc = sum(times.values()) / n
    print(f"| outside the native calls | | {(wall - acc) / 1e6:.3f} | {100 * (wall - acc) / wall:.1f}% | | | |")
    pooled, alone = _pool_round_trip(simd)
    print(f"pool round trip: {pooled:.1f} us per pooled call of a tiny product ({alone:.1f} us on one thread)")


if __name__ == "__main__":
    main()

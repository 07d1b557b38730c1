"""Where a CPU decode step's time goes: every native call and numba op of `forward` timed by call site.

    python bench/cpu_decode_profile.py -m model.gguf -t 16 [-n 16] [--isa native]

Wraps the backend's bound native calls and the numba ops with a clock, runs n decode steps and prints, per
kind of call, the time per token, its share of the step, and for weight products the weight bytes read and
the GB/s they ran at (against the machine's read bandwidth measured by the same library). The rest of the
step ("python glue") is the wall time no wrapped call accounts for.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from hybridinfer.api import Engine
from hybridinfer.quant import type_name


def _copy_weights(be) -> None:
    """Every Mat's bytes into one numpy buffer (numpy advises huge pages for large allocations)."""
    from dataclasses import replace

    from hybridinfer.cpu.backend import Mat

    owners = [(be, "out")] + [(L, k) for L in be.layers for k, v in vars(L).items() if isinstance(v, Mat)]
    sizes = [(getattr(o, k).raw.nbytes + 63) // 64 * 64 for o, k in owners]
    buf = np.empty(sum(sizes) + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    t0 = time.perf_counter()
    for (o, k), n in zip(owners, sizes, strict=True):
        m = getattr(o, k)
        dst = buf[off : off + m.raw.nbytes]
        dst[...] = m.raw
        setattr(o, k, replace(m, raw=dst))
        off += n
    print(f"copied {buf.nbytes / 1e9:.2f} GB of weights in {time.perf_counter() - t0:.1f} s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-n", "--tokens", type=int, default=16)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--copy-weights", action="store_true",
                    help="copy every weight matrix out of the memory-mapped file into one anonymous buffer first")
    a = ap.parse_args(argv)
    eng = Engine.load(a.model, backend="cpu", isa=None if a.isa in (None, "native") else a.isa,
                      n_threads=a.threads, n_ctx=256)
    be = eng.backend
    if a.copy_weights:
        _copy_weights(be)
    simd = be.simd
    n_exp = getattr(eng.args, "n_expert", 1) or 1
    times: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    real_bind, real_attn = simd.bind, simd.bind_attention

    def timed(label, f, b):
        def call(*x):
            t0 = time.perf_counter_ns()
            f(*x)
            times[label] += time.perf_counter_ns() - t0
            nbytes[label] += b
            counts[label] += 1
        return call

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
            b = 2 * w.nbytes // n_exp * len(idx)
            label = f"moe_gate_up {type_name(q)} {rows}x{cols} k={len(idx)}"
        elif method == "moe_down":
            w, q, rows, cols, idx = args[0], args[1], args[2], args[3], args[5]
            b = w.nbytes // n_exp * len(idx)
            label = f"moe_down {type_name(q)} {rows}x{cols} k={len(idx)}"
        elif method == "quantize":
            label = f"quantize {args[0].shape[-1]}"
        return timed(label, f, b)

    simd.bind = bind
    simd.bind_attention = lambda *x: timed("attention+rope", real_attn(*x), 0)
    from hybridinfer.cpu import ops

    for name in ("rms_norm", "add_inplace", "split_qgate", "rms_norm_heads", "attn_gate", "moe_route",
                 "moe_combine", "gated_add"):
        setattr(ops, name, timed(f"numba {name}", getattr(ops, name), 0))
    st = eng.new_state()
    logits = eng.prefill([1, 2, 3, 4], st)[-1]
    t = int(np.argmax(logits))
    be.forward([t], st, all_logits=False)
    times.clear(), nbytes.clear(), counts.clear()
    t0 = time.perf_counter_ns()
    for _ in range(a.tokens):
        t = int(np.argmax(be.forward([t], st, all_logits=False)[-1]))
    wall = (time.perf_counter_ns() - t0) / a.tokens
    bw = simd.read_bandwidth(1 << 30)
    n = a.tokens
    rows = sorted(times, key=lambda k: -times[k])
    print(f"{simd!r}: {1e9 / wall:.2f} tok/s, {wall / 1e6:.2f} ms/token, read bandwidth {bw / 1e9:.1f} GB/s")
    tot_b = sum(nbytes.values()) / n
    print(f"weights per token {tot_b / 1e9:.3f} GB -> floor {bw / tot_b:.1f} tok/s")
    print("| call | calls/tok | ms/tok | share | GB/tok | GB/s | % bw |\n|---|---|---|---|---|---|---|")
    for k in rows:
        ms = times[k] / n / 1e6
        gb = nbytes[k] / n / 1e9
        rate = nbytes[k] / times[k] if times[k] else 0
        print(f"| {k} | {counts[k] / n:.0f} | {ms:.3f} | {100 * times[k] / n / wall:.1f}% | {gb:.4f} | "
              f"{rate:.1f} | {100 * rate * 1e9 / bw:.0f}% |" if gb else
              f"| {k} | {counts[k] / n:.0f} | {ms:.3f} | {100 * times[k] / n / wall:.1f}% | | | |")
    acc = sum(times.values()) / n
    print(f"| python glue | | {(wall - acc) / 1e6:.3f} | {100 * (wall - acc) / wall:.1f}% | | | |")


if __name__ == "__main__":
    main()

"""Where the CPU vision tower's time goes: wall time of each kind of op (the weight products, the attention's
products and softmax, the norms, GELUs, rotary layout) over encodes of a synthetic Qwen3.5 tower, at each
`--spin` setting of the SIMD library's pool (how long its workers spin after a task before sleeping: the attention's
numba softmax runs on threads of the tower's own right after the library's products).

    python3 bench/vision_cpu_profile.py -t 16 [--sizes 448x448,1024x768] [--spin 200,0] [-r 2] [--depth 27]
        [--no-fused]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hybridinfer.backends.cpu import vision as cpu_vision  # noqa: E402
from hybridinfer.backends.cpu.simd import SimdLib  # noqa: E402
from hybridinfer.backends.vision import load_image_encoder  # noqa: E402
from hybridinfer.tools.benchmarks.vision import _image, parse_sizes  # noqa: E402
from hybridinfer.tools.synth_vision import synth_mmproj  # noqa: E402

# CPUVisionOps methods timed (outermost call only: linear_gelu's product is not counted twice)
_TIMED = ("linear", "linear_add", "linear_gelu", "layer_norm", "gelu_tanh", "gelu_erf", "rotary_attention")


def _instrument(ops, acc: dict) -> None:
    depth = [0]

    def wrap(name, fn):
        def timed(*a, **k):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    acc[name] += time.perf_counter() - t
        return timed

    for name in _TIMED:
        setattr(ops, name, wrap(name, getattr(ops, name)))
    # inside rotary_attention: the fused kernel, or the products by head and the softmax
    mm, rows_run, fused = ops._matmul, ops.rows.run, ops.simd.attention_full

    def attention_full(*a, **k):
        t = time.perf_counter()
        r = fused(*a, **k)
        acc["  attn fused"] += time.perf_counter() - t
        return r

    def matmul(a, b, out):
        t = time.perf_counter()
        r = mm(a, b, out)
        acc["  attn products"] += time.perf_counter() - t
        return r

    def run(kernel, rows, *args, **kw):
        t = time.perf_counter()
        r = rows_run(kernel, rows, *args, **kw)
        if getattr(kernel, "__name__", "") == "softmax_rows" or "softmax" in str(kernel):
            acc["  attn softmax"] += time.perf_counter() - t
        return r

    ops._matmul, ops.rows.run, ops.simd.attention_full = matmul, run, attention_full


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--sizes", default="448x448,1024x768")
    ap.add_argument("--spin", default="200,0", help="the pool's spin_us values, one run each")
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--no-fused", action="store_true", help="the attention's blocks of products and softmax, not the "
                    "library's fused kernel (the path before it, for comparison)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mmproj.gguf")
        synth_mmproj(path, a.width, {"depth": a.depth} if a.depth else None, seed=0)
        for spin in (int(s) for s in a.spin.split(",")):
            lib = SimdLib(n_threads=a.threads, spin_us=spin)
            enc = load_image_encoder(path, None, lib)
            assert isinstance(enc.ops, cpu_vision.CPUVisionOps), type(enc.ops)
            if a.no_fused:
                enc.ops._fused = False
            for w, h in parse_sizes(a.sizes):
                img = _image(w, h, 0)
                enc.encode(img)  # weights packed, kernels compiled
                acc: dict = defaultdict(float)
                _instrument(enc.ops, acc)
                walls = []
                for _ in range(a.reps):
                    t = time.perf_counter()
                    enc.encode(img)
                    walls.append(time.perf_counter() - t)
                for name in _TIMED:  # the next size starts from the class's methods again
                    enc.ops.__dict__.pop(name, None)
                enc.ops.__dict__.pop("_matmul", None)
                enc.ops.rows.__dict__.pop("run", None)
                lib.__dict__.pop("attention_full", None)
                total = float(np.sum(walls))
                print(f"\n{lib.isa}, {a.threads} threads, spin {spin} us, {w}x{h}: {np.median(walls) * 1e3:.0f} ms "
                      f"an image (median of {a.reps}; runs {', '.join(f'{x * 1e3:.0f}' for x in walls)})")
                print("| op | ms an image | share |\n|---|---|---|")
                for name, s in sorted(acc.items(), key=lambda kv: -kv[1]):
                    print(f"| {name} | {s / a.reps * 1e3:.1f} | {s / total:.1%} |")
                rest = total - sum(v for k, v in acc.items() if not k.startswith(" "))
                print(f"| other | {rest / a.reps * 1e3:.1f} | {rest / total:.1%} |")
            enc.close()
            lib.close()


if __name__ == "__main__":
    main()

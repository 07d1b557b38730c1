"""Bit-exactness of the CPU backend against a llama.cpp build for the same ISA level, logits row by row.

    python bench/exact_vs_llama.py --llama-simple PATH [-m model.gguf] [--isa ssse3] [-n 12]

PATH is llama.cpp's `llama-simple` with bench/llama_simple_dump.patch applied (F32 K/V, no flash attention, two
threads; it prints the prompt and generated token ids to stderr and writes each step's logits to $LOGITS_OUT).
On the AVX units the CPU backend computes every prompt row in llama.cpp's one-token order (docs/numerics.md), so
its prompt rows equal llama.cpp's only where llama-simple decodes the prompt with a batch of one token; on the
SSSE3 level both take the one-token order at any batch. Build it from llama-cpp-python's source distribution
(vendor/llama.cpp), e.g. for the SSE4.2 level:

    patch -p1 < bench/llama_simple_dump.patch   # in vendor/llama.cpp
    cmake -B build-sse -DGGML_NATIVE=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF \\
          -DGGML_AVX512=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_EXAMPLES=ON && cmake --build build-sse -t llama-simple

and compare with this engine at the matching level (`--isa ssse3`; `scalar` for a build with -DGGML_SSE42=OFF;
`avx2` for -DGGML_AVX512=OFF; `native` for the host's own build). For each prompt the prompt's last logits and
every decode step's are compared: a row counts when all its floats are equal. Not a test: CI has no llama.cpp
build per ISA level; tests/ hold the kernels to numpy references of the same float operations.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,",
           "The three primary colors are", "Water boils at a temperature of", "1, 2, 3, 4, 5,"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-simple", required=True)
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--isa", default="native")
    ap.add_argument("-n", type=int, default=12, help="steps per prompt")
    a = ap.parse_args(argv)
    from hybridinfer.engine.api import Engine
    from hybridinfer.format.default_model import default_model_path

    path = a.model or default_model_path()
    eng = Engine.load(path, backend="cpu", n_ctx=512, isa=None if a.isa == "native" else a.isa, n_threads=2)
    be, V = eng.backend, eng.args.n_vocab
    total = same = 0
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.bin")
        for p in PROMPTS:
            r = subprocess.run([a.llama_simple, "-m", path, "-n", str(a.n), p], capture_output=True, text=True,
                               errors="replace", env=dict(os.environ, LOGITS_OUT=out))
            if r.returncode != 0:
                print(r.stderr[-500:], file=sys.stderr)
                return 1
            prompt = [int(x[2:]) for x in r.stderr.splitlines() if x.startswith("P ")]
            steps = [int(x[3:]) for x in r.stderr.splitlines() if x.startswith("ID ")]
            theirs = np.fromfile(out, np.float32).reshape(-1, V)
            st = eng.new_state()
            ours = [be.forward(prompt, st, all_logits=False)[-1].copy()]  # llama.cpp outputs the last row only
            for t in steps[: len(theirs) - 1]:
                ours.append(be.forward([t], st, all_logits=False)[0].copy())
            marks = ""
            for x, y in zip(ours, theirs, strict=False):
                total += 1
                same += bool(np.array_equal(x, y))
                marks += "=" if np.array_equal(x, y) else "x"
                worst = max(worst, float(np.abs(x - y).max()))
            print(f"{p[:32]!r:36} {marks}")
    print(f"{be.simd.isa}: {same}/{total} logit rows bit-identical; max |difference| {worst:.3g}")
    return 0 if same == total else 2


if __name__ == "__main__":
    sys.exit(main())

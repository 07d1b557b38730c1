"""The vision tower's attention on the CPU, one layer's worth: the fused kernel (SimdLib.attention_full,
native/simd/vattn.c) against the blocks of products and softmax it replaces (backends/vision.attention_heads with
the library's float products and the numba softmax), and the largest difference between their outputs.

    python3 bench/vision_attention_speed.py -t 2 [--shapes 3072x16x72,784x16x72] [-r 5] [--isa avx2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hybridinfer.backends.cpu import vision_kernels as vk  # noqa: E402
from hybridinfer.backends.cpu.simd import SimdLib  # noqa: E402
from hybridinfer.backends.vision import ATTN_SCORE_FLOATS, attention_heads  # noqa: E402


def _blocks(lib: SimdLib, pool: vk.RowPool, qh, kt, vh, scale, buf):
    """Today's path before the fused kernel: kᵀ and v packed per head, products by head, numba softmax."""
    packs: dict = {}

    def mm(a, b, out):
        for h in range(a.shape[0]):
            p = packs.get((id(b), h))
            if p is None:
                p = packs[(id(b), h)] = lib.gemm_pack(b[h], transposed=True)
            lib.gemm(a[h], p, b.shape[2], out[h])
        return out

    return attention_heads(qh, kt, vh, scale, lambda sc, s: pool.run(vk.softmax_rows, (sc,), s), buf=buf, matmul=mm)


def _best(reps: int, fn, *args, **kw) -> float:
    fn(*args, **kw)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args, **kw)
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--shapes", default="3072x16x72,784x16x72", help="rows x heads x head_dim, comma-separated")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--isa", default=None)
    a = ap.parse_args()
    lib = SimdLib(a.isa, n_threads=a.threads)
    pool = vk.RowPool(a.threads)
    try:
        for shape in a.shapes.split(","):
            n, nh, hd = (int(x) for x in shape.split("x"))
            rng = np.random.default_rng(0)
            qh, vh = (rng.standard_normal((nh, n, hd)).astype(np.float32) for _ in range(2))
            kt = rng.standard_normal((nh, hd, n)).astype(np.float32)
            k = np.ascontiguousarray(kt.transpose(0, 2, 1))  # the fused kernel's k in rows, as the tower gives it
            scale = float(hd ** -0.5)
            buf = np.empty(nh * n * min(n, max(1, ATTN_SCORE_FLOATS // (n * nh))), np.float32)
            ws = np.empty(lib.attention_full_floats(n, nh, hd), np.float32)
            out = np.empty((n, nh, hd), np.float32)
            ref = _blocks(lib, pool, qh, kt, vh, scale, buf)
            lib.attention_full(qh, k, vh, scale, out, workspace=ws)
            t_old = _best(a.reps, _blocks, lib, pool, qh, kt, vh, scale, buf)
            t_new = _best(a.reps, lib.attention_full, qh, k, vh, scale, out, workspace=ws)
            print(f"{lib.isa}, {a.threads} threads, {n} rows x {nh} heads x {hd}: products+softmax {t_old:.1f} ms, "
                  f"fused {t_new:.1f} ms ({t_old / t_new:.2f}x); max |diff| {np.abs(out - ref).max():.2e}")
    finally:
        pool.close()
        lib.close()


if __name__ == "__main__":
    main()

"""How close one-token weight products come to the machine's read bandwidth, shape by shape, with no Python
between calls: each shape's products over fresh copies of its weights (together much larger than the last-level
cache, as decode reads them) packed into one native run, against the read-bandwidth probe taken around them.

    python bench/product_stream.py [-t 16] [--isa native] [--gb 2] [--prefetch 4096]

A call that streams at the probe's rate scores 100%; what a shape loses below that is the per-call cost
(waking the pool, the threads' ramp-up and uneven finish) or the kernel's compute.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hybridinfer.backends.cpu.replay import Steps
from hybridinfer.backends.cpu.simd import SimdLib
from hybridinfer.backends.cpu.weights import huge_page_buffer
from hybridinfer.format.quant import F32, Q4_K, Q6_K, Q8_0
from hybridinfer.tools.benchmarks.decode import probe_bytes

# (label, [(qtype, rows, cols)] of one call: several items run as one matmul_many)
SHAPES = [
    ("Q4_K 2048x4096 (ssm_out)", [(Q4_K, 2048, 4096)]),
    ("Q6_K 8192x2048 + Q4_K 4096x2048 (GDN in)", [(Q6_K, 8192, 2048), (Q4_K, 4096, 2048)]),
    ("16 x Q4_K 512x2048 (experts' gate/up)", [(Q4_K, 512, 2048)] * 16),
    ("8 x Q6_K 2048x512 (experts' down)", [(Q6_K, 2048, 512)] * 8),
    ("F32 256x2048 (router)", [(F32, 256, 2048)]),
    ("Q6_K 248320x2048 (LM head)", [(Q6_K, 248320, 2048)]),
    ("Q8_0 8192x2048 (GDN qkv in issue 3's mix)", [(Q8_0, 8192, 2048)]),
]

_BLOCK = {Q4_K: (144, 0, 256), Q6_K: (210, 208, 256), Q8_0: (34, 0, 32)}  # bytes, offset of the f16 scale, values


def _weights(simd: SimdLib, qtype, rows: int, cols: int, rng) -> tuple[np.ndarray, int]:
    """Random rows of qtype with every block's f16 scale set to 1 (no NaN or denormal products), repacked as
    the backend would."""
    if qtype == F32:
        return _huge(rng.standard_normal(rows * cols, dtype=np.float32)), qtype
    bb, off, qk = _BLOCK[qtype]
    w = rng.integers(0, 256, (rows * cols // qk, bb), dtype=np.uint8)
    w[:, off:off + 2] = np.frombuffer(np.float16(1 / 64).tobytes(), np.uint8)
    if qtype == Q4_K:
        w[:, 2:4] = w[:, 0:2]
    w = _huge(w.reshape(-1))
    return w, simd.repack(w, qtype)


def _huge(a: np.ndarray) -> np.ndarray:
    """a copied into huge pages, as the backend keeps weights"""
    out = huge_page_buffer(a.nbytes)
    out[:] = a.view(np.uint8).reshape(-1)
    return out


def run_shape(simd: SimdLib, items, total_bytes: int, reps: int, rng) -> tuple[float, float, int]:
    cols = items[0][2]
    per_call = sum(simd.weight_row_bytes(q, c) * r for q, r, c in items)
    n_calls = max(2, total_bytes // per_call)
    xq = simd.quantize(rng.standard_normal(cols, dtype=np.float32), items[0][0])
    keep, calls = [], []
    # one set of weights per distinct call, shared between none of them
    for _ in range(n_calls):
        parts = []
        for q, r, c in items:
            w, qq = _weights(simd, q, r, c, rng)
            out = np.empty(r, np.float32)
            parts.append((w, qq, r, out))
        keep.append(parts)
        if len(parts) == 1:
            w, qq, r, out = parts[0]
            calls.append(simd.bind("matmul", w, qq, r, cols, xq, out))
        else:
            calls.append(simd.bind("matmul_many", xq, cols, parts))
    steps = Steps(simd, calls)
    steps.run(0)
    best = 1e30
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        steps.run(0)
        best = min(best, time.perf_counter_ns() - t0)
    return per_call * n_calls * 1e9 / best, best / n_calls / 1e3, per_call


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--isa", default="native")
    ap.add_argument("--gb", type=float, default=2.0, help="weights per shape, GB (keep it well above the L3)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefetch", default="", help="comma-separated prefetch distances to compare (bytes)")
    ap.add_argument("--only", default="", help="comma-separated shape indices")
    ap.add_argument("--probe-mb", type=int, default=0, help="the probe's buffer, MiB (default: benchmarks.decode's)")
    a = ap.parse_args(argv)
    simd = SimdLib(None if a.isa == "native" else a.isa, n_threads=a.threads)
    rng = np.random.default_rng(0)
    pfs = [int(x) for x in a.prefetch.split(",")] if a.prefetch else [simd.prefetch]
    shapes = [SHAPES[int(i)] for i in a.only.split(",")] if a.only else SHAPES
    nb = a.probe_mb << 20 if a.probe_mb else probe_bytes()
    bw0 = simd.read_bandwidth(nb)
    res = []
    for label, items in shapes:
        for pf in pfs:
            simd.prefetch = pf
            gbs, us, per_call = run_shape(simd, items, int(a.gb * 1e9), a.reps, rng)
            res.append((label, pf, per_call, us, gbs))
    bw1 = simd.read_bandwidth(nb)
    bw = max(bw0, bw1)
    print(f"{simd!r}: probe {bw0 / 1e9:.1f} / {bw1 / 1e9:.1f} GB/s ({nb / 2**30:.1f} GiB buffer)")
    print("| call | prefetch | MB/call | us/call | GB/s | % probe | us lost/call |\n|---|---|---|---|---|---|---|")
    for label, pf, per_call, us, gbs in res:
        lost = us - per_call / bw * 1e6
        print(f"| {label} | {pf} | {per_call / 1e6:.2f} | {us:.1f} | {gbs / 1e9:.1f} | {100 * gbs / bw:.0f}% | "
              f"{lost:.1f} |")


if __name__ == "__main__":
    main()

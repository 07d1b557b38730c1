"""Time gemm.cu on the card: GFLOP/s (2 T N K / time) of the dequantizing GEMM per weight type and token
tile, and of the expert-grouped form on an MoE-like shape.

    python3 bench/gpu_gemm_probe.py [--T 947 --N 2048 --K 2048] [--reps 20] [--card-profile fermi]
    python3 bench/gpu_gemm_probe.py --T 784 --N 1152 --K 4320 --types F16 --ksplit 1,2,3,4 --no-moe --also-T ""
        # a ViT's narrow product split over K (k_gemm.split_count), each tile that splits
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hybridinfer.format import quant  # noqa: E402


def _time(fn, reps: int) -> float:
    """Median seconds per call (events around each call, after 3 warm-up calls)."""
    import pycuda.driver as drv

    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = drv.Event(), drv.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(b.time_since(a) / 1e3)
    return float(np.median(ts))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=947)
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,F16,F32")
    ap.add_argument("--also-T", default="1,64,4096", help="further token counts timed for Q4_K")
    ap.add_argument("--card-profile", default=None, help="fermi | kepler | maxwell | pascal: compile and tile as "
                    "for that class of card (hybridinfer/backends/gpu/cards.py)")
    ap.add_argument("--no-moe", action="store_true", help="skip the expert-grouped rows (a dense shape's tiles only)")
    ap.add_argument("--tiles", default="all", help="all: time every tile of the class; default: only the chosen")
    ap.add_argument("--ksplit", default="", help="parts to time each tile that splits over K in (e.g. 1,2,3,4)")
    a = ap.parse_args(argv)

    from pycuda import gpuarray

    from hybridinfer.backends.gpu import k_gemm, loader

    loader.init()
    loader.configure(a.card_profile)
    import pycuda.driver as drv

    tiles = k_gemm.TILES_BY_CLASS[loader.kernel_class()] if a.tiles == "all" else ()
    print(f"device: {drv.Context.get_device().name()}; profile {a.card_profile}; class {loader.kernel_class()}")
    rng = np.random.default_rng(0)
    T, N, K = a.T, a.N, a.K
    x = gpuarray.to_gpu(rng.standard_normal((T, K), dtype=np.float32))
    out = gpuarray.empty((T, N), np.float32)
    flops = 2.0 * T * N * K
    for name in a.types.split(","):
        q = getattr(quant, name)
        qk, _ = quant.block_info(q)
        w = k_gemm.DeviceWeight.upload(quant.random_blocks(q, N * K // qk, rng), q, (N, K))
        row = []
        for tile in tiles:
            s = _time(lambda w=w, tile=tile: k_gemm.gemm(x, w, out=out, tile=tile), a.reps)
            row.append(f"{tile} {flops / s / 1e9:6.0f}")
        print(f"gemm {name:5s} T={T} N={N} K={K}: " + " | ".join(row))
        splits = [int(v) for v in a.ksplit.split(",") if v]
        if splits:
            part = gpuarray.empty(max(splits) * T * N, np.float32)
            for tile in k_gemm.SPLIT_TILES[loader.kernel_class()]:
                row = []
                for ks in splits:
                    kw = {"part": part, "ksplit": ks} if ks > 1 else {}
                    s = _time(lambda w=w, tile=tile, kw=kw: k_gemm.gemm(x, w, out=out, tile=tile, **kw), a.reps)
                    row.append(f"x{ks} {flops / s / 1e9:6.0f}")
                auto = k_gemm.split_count(loader.limits(), T, N, K, tile, part.size)
                print(f"    split over K, tile {tile} (split_count {auto}): " + " | ".join(row))
        auto = k_gemm.pick_tile(T, T, N, qtype=q, K=K)
        s = _time(lambda w=w: k_gemm.gemm(x, w, out=out), a.reps)
        print(f"    default tile {auto}: {flops / s / 1e9:.0f} GFLOP/s")

    q = quant.Q4_K
    also = [int(v) for v in a.also_T.split(",") if v]
    w = k_gemm.DeviceWeight.upload(quant.random_blocks(q, N * K // 256, rng), q, (N, K)) if also else None
    for t2 in also:
        x2 = gpuarray.to_gpu(rng.standard_normal((t2, K), dtype=np.float32))
        o2 = gpuarray.empty((t2, N), np.float32)
        f2 = 2.0 * t2 * N * K
        row = []
        for tile in tiles:
            s = _time(lambda tile=tile, x2=x2, o2=o2: k_gemm.gemm(x2, w, out=o2, tile=tile), a.reps)
            row.append(f"{tile} {f2 / s / 1e9:6.0f}")
        print(f"gemm Q4_K  T={t2} N={N} K={K}: " + " | ".join(row))

    if a.no_moe:
        return
    # MoE: 256 experts, 8 per token, gate projection [E, 512, K]
    E, top, F = 256, 8, 512
    ids = np.stack([rng.permutation(E)[:top] for _ in range(T)])
    order = np.argsort(ids.reshape(-1), kind="stable")
    counts = np.bincount(ids.reshape(-1), minlength=E)
    offs = gpuarray.to_gpu(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    idx = gpuarray.to_gpu((order // top).astype(np.int32))
    M = T * top
    w = k_gemm.DeviceWeight.upload(quant.random_blocks(q, E * F * K // 256, rng), q, (E, F, K))
    gflop = 2.0 * M * F * K
    _grouped_row(k_gemm, tiles, x, w, offs, idx, gpuarray.empty((M, F), np.float32), gflop, a.reps,
                 f"grouped Q4_K E={E} top{top} M={M} N={F} K={K}")
    # MoE down projection: grouped rows in order (no idx), [E, K, F] Q6_K
    q = quant.Q6_K
    xd = gpuarray.to_gpu(rng.standard_normal((M, F), dtype=np.float32))
    wd = k_gemm.DeviceWeight.upload(quant.random_blocks(q, E * K * F // 256, rng), q, (E, K, F))
    _grouped_row(k_gemm, tiles, xd, wd, offs, None, gpuarray.empty((M, K), np.float32), gflop, a.reps,
                 f"grouped Q6_K E={E} top{top} M={M} N={K} K={F}")


def _grouped_row(k_gemm, tiles, x, w, offs, idx, out, gflop: float, reps: int, label: str) -> None:
    """GFLOP/s of one grouped GEMM for every tile and for the default pick."""
    E, N = w.shape[0], w.shape[1]
    M = out.shape[0]
    row = []
    for tile in tiles:
        s = _time(lambda tile=tile: k_gemm.gemm_grouped(x, w, offs, idx, out=out, tile=tile), reps)
        row.append(f"{tile} {gflop / s / 1e9:6.0f}")
    s = _time(lambda: k_gemm.gemm_grouped(x, w, offs, idx, out=out), reps)
    row.append(f"default {k_gemm.pick_tile(M / E, M, N, qtype=w.qtype, K=w.shape[2])} {gflop / s / 1e9:6.0f}")
    print(f"{label} (GFLOP/s by tile): " + " | ".join(row))

if __name__ == "__main__":
    main()

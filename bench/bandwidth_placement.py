"""Is the read-bandwidth probe's spread a matter of where a buffer lies in physical memory, or of time (the
neighbours on a shared host)? Reads each of several 1 GiB buffers in turn, round after round, beside fresh
probes, then a 16 GiB buffer in 256 MiB pieces: a placement effect shows as buffers (or pieces) that stay fast
or slow from round to round; a time effect as rounds that are fast or slow for every buffer.

    python bench/bandwidth_placement.py [-t 16] [--buffers 8] [--rounds 4] [--big-gib 16]

On the GPU machine's host (16 threads) no buffer stayed apart from the others: the 1 GiB buffers read 84-104
GB/s and moved together from round to round, the 64 pieces of 16 GiB 80-135 GB/s with no piece slow twice.
"""

from __future__ import annotations

import argparse

from hybridinfer.backends.cpu.simd import SimdLib
from hybridinfer.backends.cpu.weights import huge_page_buffer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--buffers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--big-gib", type=int, default=16, help="0: no big buffer")
    a = ap.parse_args(argv)
    simd = SimdLib(n_threads=a.threads)
    gib = 1 << 30
    bufs = [huge_page_buffer(gib) for _ in range(a.buffers)]
    for b in bufs:
        b[:] = 1
    print(f"{simd!r}: GB/s of each 1 GiB buffer | fresh probes")
    for r in range(a.rounds):
        row = [simd.read_bandwidth_at(b, 3) / 1e9 for b in bufs]
        fresh = [simd.read_bandwidth(gib, 3) / 1e9 for _ in range(3)]
        print(f"round {r}: " + " ".join(f"{x:6.1f}" for x in row) + " | " + " ".join(f"{x:6.1f}" for x in fresh),
              flush=True)
    del bufs
    if a.big_gib:
        big = huge_page_buffer(a.big_gib * gib)
        big[:] = 1
        piece = 256 << 20
        for r in range(2):
            row = [simd.read_bandwidth_at(big[i * piece:(i + 1) * piece], 3) / 1e9 for i in range(big.size // piece)]
            print(f"{a.big_gib} GiB in 256 MiB pieces, round {r}: " + " ".join(f"{x:.0f}" for x in row), flush=True)
        print(f"{a.big_gib} GiB whole: " + " ".join(f"{simd.read_bandwidth_at(big, 2) / 1e9:.1f}" for _ in range(3)))
    simd.close()


if __name__ == "__main__":
    main()

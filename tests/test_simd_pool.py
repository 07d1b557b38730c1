"""The SIMD library's thread pool and how products are split over it: every chunk runs once, any thread count and
prefetch distance gives the same floats, sleeping workers wake, a 248,320-row head is one call."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hybridinfer.backends import actquant as aq
from hybridinfer.backends.cpu import simd
from hybridinfer.backends.cpu.simd import GGML_MUL_MAT, SimdLib, best_isa
from hybridinfer.format.quant import random_blocks


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_pool_runs_every_chunk_exactly_once(threads):
    """Many tasks back to back, small and large (a task's slot is reused two tasks later; workers wake late)."""
    lib = SimdLib(best_isa(), n_threads=threads)
    for total in (2, 3, 17, 128, 1000, 40_000):
        assert lib._lib.hi_pool_check(lib._c, total, 50 if total < 2000 else 3) == 0, total
    lib.close()


def test_pool_small_tasks_back_to_back_with_late_workers():
    """Tiny tasks in a tight loop on more threads than cores: workers wake late, some mid-task or after the task
    they woke for is over, and must neither lose nor repeat a chunk (a lost one would hang the caller: hence the
    subprocess and its timeout)."""
    code = ("from hybridinfer.backends.cpu.simd import SimdLib, best_isa\n"
            "for th in (8, 16, 3):\n"
            "    lib = SimdLib(best_isa(), n_threads=th)\n"
            "    for total in (2, 3, 5, 17, 33):\n"
            "        assert lib._lib.hi_pool_check(lib._c, total, 5000) == 0, (th, total)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_pool_stats_count_and_clock_the_tasks():
    lib = SimdLib(best_isa(), n_threads=3)
    assert lib._lib.hi_pool_check(lib._c, 100, 2) == 0  # clocks off: not counted
    assert lib.pool_stats(True)["big"]["tasks"] == 0
    assert lib._lib.hi_pool_check(lib._c, 16, 5) == 0  # small tasks (under 24 chunks)
    assert lib._lib.hi_pool_check(lib._c, 100, 3) == 0
    rng = np.random.default_rng(3)
    raw = random_blocks(12, 512 * 2048 // 256, rng).reshape(-1)
    xq = lib.quantize(rng.standard_normal(2048).astype(np.float32), 12)
    out = np.zeros(512, np.float32)
    lib.matmul(raw, 12, 512, 2048, xq, out, GGML_MUL_MAT)  # one product: one big task
    res = lib.pool_stats(False)
    small, big = res["small"], res["big"]
    assert small["tasks"] == 5 and small["chunks"] == 16
    assert big["tasks"] == 4 and big["chunks"] > 24
    for r in (small, big):
        assert r["wall_us"] >= r["busy_us"] > 0
        assert r["start_max_us"] >= r["start_us"] >= 0 and r["spread_us"] >= 0
    assert lib.pool_stats(False)["big"]["tasks"] == 0  # read: reset; off: not counted
    lib.matmul(raw, 12, 512, 2048, xq, out, GGML_MUL_MAT)
    assert lib.pool_stats(False)["big"]["tasks"] == 0
    lib.close()


def test_prefetch_distance_changes_no_result():
    rng = np.random.default_rng(8)
    raw = random_blocks(12, 64 * 2048 // 256, rng).reshape(-1)
    assert SimdLib(best_isa(), n_threads=2).prefetch == 0  # few threads: compute-bound, off by default
    assert SimdLib(best_isa(), n_threads=8).prefetch == simd.PREFETCH_BYTES
    lib = SimdLib(best_isa(), n_threads=2)
    xq = lib.quantize(rng.standard_normal(2048).astype(np.float32), 12)
    outs = []
    for d in (0, 64, 4096, 1 << 20):
        lib.prefetch = d
        assert lib.prefetch == d
        out = np.full(64, np.nan, np.float32)
        lib.matmul(raw, 12, 64, 2048, xq, out, GGML_MUL_MAT)
        outs.append(out)
    assert not np.isnan(outs[0]).any()
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])
    with pytest.raises(ValueError, match="prefetch"):
        lib.prefetch = -1


def test_decode_products_split_over_threads_cover_every_row():
    """One token over a pool (big chunks, then small ones for the last quarter of each job's rows): every row
    written once, the same floats on any thread count; odd row counts, several jobs of different sizes."""
    rng = np.random.default_rng(12)
    cols = 2048
    mats = [(random_blocks(12, r * cols // 256, rng).reshape(-1), 12, r) for r in (1001, 37, 260, 8)]
    x = rng.standard_normal(cols).astype(np.float32)
    results = []
    for n in (1, 3, 8, 16):
        lib = SimdLib(best_isa(), n_threads=n)
        xq = lib.quantize(x, 12)
        one = np.full(1001, np.nan, np.float32)
        lib.matmul(mats[0][0], 12, 1001, cols, xq, one, GGML_MUL_MAT)
        outs = [np.full(r, np.nan, np.float32) for _, _, r in mats]
        lib.matmul_many(xq, cols, [(w, q, r, o) for (w, q, r), o in zip(mats, outs, strict=True)], GGML_MUL_MAT)
        assert not np.isnan(one).any() and not any(np.isnan(o).any() for o in outs), n
        assert np.array_equal(one, outs[0])
        results.append(outs)
        lib.close()
    for r in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(r, results[0], strict=True))


def test_thread_counts_give_identical_results():
    rng = np.random.default_rng(21)
    rows, cols = 301, 32 * 5
    raw = random_blocks(6, rows * cols // 32, rng).reshape(-1)
    x = rng.standard_normal((17, cols)).astype(np.float32)
    wg = random_blocks(2, 5 * 50 * cols // 32, rng).reshape(-1)
    results = []
    for n in (1, 2, 3):
        lib = SimdLib(best_isa(), n_threads=n)
        xq = lib.quantize(x, 6)
        out = np.zeros((17, rows), np.float32)
        lib.matmul(raw, 6, rows, cols, xq, out)
        g, u = np.zeros((3, 50), np.float32), np.zeros((3, 50), np.float32)
        lib.moe_gate_up(wg, 2, wg, 2, 50, cols, lib.quantize(x[0], 2), [1, 4, 3], g, u)
        results.append((xq, out, g, u))
        lib.close()
    for r in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(r, results[0], strict=True))


def test_sleeping_workers_and_lm_head_rows():
    """Workers that sleep between calls (spin_us=0) wake for each call; a 248,320-row head is one call."""
    rng = np.random.default_rng(22)
    rows, cols = 248_320, 64
    raw = random_blocks(8, rows * cols // 32, rng).reshape(-1)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    lib = SimdLib(best_isa(), n_threads=3, spin_us=0)
    xq = lib.quantize(x, 8)
    want = aq.qmatmul_ggml(xq, raw, 8, rows, cols)
    for _ in range(3):
        out = np.zeros((2, rows), np.float32)
        lib.matmul(raw, 8, rows, cols, xq, out)
        assert np.array_equal(out, want)
        one = np.zeros(rows, np.float32)
        lib.matmul(raw, 8, rows, cols, xq[1], one)
        assert np.array_equal(one, want[1])
    lib.close()

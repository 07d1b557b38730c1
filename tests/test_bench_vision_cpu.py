"""bench/vision_cpu_profile.py (where the CPU vision tower's time goes, by op) and bench/gemm_scaling.py (the float
products by thread count beside OpenBLAS) on tiny shapes: their tables are whole and add up (the timings are the
benchmarks', not asserted)."""

from __future__ import annotations

import os
import re
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _bench(name: str):
    sys.path.insert(0, BENCH)
    try:
        return __import__(name)
    finally:
        sys.path.remove(BENCH)


def _rows(out: str) -> list[list[str]]:
    """Table rows as cells; a part of the op above it (indented) keeps its leading spaces."""
    return [[c.strip(" ") if i else c[1:].rstrip() for i, c in enumerate(r.strip("|").split("|"))]
            for r in out.splitlines() if r.startswith("| ") and not r.startswith(("| op", "| M x"))]


def test_vision_profile_accounts_for_the_encode(capsys):
    _bench("vision_cpu_profile").main(["-t", "2", "--sizes", "64x64", "--spin", "200", "-r", "1", "--depth", "2",
                                       "--width", "64"])
    out = capsys.readouterr().out
    m = re.search(r"spin 200 us, 64x64: (\d+) ms an image", out)
    assert m, out
    rows = {r[0]: (float(r[1]), float(r[2].rstrip("%"))) for r in _rows(out)}
    # every kind of op the tower's forward calls was timed, and the top-level ones and the rest make the whole
    assert {"linear", "linear_add", "linear_gelu", "layer_norm", "rotary_attention", "other"} <= set(rows)
    top = [v for k, v in rows.items() if not k.startswith(" ")]
    assert all(ms >= 0 for ms, _ in top) and sum(share for _, share in top) == pytest.approx(100, abs=1.0)


def test_gemm_scaling_rows_for_each_thread_count(capsys):
    from hybridinfer.backends.cpu.simd import SimdLib

    lib = SimdLib(n_threads=1)
    has = lib.has_gemm
    lib.close()
    _bench("gemm_scaling").main(["--threads", "1,2", "--shapes", "40x70x300", "-r", "1"])
    rows = _rows(capsys.readouterr().out)
    assert [(r[0], r[1]) for r in rows] == [("40x70x300", "1"), ("40x70x300", "2")]
    # ours is 0 on a unit without float products; the bench itself asserts both sides agree where it has them
    assert all((float(r[2]) > 0) == has for r in rows)

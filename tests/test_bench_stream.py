"""bench/product_stream.py: each decode product shape streamed over fresh copies of its weights, against the
read-bandwidth probe (tiny sizes here; the numbers are the benchmark's, not asserted)."""

from __future__ import annotations

import os
import re
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.mark.parametrize("isa", [None, "ssse3"])
def test_product_stream_table(isa, capsys):
    from hybridinfer.backends.cpu.simd import supported_isas

    if isa and isa not in supported_isas():
        pytest.skip(f"{isa} not on this CPU")
    sys.path.insert(0, BENCH)
    try:
        import product_stream
    finally:
        sys.path.remove(BENCH)
    args = ["-t", "2", "--gb", "0.004", "--reps", "1", "--only", "0,4", "--probe-mb", "16", "--prefetch", "0,4096"]
    product_stream.main(args + (["--isa", isa] if isa else []))
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| ") and "GB/s" not in r]
    assert [r.split(" | ")[0][2:] for r in rows] == [product_stream.SHAPES[i][0] for i in (0, 0, 4, 4)]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert int(cells[1]) in (0, 4096)
        mb, us, gbs = float(cells[2]), float(cells[3]), float(cells[4])
        assert mb > 0 and us > 0 and gbs > 0
        assert abs(mb * 1e6 / (us * 1e-6) / 1e9 - gbs) <= 0.02 * gbs + 0.1  # the row's own figures agree
    assert re.search(r"probe [\d.]+ / [\d.]+ GB/s", out)

"""`hybridinfer bench disk`: rows per budget and read mode with the bytes read per token and the hit rate, the disk
probe, and llama-bench (a stand-in that records its call) under a memory limit (speeds are not asserted)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from hybridinfer.cli import main
from hybridinfer.tools.benchmarks import disk
from hybridinfer.tools.synth import synth_model

SHAPE = dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=16, n_expert_used=4,
             n_ff_exp=256, n_ff_shexp=256, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)

FAKE = """\
import json, os, sys
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "argv.log"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
print(json.dumps([{"avg_ts": 12.5, "n_gen": 4}]))
"""


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("bdisk") / "moe.gguf"
    synth_model(p, "qwen35moe", SHAPE, "q4_k_m", seed=2)
    return str(p)


def test_bench_disk_rows(path, tmp_path):
    probe = disk.probe_disk(path, seq_bytes=1 << 20, rand_bytes=disk.expert_range(path), rand_reads=16)
    assert probe["seq_bytes_s"] > 0 and probe["rand_bytes_s"] > 0
    assert probe["rand_read_bytes"] % 4096 == 0 and probe["rand_read_bytes"] >= disk.expert_range(path)
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\n" + FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    res = disk.run(path, [3 << 20, 64 << 20], threads=2, n_tokens=3, context=4, io_modes=("pread",),
                   llama_bench=str(fake), probe=probe)
    ours = [r for r in res["rows"] if r["io"] == "pread"]
    small, big = ours
    assert small["on_disk"] and small["bytes_per_token"] > 0 and 0 <= small["hit_rate"] < 1
    assert small["resident_bytes"] <= 3 << 20
    assert small["floor_s_per_token"] == pytest.approx(small["bytes_per_token"] / probe["rand_bytes_s"])
    assert not big["on_disk"] and big["bytes_per_token"] == 0
    llama = [r for r in res["rows"] if r["io"].startswith("llama-bench")]
    assert [r["budget"] for r in llama] == [3 << 20, 64 << 20]
    assert all(r["tok_s"] == 12.5 and r["limit"] for r in llama)
    assert llama[0]["limit_bytes"] == max(3 << 20, small["peak_rss_bytes"])
    calls = (tmp_path / "argv.log").read_text().splitlines()
    assert len(calls) == 2 and all(f"-m {path}" in c and "-n 3" in c for c in calls)
    table = disk.markdown(res)
    assert table.count("| pread |") == 2 and "all resident" in table and "12.50" in table


def test_memory_limited_command_runs_or_says_why_not():
    cmd, how, cleanup = disk.memory_limited(["true"], 256 << 20)
    try:
        if how.startswith("could not"):
            assert cmd == ["true"]
        else:
            assert subprocess.run(cmd, capture_output=True).returncode == 0
            assert str(256 << 20) in how
    finally:
        cleanup()


def test_cli_rejects_bad_modes(path, capsys):
    assert main(["bench", "disk", "-m", path, "--expert-io", "mmap", "--out-dir", os.devnull]) != 0
    assert "--expert-io" in capsys.readouterr().err


def test_llama_bench_past_its_time_is_stopped_with_a_bound(tmp_path):
    """A llama-bench paging through a small limit can run for hours: it is stopped at the timeout and the row says
    its speed was below n / timeout."""
    import time

    from hybridinfer.tools.benchmarks.disk import llama_bench_limited

    slow = tmp_path / "llama-bench"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"\0" * 4096)
    t0 = time.monotonic()
    r = llama_bench_limited(str(slow), str(f), 1, 8, 1 << 30, timeout=1.0)
    assert time.monotonic() - t0 < 20
    assert r["tok_s"] is None and r["tok_s_below"] == 8.0 and "stopped after 1 s" in r["error"]


def test_memory_fill_leaves_about_the_limit_and_gives_it_back():
    """bench disk --llama-fill-memory's stand-in for a cgroup: it takes memory until MemAvailable is about the limit
    (here 192 MiB below what is free, so the machine running the suite keeps nearly everything), and gives it back."""
    from hybridinfer.tools.benchmarks.memfill import MemoryFill, meminfo

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) << 10 for x in f if x.startswith("VmRSS:"))

    limit = meminfo()["MemAvailable"] - (192 << 20)
    r0 = rss()
    with MemoryFill(limit, chunk=64 << 20) as f:
        assert f.taken >= 128 << 20, f.how  # more where other processes freed memory meanwhile
        assert rss() - r0 >= f.taken - (8 << 20), f.how  # touched: resident in this process
        # what it left, read right after the last chunk (other processes move MemAvailable a little either way)
        assert f.left <= limit + (64 << 20) and str(limit) in f.how, f.how
    assert rss() - r0 <= 32 << 20 and f.taken == 0
    with pytest.raises(ValueError, match="limit"):
        MemoryFill(0)


def test_memory_limited_falls_back_to_a_fill_only_when_asked(monkeypatch):
    """Without a cgroup or systemd-run, the limit is a fill only with fill=True; the command runs unchanged."""
    from hybridinfer.tools.benchmarks import memfill

    monkeypatch.setattr(disk.shutil, "which", lambda name: None)
    monkeypatch.setattr(disk.os, "makedirs", lambda *a, **k: (_ for _ in ()).throw(OSError("read-only")))
    cmd, how, cleanup = disk.memory_limited(["true"], 1 << 30)
    assert cmd == ["true"] and how.startswith("could not")
    made = []

    class Fake:
        def __init__(self, limit):
            made.append(limit)
            self.how = f"filled for {limit}"

        def release(self):
            made.append("released")

    monkeypatch.setattr(memfill, "FillProcess", Fake)
    cmd, how, cleanup = disk.memory_limited(["true"], 1 << 30, fill=True)
    cleanup()
    assert cmd == ["true"] and f"filled for {1 << 30}" in how and made == [1 << 30, "released"]


def test_fill_process_holds_the_fill_in_a_child_until_released():
    """The fill as bench disk uses it: in a child process (which asks the OOM killer to spare it), its line read
    back, ended by release()."""
    from hybridinfer.tools.benchmarks.memfill import FillProcess, meminfo

    f = FillProcess(meminfo()["MemAvailable"] - (128 << 20))
    try:
        assert f.how.startswith("host memory filled:") and "OOM killer" in f.how, f.how
        assert f.p.poll() is None
    finally:
        f.release()
    assert f.p.returncode == 0

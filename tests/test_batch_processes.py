"""`hybridinfer batch` as processes: two on one output (the second is refused with the first's pid, every line is
written once), input from a real pipe (/dev/stdin: read once, run, resumed from the same bytes, refused for other
bytes), and a file that is no batch output named as -o (one line, status 2, untouched, before the model loads).
Every process is bounded in time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("pydantic")

from batch_records import records as _records  # noqa: E402
from test_batch_resume import _cmd, _lines  # noqa: E402

from hybridinfer.cli import main  # noqa: E402


def _write(path, n: int, max_tokens: int) -> bytes:
    data = "".join(json.dumps({"custom_id": f"q{i}", "prompt": f"Tell me about the number {i}.",
                               "max_tokens": max_tokens, "temperature": 0}) + "\n" for i in range(n))
    path.write_text(data)
    return data.encode()


def test_two_processes_on_one_output(tmp_path):
    """The first job is long (64 requests of 48 tokens); once it has written a line a second job on the same
    output is refused at once, naming the first's pid; the first then stops (Ctrl-C) with each line written once
    and its lock file gone."""
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    n = 64
    _write(job, n, 48)
    first = subprocess.Popen(_cmd(job, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while _lines(out) < 1 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.poll() is None, "the first job ended before the second could start"
        second = subprocess.run(_cmd(job, out), capture_output=True, text=True, timeout=120)
        assert first.poll() is None, "the first job ended while the second ran: nothing was tested"
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1 and f"pid {first.pid}" in second.stderr, second.stderr
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
        first.wait()
    assert first.returncode == 130, err
    got = _records(out)  # asserts no line twice
    assert 0 < len(got) < n and not os.path.exists(f"{out}.lock")


def test_input_from_a_pipe(tmp_path):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    data = _write(job, 5, 3)
    cmd = _cmd("/dev/stdin", out, "--progress", "json")
    r = subprocess.run(cmd, input=data, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stderr.decode().strip().splitlines()[-1])
    assert summary["done"] == summary["written"] == summary["total"] == 5
    assert len(_records(out)) == 5
    # the same bytes piped again: the job is its own, and complete
    r = subprocess.run(cmd, input=data, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stderr.decode().strip().splitlines()[-1])
    assert summary["done_before"] == summary["done"] == 5 and summary["written"] == 0
    # other bytes: another job's input, refused in one line
    before = out.read_bytes()
    r = subprocess.run(cmd, input=data.replace(b"number", b"letter"), capture_output=True, timeout=300)
    assert r.returncode == 2 and b"another input" in r.stderr and r.stderr.count(b"\n") == 1, r.stderr
    assert out.read_bytes() == before


def test_cli_refuses_a_file_that_is_no_batch_output(tmp_path, capsys):
    job, notes = tmp_path / "job.jsonl", tmp_path / "notes.jsonl"
    _write(job, 2, 2)
    data = b"".join(json.dumps({"note": i, "text": "remember the milk " * 5}).encode() + b"\n" for i in range(400))
    notes.write_bytes(data)
    # no -m: the default model would load, but the output is refused before that
    assert main(["batch", "--backend", "cpu", str(job), "-o", str(notes)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no output of a batch job" in err, err
    assert notes.read_bytes() == data
    assert main(["batch", "--backend", "cpu", str(job), "-o", "/dev/full"]) == 2
    assert "not a regular file" in capsys.readouterr().err


def test_a_full_disk_ends_the_cli_in_one_line(tmp_path):
    """The output on a 16 KiB tmpfs (mounting one needs root: skipped where it cannot be mounted; the library's
    write errors are tested without it in test_batch_robust): status 2, one line naming the input line, no hang,
    and the output ends with a whole record."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        job, out = tmp_path / "job.jsonl", disk / "out.jsonl"
        _write(job, 48, 2)
        r = subprocess.run(_cmd(job, out), capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "writing the answer to input line" in r.stderr and "No space left" in r.stderr, r.stderr
        got = _records(out)
        assert 0 < len(got) < 48 and out.read_bytes().endswith(b"\n")
    finally:
        subprocess.run(["umount", str(disk)], check=True)

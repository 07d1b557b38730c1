"""Exactly once: `hybridinfer batch` killed with SIGKILL at random points (several times in one job, once with a torn
last line left behind) and run again until done answers every input line exactly once, with the same greedy text as
an uninterrupted run; Ctrl-C stops cleanly after writing what has finished."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from batch_records import records

pytest.importorskip("pydantic")

SYSTEM = "You are a helpful assistant in a batch job. Answer briefly, in one sentence. " * 3


def _job(path) -> int:
    lines = []
    for i in range(20):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {i} times 3?"}]
        lines.append(json.dumps({"custom_id": f"q{i}", "messages": msgs, "max_tokens": 12, "temperature": 0}))
    lines.insert(5, "{torn json")
    lines.insert(9, json.dumps({"custom_id": "q3", "prompt": "a duplicate", "max_tokens": 2}))
    lines.append(json.dumps({"custom_id": "seeded", "prompt": "Once upon a time", "max_tokens": 12,
                             "temperature": 0.9, "seed": 7}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def _cmd(job, out, *extra):
    return [sys.executable, "-m", "hybridinfer", "batch", "--backend", "cpu", "--n-ctx", "512", "--max-seqs", "4",
            "--progress", "none", str(job), "-o", str(out), *extra]


def _lines(path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _answer(r: dict):
    """What must not change between runs: status, text, finish reason, token counts (not ids or times)."""
    if r["response"] is None:
        return r["custom_id"], r["error"]
    b = r["response"]["body"]
    if r["response"]["status_code"] != 200:
        return r["custom_id"], b
    c = b["choices"][0]
    text = c["message"]["content"] if "message" in c else c["text"]
    return r["custom_id"], text, c["finish_reason"], b["usage"]["completion_tokens"]


def test_kill9_at_random_points_gives_each_line_once(tmp_path):
    job = tmp_path / "job.jsonl"
    n = _job(job)
    base = tmp_path / "base.jsonl"
    subprocess.run(_cmd(job, base), check=True, capture_output=True, timeout=300)
    want = {k: _answer(v) for k, v in records(base).items()}
    assert len(want) == n

    out, rng, kills = tmp_path / "out.jsonl", random.Random(1), 0
    for attempt in range(8):
        p = subprocess.Popen(_cmd(job, out, "--sync-every", "3"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        have, target = _lines(out), rng.randint(1, 4)
        deadline = time.monotonic() + 120
        while p.poll() is None and _lines(out) < have + target and time.monotonic() < deadline:
            time.sleep(0.01)
        if p.poll() is not None:  # finished before the kill
            assert p.returncode == 0
            break
        time.sleep(rng.random() * 0.3)  # somewhere between two lines, or in the middle of a prefill
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
        if attempt == 1:  # a crash in the middle of a line: the next run truncates and redoes it
            with open(out, "ab") as f:
                f.write(b'{"id":"batch_req_999","custom_id":"q1","response":{"status_')
    assert kills >= 3
    r = subprocess.run(_cmd(job, out), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = records(out)
    assert sorted(got) == sorted(want)  # every input line once, none twice
    assert {k: _answer(v) for k, v in got.items()} == want  # and the same answers as the uninterrupted run


def test_sigint_stops_after_writing_what_finished(tmp_path):
    job = tmp_path / "job.jsonl"
    n = _job(job)
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen(_cmd(job, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while _lines(out) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted" in err
    before = records(out)  # every line whole and valid
    assert 0 < len(before) < n
    with open(out, "rb") as f:
        assert f.read().endswith(b"\n")
    r = subprocess.run(_cmd(job, out, "--progress", "json"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0
    summary = json.loads(r.stderr.strip().splitlines()[-1])
    assert summary["event"] == "summary" and summary["done_before"] == len(before) and summary["done"] == n
    assert len(records(out)) == n
    os.remove(out)

"""`hybridinfer batch --ray`: shards as Ray actors on a local cluster (started by the test on 127.0.0.1 with two CPUs),
one actor's worker process killed with SIGKILL mid-job; the merged output holds every line exactly once, in input
order, with the answers of a run on one engine."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("pydantic")

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.batch import run_job  # noqa: E402
from hybridinfer.serving.batch.ray_runner import part_path, run_ray  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


def _answers(path) -> dict:
    out = {}
    with open(path, "rb") as f:
        for raw in f:
            r = json.loads(raw)
            assert r["id"] not in out
            b = (r["response"] or {}).get("body")
            out[r["id"]] = (r["custom_id"], b["choices"][0]["message"]["content"] if b and "choices" in b else
                            r["error"] or b)
    return out


def test_ray_shards_with_a_killed_worker(cluster, smollm_path, tmp_path):
    job = tmp_path / "job.jsonl"
    lines = [json.dumps({"custom_id": f"q{i}", "messages": [{"role": "user", "content": f"Say the number {i}."}],
                         "max_tokens": 10, "temperature": 0}) for i in range(24)]
    lines.insert(3, "not json")
    job.write_text("\n".join(lines) + "\n")
    make = functools.partial(Engine.load, smollm_path, backend="cpu", n_ctx=512, max_seqs=4, n_threads=1)
    eng = make()
    run_job(eng, str(job), str(tmp_path / "base.jsonl"))
    eng.close()
    want = _answers(tmp_path / "base.jsonl")

    out = str(tmp_path / "out.jsonl")
    actors, result = [], {}

    def drive():
        try:
            result["summary"] = run_ray(make, str(job), out, n_shards=2, on_actor=lambda i, a: actors.append((i, a)))
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=drive)
    t.start()
    part = part_path(out, 0, 2)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and t.is_alive():
        if os.path.exists(part) and open(part, "rb").read().count(b"\n") >= 2:
            break
        time.sleep(0.05)
    first = next(a for i, a in actors if i == 0)
    os.kill(ray.get(first.pid.remote()), signal.SIGKILL)  # the shard's worker process dies mid-job
    t.join(300)
    assert "error" not in result, result.get("error")
    s = result["summary"]
    assert s["retries"] == 1 and s["shards"] == 2 and s["done"] == len(lines)
    got = _answers(out)
    assert list(got) == sorted(got, key=lambda x: int(x.split("_")[-1]))  # merged in input order
    assert got == want  # every line once, the same answers
    assert not os.path.exists(part)
    # run again: already complete, nothing redone
    assert run_ray(make, str(job), out, n_shards=2)["already_complete"]


def test_a_shard_closes_its_engine_when_its_job_ends(smollm_path, tmp_path):
    """The actor's body outside Ray: its engine (worker, backend memory) is closed once the shard's job returns."""
    from hybridinfer.serving.batch.ray_runner import _Shard

    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt": "Hi.", "max_tokens": 2, "temperature": 0})
                           + "\n" for i in range(3)))
    shard = _Shard(functools.partial(Engine.load, smollm_path, backend="cpu", n_ctx=256, n_threads=1))
    got = shard.run(str(job), str(tmp_path / "part"), (0, 1), {})
    assert got["done"] == 3
    assert shard.engine.backend is None and not shard.engine._scheduler.worker_alive

"""One batch job over a Ray cluster: its shards (jobfile.shard_of) run as actors that each load the model once and
run `run_job` on their shard into a part file; the driver merges the parts into one output in input order.

Exactly once across failures: a part file is a resumable output of its own, so an actor that dies (its machine
lost, its process killed) is replaced by a new one that resumes the same part, and the merge happens only when
every shard has finished. The input and the output's folder must be at the same path on every node (a shared
filesystem, as a shared prefix-cache folder is), so the input is a file, not a pipe. The driver holds the output's
lock and claims it as a single job's output is claimed (guard.py); each part has its own lock and job file.
Needs `ray` (the `batch` extra)."""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import time
from collections import Counter

from ...engine.fsutil import fsync_dir
from ...errors import ParameterError
from .guard import OutputLock, claim, job_identity, sidecar_path
from .inputfile import JobInput
from .output import scan
from .reader import input_lines

RETRY_ERRORS = ("ActorDiedError", "RayActorError", "WorkerCrashedError", "ActorUnavailableError",
                "NodeDiedError", "OwnerDiedError")


def part_path(output: str, i: int, n: int) -> str:
    return f"{output}.part{i}of{n}"


class _Shard:
    """The actor: the model loaded once (`make_engine()`), then one shard's job."""

    def __init__(self, make_engine):
        self.engine = make_engine()

    def pid(self) -> int:
        return os.getpid()

    def run(self, input_path: str, part: str, shard: tuple[int, int], job: dict) -> dict:
        """The shard's job; then the engine is closed (an actor runs one shard: a retry is a new actor)."""
        from .runner import run_job

        try:
            return run_job(self.engine, input_path, part, shard=shard, ordered=True, **job)
        finally:
            self.engine.close()


def _records(path: str):
    """(input line, raw line) of a part sorted by input line."""
    from .jobfile import line_number

    with open(path, "rb") as f:
        for raw in f:
            yield line_number(json.loads(raw)), raw


def merge(parts: list[str], output: str) -> int:
    """Merge sorted parts into `output` in input order (atomically, streaming: memory does not grow with the job)."""
    tmp = output + ".merging"
    n = 0
    with open(tmp, "wb") as out:
        for _, raw in heapq.merge(*(_records(p) for p in parts), key=lambda r: r[0]):
            out.write(raw)
            n += 1
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, output)
    fsync_dir(os.path.dirname(os.path.abspath(output)))
    return n


def _lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def run_ray(make_engine, input_path: str, output_path: str, *, n_shards: int | None = None, address: str | None = None,
            init_kwargs: dict | None = None, cpus_per_shard: float = 1, max_retries: int = 3, job: dict | None = None,
            on_actor=None, on_progress=None, poll_s: float = 0.5) -> dict:
    """Run the job on Ray and return its summary. make_engine: a picklable callable that loads the Engine in an
    actor. n_shards: actors (default: the cluster's alive nodes). address: a running cluster's address, None to
    start a local one (init_kwargs go to ray.init). max_retries: replacements of a dead actor per shard. job:
    run_job's options. on_actor(shard, actor): called with each actor started; on_progress(done, total): called
    while the shards run."""
    job = dict(job or {})
    with OutputLock(output_path):
        inp = JobInput(input_path, 1 << 20)
        if inp.is_pipe:
            raise ParameterError(f"a Ray job's shards read its input {input_path!r} on their nodes: name a file (on a "
                                 f"shared filesystem), not a pipe")
        digest = hashlib.sha256()
        total = sum(1 for _ in input_lines(inp, (0, 1), digest))
        if claim(output_path, job_identity(digest.hexdigest(), job.get("model_name"), (0, 1), input_path)):
            done, _, torn = scan(output_path)
            if len(done) >= total and not torn:  # merged by an earlier run
                return {"done": total, "total": total, "written": 0, "already_complete": True, "interrupted": False,
                        "by_status": {}, "shards": 0, "retries": 0}
        return _run(make_engine, input_path, output_path, total, job, n_shards=n_shards, address=address,
                    init_kwargs=init_kwargs, cpus_per_shard=cpus_per_shard, max_retries=max_retries,
                    on_actor=on_actor, on_progress=on_progress, poll_s=poll_s)


def _run(make_engine, input_path: str, output_path: str, total: int, job: dict, *, n_shards, address, init_kwargs,
         cpus_per_shard, max_retries, on_actor, on_progress, poll_s) -> dict:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, **(init_kwargs or {}))
    n = n_shards or max(1, sum(1 for nd in ray.nodes() if nd.get("Alive")))
    actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(_Shard)
    # two calls at once: pid() answers while run() works (monitoring, tests)
    opts = {"num_cpus": cpus_per_shard, "scheduling_strategy": "SPREAD", "max_concurrency": 2}
    parts = [part_path(output_path, i, n) for i in range(n)]
    running, retries, summaries = {}, Counter(), {}

    def start(i: int) -> None:
        actor = actor_cls.options(**opts).remote(make_engine)
        if on_actor is not None:
            on_actor(i, actor)
        running[actor.run.remote(input_path, parts[i], (i, n), job)] = (i, actor)

    t0 = time.perf_counter()
    for i in range(n):
        start(i)
    try:
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=poll_s)
            for ref in ready:
                i, actor = running.pop(ref)
                try:
                    summaries[i] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - a dead actor's shard is resumed by a new one
                    if type(e).__name__ not in RETRY_ERRORS and not isinstance(e, ray.exceptions.RayActorError):
                        raise
                    retries[i] += 1
                    if retries[i] > max_retries:
                        raise RuntimeError(f"shard {i}/{n} failed {retries[i]} times; its part {parts[i]!r} keeps "
                                           f"what it finished: run the job again to resume") from e
                    ray.kill(actor)
                    start(i)
            if on_progress is not None:
                on_progress(sum(_lines(p) for p in parts), total)
    finally:
        for _, actor in running.values():
            ray.kill(actor)
    unfinished = [i for i in range(n) if summaries[i].get("interrupted")]
    if unfinished:
        raise RuntimeError(f"shard(s) {unfinished} of {n} stopped before the end: run the job again to resume")
    written = merge(parts, output_path)
    for p in parts:
        os.remove(p)
        os.remove(sidecar_path(p))
    by_status: Counter = Counter()
    for s in summaries.values():
        by_status.update(s["by_status"])
    keys = ("prompt_tokens", "reused_tokens", "prefilled_tokens", "generated_tokens")
    out = {k: sum(s[k] for s in summaries.values()) for k in keys}
    return {"done": written, "total": total, "written": sum(s["written"] for s in summaries.values()),
            "by_status": dict(sorted(by_status.items())), **out, "wall_s": round(time.perf_counter() - t0, 3),
            "shards": n, "retries": sum(retries.values()), "interrupted": False, "output": output_path}

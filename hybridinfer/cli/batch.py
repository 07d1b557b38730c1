"""`hybridinfer batch`: a resumable JSONL job in the OpenAI Batch format (hybridinfer.serving.batch)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from ..errors import ParameterError
from .args import _add_cache, _add_model, _check_output, _int_at_least, add_model_names, parse_size


def _stop_on_signals(stop: threading.Event) -> None:
    """The first Ctrl-C (or SIGTERM) stops the job after writing what is finished; a second one aborts."""

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("\nhybridinfer: stopping after the requests that have finished (Ctrl-C again to abort)",
              file=sys.stderr)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def cmd_batch(a) -> int:
    from ..serving.batch.jobfile import parse_shard

    if a.numa_plan:
        from .numa import _model_bytes, numa_plan, print_topology

        numa_plan(a)  # a policy this machine cannot carry out is an error here too
        print_topology(_model_bytes(a.model), [a.numa])
        return 0
    if a.input is None or a.output is None:
        raise ParameterError("batch needs an INPUT.jsonl and -o OUTPUT.jsonl")
    with open(a.input, "rb"):  # unreadable input: said before the model loads
        pass
    _check_output(a.output, "-o/--output")
    if os.path.exists(a.output) and os.path.samefile(a.input, a.output):
        raise ParameterError(f"-o/--output {a.output!r} is the input file")
    if a.max_line_bytes is not None and a.max_line_bytes < 1:
        raise ParameterError(f"--max-line-bytes must be at least 1 byte, got {a.max_line_bytes}")
    try:
        shard = parse_shard(a.shard)
    except ValueError as e:
        raise ParameterError(f"--shard: {e}") from None
    try:
        from ..serving.batch import run_job
        from ..serving.batch.guard import check_output
        from ..serving.batch.inputfile import JobInput
    except ModuleNotFoundError as e:
        raise ParameterError(f"batch needs its packages ({e.name} is missing): pip install -e '.[batch]'") from None
    JobInput(a.input, 1)  # neither file nor pipe: said before the model loads
    check_output(a.output)  # another process's output, or no batch output at all: refused before the model loads
    progress = a.progress or ("bar" if sys.stderr.isatty() else "none")
    a.no_progress = a.no_progress or progress != "bar"  # the load's bars only where the job's bar is shown
    if a.ray:
        if shard != (0, 1):
            raise ParameterError("--ray runs every shard itself: leave out --shard")
        return _cmd_ray(a, progress)
    from . import _engine

    stop = threading.Event()
    _stop_on_signals(stop)
    with _engine(a, quiet=progress == "json") as eng:  # closed at the end: worker stopped, memory let go
        summary = run_job(eng, a.input, a.output, model_name=a.alias or None,
                          strict_model_name=a.strict_model_name, shard=shard, window=a.window,
                          max_inflight=a.max_inflight, sync_every=a.sync_every, ordered=a.ordered,
                          progress=progress, progress_stream=sys.stderr, stop=stop, max_line_bytes=a.max_line_bytes,
                          allow_remote_images=a.allow_remote_images)
    if progress != "json":
        from ..serving.batch.progress import format_summary

        print(format_summary(summary), file=sys.stderr)
    if a.summary:
        with open(a.summary, "w") as f:
            json.dump(summary, f, indent=1)
    return 130 if summary["interrupted"] else 0


def _shard_engine(a):
    """A Ray actor's engine: placed as --numa asks on its node, then loaded (runs in the actor's process)."""
    from . import _engine

    return _engine(a)


def _cmd_ray(a, progress: str) -> int:
    import functools
    import importlib.util

    if importlib.util.find_spec("ray") is None:  # said before the model loads (ray_runner imports it late)
        raise ParameterError("--ray needs Ray, which is not installed: pip install -e '.[ray]' (batch without "
                             "--ray runs without it)")
    from ..serving.batch.ray_runner import run_ray
    bar = None
    if progress == "bar":
        from tqdm import tqdm

        bar = tqdm(unit="req", file=sys.stderr, dynamic_ncols=True)

    def shown(done: int, total: int) -> None:
        if bar is not None:
            bar.total, bar.n = total, done
            bar.refresh()
        elif progress == "json":
            print(json.dumps({"event": "progress", "done": done, "total": total}), file=sys.stderr, flush=True)

    job = {"model_name": a.alias or None, "strict_model_name": a.strict_model_name, "window": a.window,
           "max_inflight": a.max_inflight, "sync_every": a.sync_every, "max_line_bytes": a.max_line_bytes,
           "allow_remote_images": a.allow_remote_images}
    local = a.ray == "local"
    summary = run_ray(functools.partial(_shard_engine, a), a.input, a.output, n_shards=a.ray_shards,
                      address=None if local else a.ray, init_kwargs={"include_dashboard": False} if local else {},
                      cpus_per_shard=a.threads or 1, job=job, on_progress=shown)
    if bar is not None:
        bar.close()
    if progress == "json":
        print(json.dumps({"event": "summary", **summary}), file=sys.stderr)
    else:
        status = ", ".join(f"{k}: {v}" for k, v in summary["by_status"].items()) or "none"
        print(f"batch: {summary['done']}/{summary['total']} done over {summary.get('shards', 0)} Ray shard(s) "
              f"({status}; {summary.get('retries', 0)} shard(s) retried)", file=sys.stderr)
    if a.summary:
        with open(a.summary, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def add_batch_parser(sub) -> None:
    p = sub.add_parser("batch", help="run a JSONL job in the OpenAI Batch format (resumable; needs the batch extra)",
                       description="Each input line: {custom_id, method: POST, url: /v1/chat/completions | "
                                   "/v1/completions | /v1/messages, body} or {custom_id, messages | prompt, "
                                   "...sampling}. Each output line: {id, custom_id, response: {status_code, "
                                   "request_id, body}, error}, in completion order (--ordered: input order at the "
                                   "end). Running the same command again resumes: lines already answered are "
                                   "skipped, a torn last line is redone. OUTPUT must be absent, empty or this "
                                   "job's own (OUTPUT.job names its input's hash and model), and one process "
                                   "writes it at a time (OUTPUT.lock).")
    _add_model(p)
    _add_cache(p)
    p.add_argument("input", nargs="?", help="the job: a JSONL file")
    p.add_argument("-o", "--output", help="the results (JSONL), appended to and resumed from")
    add_model_names(p)
    p.add_argument("--sync-every", type=_int_at_least(0), default=100,
                   help="fsync the output every N lines (and at the end; 0: only at the end; default 100)")
    p.add_argument("--progress", choices=["bar", "json", "none"], default=None,
                   help="a tqdm bar, JSON lines on stderr, or nothing (default: a bar on a terminal, else nothing)")
    p.add_argument("--ordered", action="store_true", help="rewrite the output in input order once the job is done")
    p.add_argument("--shard", default="0/1", metavar="I/N",
                   help="run only shard I of N (by a hash of custom_id; each shard writes its own -o)")
    p.add_argument("--window", type=_int_at_least(1), default=1024,
                   help="requests read ahead and sorted together so shared prefixes run together (default 1024)")
    p.add_argument("--max-inflight", type=_int_at_least(1), default=None,
                   help="requests on the scheduler at once (default 2 x --max-seqs)")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="fetch images that lines give as http(s) URLs (default: an error line; data: URLs always work)")
    p.add_argument("--max-line-bytes", type=parse_size, default=None,
                   help="input lines longer than this are error lines, never parsed (default: 64 bytes a token of "
                        "-c/--ctx-size, at least 1MiB)")
    p.add_argument("--numa-plan", action="store_true", help="print the NUMA topology's plan for --numa and exit")
    p.add_argument("--summary", default=None, help="also write the summary as JSON to this file")
    p.add_argument("--ray", default=None, metavar="ADDRESS|local",
                   help="run the shards as Ray actors on this cluster (local: start one here), each loading the "
                        "model once; the output is merged in input order (input and output on a shared filesystem)")
    p.add_argument("--ray-shards", type=_int_at_least(1), default=None,
                   help="shards (actors) of a --ray job (default: the cluster's nodes)")
    p.set_defaults(fn=cmd_batch)

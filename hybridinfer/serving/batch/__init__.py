"""`hybridinfer batch`: resumable JSONL jobs in the OpenAI Batch format on one Engine's scheduler.

`run_job(engine, input, output, ...)` runs a job (runner.py); the lines are those of the server's request protocol
(jobfile.py, hybridinfer.serving.protocol), read in bounded lines, from a file or a pipe (inputfile.py) and made
into requests (reader.py); the output is appended a whole line at a time and resumed after a crash (output.py), by
one process at a time and only by the job that began it (guard.py); requests sharing a prefix run together
(order.py); shards as Ray actors (ray_runner.py: `run_ray`). Needs pydantic (the `batch` extra; ray for run_ray).
Settings come as arguments: only the command line (hybridinfer.cli.batch) reads flags."""

from __future__ import annotations

from .ray_runner import run_ray
from .runner import DEFAULT_WINDOW, count_lines, run_job

__all__ = ["DEFAULT_WINDOW", "count_lines", "run_job", "run_ray"]

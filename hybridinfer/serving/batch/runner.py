"""A batch job on one Engine: read the input, run its requests on the scheduler, append each result to the output.

A reader thread streams the input and turns each line into a Request (template, tokens: the slow part of a line
besides its generation), a window at a time, each window sorted so that shared prefixes run together (order.py).
The caller's thread keeps at most `max_inflight` requests on the scheduler (twice its max_seqs by default: a full
batch running and as many waiting, so admission always finds the next ones and their shared prefixes), and writes
each result as it finishes (completion order; `ordered` sorts the file by input line at the end). Memory is bounded
by the windows held (the one running and the one being read), whatever the length of the input.

Exactly once: a line is skipped when the output already answers it (output.py), so running the same job again after
a crash or a kill finishes it; requests are not written until finished, and a cancelled one is not written. The
output is held by one process at a time and resumed only by the job that began it (guard.py: the input's hash and
the job's settings), so an edited input or another job's file is refused, never doubled or skipped into.

A request fails alone: an error in building it, submitting it, generating it or making its body is that line's
error record and the job goes on. A write that fails (a full disk) stops the job with an error naming the line."""

from __future__ import annotations

import hashlib
import os
import queue
import sys
import threading
import time
from collections import deque

from ...errors import CapacityError
from ..protocol.context import Context, default_model_name, parse_events
from .guard import BatchOutputError, OutputLock, claim, job_identity
from .inputfile import JobInput, default_max_line_bytes
from .jobfile import ok_record
from .output import Output, sort_records
from .progress import Progress, Stats
from .reader import Item, Reader, failure_record, input_lines

DEFAULT_WINDOW = 1024  # requests sorted together (see order.py)
WIND_DOWN_S = 60.0  # how long a stopping job waits, in all, for its cancelled requests to let go


def count_lines(path: str, shard: tuple[int, int] = (0, 1), max_line_bytes: int = 1 << 20) -> int:
    """Non-blank lines of this shard (a pipe is read once, into a temporary file, and counted there)."""
    inp = JobInput(path, max_line_bytes)
    try:
        return sum(1 for _ in input_lines(inp, shard))
    finally:
        inp.close()


def run_job(engine, input_path: str, output_path: str, *, model_name=None, strict_model_name: bool = False,
            shard: tuple[int, int] = (0, 1), window: int = DEFAULT_WINDOW, max_inflight: int | None = None,
            sync_every: int = 100, ordered: bool = False, progress: str = "none", progress_stream=None,
            stop: threading.Event | None = None, max_line_bytes: int | None = None,
            allow_remote_images: bool = False) -> dict:
    """Run the batch job `input_path` -> `output_path` on `engine` and return its summary (progress.Stats). An
    existing output is resumed when it is this job's (guard.py); any other is refused with BatchOutputError,
    untouched, as is an output another process is writing. shard (i, n): run only the lines whose custom_id
    hashes to shard i of n (jobfile). window: requests sorted together by prefix; max_inflight: requests on the
    scheduler at once (default 2 x max_seqs); sync_every: fsync every that many lines (0: at the end only);
    ordered: sort the output by input line once the job is complete. stop: set it (from a signal handler) to stop
    after writing what has finished. max_line_bytes: longer input lines are error lines, never parsed (default:
    inputfile.default_max_line_bytes of the engine's n_ctx). model_name, strict_model_name: as the server's
    (serve.create_app): a body's `model` may name anything unless strict_model_name. allow_remote_images: fetch
    images given as http(s) URLs (default: the line's answer is a 400 saying so)."""
    if window < 1 or sync_every < 0:
        raise ValueError(f"window must be >= 1 and sync_every >= 0, got {window!r}, {sync_every!r}")
    stop = stop or threading.Event()
    ctx = Context(engine, model_name or default_model_name(engine), strict_model_name)
    ctx.allow_remote_images = bool(allow_remote_images)
    limit = default_max_line_bytes(engine.n_ctx) if max_line_bytes is None else max_line_bytes
    with OutputLock(output_path):
        inp = JobInput(input_path, limit, spool_dir=os.path.dirname(os.path.abspath(output_path)))
        try:
            digest = hashlib.sha256()
            total = sum(1 for _ in input_lines(inp, shard, digest))
            claim(output_path, job_identity(digest.hexdigest(), ctx.model_name, shard, input_path))
            out = Output(output_path, sync_every)
            stats = Stats(total, min(len(out.done), total))
            prog = Progress(stats, progress, progress_stream or sys.stderr)
            reader = Reader(ctx, inp, shard, out.done, window, stop)
            reader.start()
            complete = _drive(ctx.engine.scheduler, reader, out, stats, prog, max_inflight or 2 * engine.max_seqs,
                              stop)
        finally:
            inp.close()
        if ordered and complete:
            sort_records(output_path)
    return prog.close({"interrupted": not complete, "output": output_path, "shard": f"{shard[0]}/{shard[1]}",
                       "torn_bytes_truncated": out.torn_bytes})


def _drive(sched, reader: Reader, out: Output, stats: Stats, prog: Progress, cap: int, stop) -> bool:
    """Keep up to `cap` requests on the scheduler and write each as it finishes; True when the job is complete."""
    inflight: list[tuple[Item, object]] = []
    pending: deque[Item] = deque()
    exhausted = failed = False
    try:
        while not stop.is_set():
            still, finished = [], []
            for pair in inflight:
                (finished if pair[1].done() else still).append(pair)
            inflight = still  # before any write: one that fails leaves no answered handle behind
            for it, h in finished:
                _write_result(out, stats, it, h)
            while len(inflight) + len(pending) < cap and not exhausted:
                try:
                    got = reader.out.get(timeout=0.02 if inflight or pending else 0.2)
                except queue.Empty:
                    break
                if isinstance(got, BaseException):
                    raise got
                if got is None:
                    exhausted = True
                    break
                items, errors = got
                for rec in errors:
                    _write(out, stats, rec)
                pending.extend(items)
            todo = [pending.popleft() for _ in range(min(len(pending), cap - len(inflight)))]
            if todo:
                inflight += _submit(sched, todo, out, stats)
            prog.update()
            if exhausted and not inflight and not pending:
                return True
            if inflight and not any(h.done() for _, h in inflight):
                time.sleep(0.005)
        return False
    except BaseException:
        failed = True
        raise
    finally:
        stop.set()  # the reader stops too
        _wind_down(out, stats, inflight, quiet=failed)


def _submit(sched, todo: list[Item], out: Output, stats: Stats) -> list[tuple[Item, object]]:
    """Submit `todo` together (so shared prefixes meet at admission); when that fails, one at a time, and a
    request that fails alone gets its error record. A CapacityError here is the scheduler's (closed), not a
    request's: requests that could never fit were refused when read."""
    for it in todo:  # no next turn: no snapshot at a prompt's or reply's end (shared prefixes are kept)
        it.request.keep_ends = False
    try:
        return list(zip(todo, sched.submit_many([it.request for it in todo]), strict=True))
    except CapacityError:
        raise
    except Exception:  # noqa: BLE001 - found out below, request by request
        pass
    pairs = []
    for it in todo:
        try:
            pairs.append((it, sched.submit(it.request)))
        except CapacityError:
            raise
        except Exception as e:  # noqa: BLE001 - this request's failure, written as its line
            _write(out, stats, failure_record(it.line, e))
    return pairs


def _wind_down(out: Output, stats: Stats, inflight: list, quiet: bool) -> None:
    """Cancel what runs, wait for it (WIND_DOWN_S in all), write what finished before the cancel took effect (the
    rest runs next time) and close the output. quiet: the job is failing already; a second error is not raised."""
    for _, h in inflight:
        h.cancel()
    deadline = time.monotonic() + WIND_DOWN_S
    err = None
    for it, h in inflight:
        try:
            h.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - written (or not) by _write_result below
            pass
        if err is None and not out.failed and h.done() and h.generation.finish_reason != "cancelled":
            try:
                _write_result(out, stats, it, h)
            except BatchOutputError as e:
                err = e
    try:
        out.close()
    except BatchOutputError as e:
        err = err or e
    if err is not None and not quiet:
        raise err


def _write(out: Output, stats: Stats, rec: dict) -> None:
    out.write(rec)
    stats.add(str(rec["response"]["status_code"]) if rec["response"] else "error")


def _write_result(out: Output, stats: Stats, it: Item, h) -> None:
    """The record of a finished request (a cancelled one is left for the next run). Whatever fails in making its
    body is that request's 500; only a failed write goes up."""
    if it.written:  # its pieces are consumed: never read a handle twice
        return
    it.written = True
    line = it.line
    try:
        pieces = list(h)
        g = h.generation
        if g.finish_reason == "cancelled":
            return
        parser, first = it.call.parser()
        body = it.call.answer(it.call.head(), parse_events(parser, first, pieces), it.request, g)
        rec = ok_record(line.number, line.custom_id, body)
    except Exception as e:  # noqa: BLE001 - a failed generation or answer is that line's error, as the server's
        rec = failure_record(line, e)
        g = None
    out.write(rec)
    stats.add(str(rec["response"]["status_code"]), g)

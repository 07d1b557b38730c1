"""A batch job on one Engine: read the input, run its requests on the scheduler, append each result to the output.

A reader thread streams the input and turns each line into a Request (template, tokens: the slow part of a line
besides its generation), a window at a time, each window sorted so that shared prefixes run together (order.py).
The caller's thread keeps at most `max_inflight` requests on the scheduler (twice its max_seqs by default: a full
batch running and as many waiting, so admission always finds the next ones and their shared prefixes), and writes
each result as it finishes (completion order; `ordered` sorts the file by input line at the end). Memory is bounded
by the windows held (the one running and the one being read), whatever the length of the input.

Exactly once: a line is skipped when the output already answers it (output.py), so running the same job again after
a crash or a kill finishes it; requests are not written until finished, and a cancelled one is not written."""

from __future__ import annotations

import hashlib
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from ...errors import CapacityError, HybridInferError
from ..protocol.context import Context, default_model_name, parse_events
from ..protocol.errors import ApiError, from_engine
from .jobfile import (
    Line,
    LineError,
    api_error_record,
    api_of,
    line_error_record,
    make_call,
    ok_record,
    read_line,
    shard_key,
    shard_of,
)
from .order import trie_order
from .output import Output, sort_records
from .progress import Progress, Stats

DEFAULT_WINDOW = 1024  # requests sorted together (see order.py)


@dataclass
class _Item:
    line: Line
    call: object
    request: object


def _dup_key(custom_id: str):
    # long ids are kept as a digest: the map of seen ids is the one thing that grows with the input
    b = custom_id.encode("utf-8", "surrogatepass")
    return custom_id if len(b) <= 32 else hashlib.blake2b(b, digest_size=16).digest()


def _in_shard(number: int, raw: bytes, shard: tuple[int, int]) -> bool:
    i, n = shard
    return n == 1 or shard_of(shard_key(number, raw), n) == i


def _input_lines(path: str, shard: tuple[int, int]):
    """(line number, raw line) of the non-blank lines of this shard."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip() and _in_shard(number, raw, shard):
                yield number, raw


def count_lines(path: str, shard: tuple[int, int] = (0, 1)) -> int:
    return sum(1 for _ in _input_lines(path, shard))


class _Reader(threading.Thread):
    """Reads the input into sorted windows of _Items, with the error records of the lines that are no request."""

    def __init__(self, ctx: Context, path: str, shard, done, window: int, stop: threading.Event):
        super().__init__(name="hybridinfer-batch-reader", daemon=True)
        self.ctx, self.path, self.shard, self.done, self.window, self.stop = ctx, path, shard, done, window, stop
        self.out: queue.Queue = queue.Queue(maxsize=1)  # one window read ahead of the one running
        self.seen: dict = {}  # custom_id -> the line that used it first

    def run(self) -> None:
        try:
            items, errors = [], []
            for number, raw in _input_lines(self.path, self.shard):
                if self.stop.is_set():
                    return
                got = self._line(number, raw)
                if got is None:
                    continue
                (items if isinstance(got, _Item) else errors).append(got)
                if len(items) >= self.window or len(errors) >= self.window:
                    self._put(items, errors)
                    items, errors = [], []
            self._put(items, errors)
            self._send(None)
        except BaseException as e:  # noqa: BLE001 - the job's thread raises it
            self._send(e)

    def _line(self, number: int, raw: bytes):
        """An _Item, an error record, or None (a line done before)."""
        try:
            line = read_line(number, raw, self.ctx.model_name)
        except LineError as e:
            if e.custom_id is not None:  # a custom_id is taken by any line that carries it, answered or refused
                self.seen.setdefault(_dup_key(e.custom_id), number)
            return None if number in self.done else line_error_record(number, e)
        first = self.seen.setdefault(_dup_key(line.custom_id), number)
        if number in self.done:
            return None
        if first != number:
            return line_error_record(number, LineError("duplicate_custom_id", f"line {number}: custom_id "
                                                       f"{line.custom_id!r} is used by line {first} already",
                                                       line.custom_id))
        try:
            call = make_call(self.ctx, line)
            req = call.build()
            sched = self.ctx.engine.scheduler
            need = sched.request_bytes(req)
            if sched.state_budget is not None and need > sched.state_budget:
                raise CapacityError(f"a request of {len(req.ids)} prompt tokens + max_tokens {req.max_tokens} needs "
                                    f"{need} bytes of state, more than the state budget of {sched.state_budget} "
                                    f"bytes")
        except ApiError as e:
            return api_error_record(number, line.custom_id, e, api_of(line.url))
        except HybridInferError as e:
            return api_error_record(number, line.custom_id, from_engine(e), api_of(line.url))
        except Exception as e:  # noqa: BLE001 - as the server answers a bug in one request: a 500 for it alone
            return api_error_record(number, line.custom_id, ApiError(500, f"internal error: {type(e).__name__}: {e}"),
                                    api_of(line.url))
        return _Item(line, call, req)

    def _put(self, items: list[_Item], errors: list[dict]) -> None:
        if items or errors:
            order = trie_order([it.request.ids for it in items])
            self._send(([items[i] for i in order], errors))

    def _send(self, what) -> None:
        while not self.stop.is_set():
            try:
                self.out.put(what, timeout=0.1)
                return
            except queue.Full:
                continue


def run_job(engine, input_path: str, output_path: str, *, model_name: str | None = None,
            shard: tuple[int, int] = (0, 1), window: int = DEFAULT_WINDOW, max_inflight: int | None = None,
            sync_every: int = 100, ordered: bool = False, progress: str = "none", progress_stream=None,
            stop: threading.Event | None = None) -> dict:
    """Run the batch job `input_path` -> `output_path` on `engine` and return its summary (progress.Stats). An
    existing output is resumed. shard (i, n): run only the lines whose custom_id hashes to shard i of n (jobfile).
    window: requests sorted together by prefix; max_inflight: requests on the scheduler at once (default 2 x
    max_seqs); sync_every: fsync every that many lines (0: at the end only); ordered: sort the output by input line
    once the job is complete. stop: set it (from a signal handler) to stop after writing what has finished."""
    if window < 1 or sync_every < 0:
        raise ValueError(f"window must be >= 1 and sync_every >= 0, got {window!r}, {sync_every!r}")
    stop = stop or threading.Event()
    ctx = Context(engine, model_name or default_model_name(engine))
    cap = max_inflight or 2 * engine.max_seqs
    out = Output(output_path, sync_every)
    total = count_lines(input_path, shard)
    stats = Stats(total, min(len(out.done), total))
    prog = Progress(stats, progress, progress_stream or sys.stderr)
    reader = _Reader(ctx, input_path, shard, out.done, window, stop)
    reader.start()
    sched = engine.scheduler
    inflight: list[tuple[_Item, object]] = []
    pending: deque[_Item] = deque()
    exhausted, failure, complete = False, None, False
    try:
        while not stop.is_set():
            still = []
            for it, h in inflight:
                if h.done():
                    _write_result(out, stats, it, h)
                else:
                    still.append((it, h))
            inflight = still
            while len(inflight) + len(pending) < cap and not exhausted:
                try:
                    got = reader.out.get(timeout=0.02 if inflight or pending else 0.2)
                except queue.Empty:
                    break
                if got is None or isinstance(got, BaseException):
                    exhausted, failure = True, got
                    break
                items, errors = got
                for rec in errors:
                    out.write(rec)
                    stats.add(str(rec["response"]["status_code"]) if rec["response"] else "error")
                pending.extend(items)
            if failure is not None:
                raise failure
            todo = [pending.popleft() for _ in range(min(len(pending), cap - len(inflight)))]
            if todo:
                for it in todo:  # no next turn: no snapshot at a prompt's or reply's end (shared prefixes are kept)
                    it.request.keep_ends = False
                inflight += zip(todo, sched.submit_many([it.request for it in todo]), strict=True)
            prog.update()
            if exhausted and not inflight and not pending:
                complete = True
                break
            if inflight and not any(h.done() for _, h in inflight):
                time.sleep(0.005)
    finally:
        stop.set()  # the reader stops too
        for _, h in inflight:
            h.cancel()
        for it, h in inflight:  # what finished before the cancel took effect is written; the rest runs next time
            try:
                h.result(timeout=60)
            except Exception:  # noqa: BLE001 - written (or not) by _write_result below
                pass
            if h.done() and h.generation.finish_reason != "cancelled":
                _write_result(out, stats, it, h)
        out.close()
    if ordered and complete:
        sort_records(output_path)
    return prog.close({"interrupted": not complete, "output": output_path, "shard": f"{shard[0]}/{shard[1]}",
                       "torn_bytes_truncated": out.torn_bytes})


def _write_result(out: Output, stats: Stats, it: _Item, h) -> None:
    """The record of a finished request (a cancelled one is left for the next run)."""
    line = it.line
    try:
        pieces = list(h)
    except HybridInferError as e:
        rec = api_error_record(line.number, line.custom_id, from_engine(e), api_of(line.url))
    except Exception as e:  # noqa: BLE001 - a failed generation is that line's 500, as the server answers it
        rec = api_error_record(line.number, line.custom_id,
                               ApiError(500, f"generation failed: {type(e).__name__}: {e}"), api_of(line.url))
    else:
        g = h.generation
        if g.finish_reason == "cancelled":
            return
        parser, first = it.call.parser()
        body = it.call.answer(it.call.head(), parse_events(parser, first, pieces), it.request, g)
        out.write(ok_record(line.number, line.custom_id, body))
        stats.add("200", g)
        return
    out.write(rec)
    stats.add(str(rec["response"]["status_code"]))

"""The reading side of a batch job: input lines of this shard made into Requests (template, tokens: the slow part of
a line besides its generation), a window at a time, each window sorted so that shared prefixes run together
(order.py), with the error records of the lines that are no request."""

from __future__ import annotations

import hashlib
import queue
import threading
from dataclasses import dataclass

from ...errors import CapacityError, HybridInferError
from ..protocol.context import Context
from ..protocol.errors import ApiError, from_engine, unsupported
from .guard import BatchOutputError
from .inputfile import JobInput, TooLong
from .jobfile import (
    Line,
    LineError,
    api_error_record,
    api_of,
    line_error_record,
    make_call,
    read_line,
    shard_key,
    shard_of,
)
from .order import trie_order


@dataclass
class Item:
    line: Line
    call: object
    request: object
    written: bool = False


def failure_record(line: Line, e: BaseException) -> dict:
    """The record of a request that failed on its own (as the server answers it: its 4xx, or a 500 for a bug)."""
    if isinstance(e, ApiError):
        err = e
    elif isinstance(e, HybridInferError):
        err = from_engine(e)
    else:
        err = ApiError(500, f"internal error: {type(e).__name__}: {e}")
    return api_error_record(line.number, line.custom_id, err, api_of(line.url))


def _dup_key(custom_id: str):
    # long ids are kept as a digest: the map of seen ids is the one thing that grows with the input
    b = custom_id.encode("utf-8", "surrogatepass")
    return custom_id if len(b) <= 32 else hashlib.blake2b(b, digest_size=16).digest()


def _in_shard(number: int, raw, shard: tuple[int, int]) -> bool:
    i, n = shard
    if n == 1:
        return True
    key = f"line:{number}" if isinstance(raw, TooLong) else shard_key(number, raw)
    return shard_of(key, n) == i


def input_lines(inp: JobInput, shard: tuple[int, int], hasher=None):
    """(line number, bytes or TooLong) of the non-blank lines of this shard; `hasher` sees every byte."""
    for number, raw in inp.lines(hasher):
        if (isinstance(raw, TooLong) or raw.strip()) and _in_shard(number, raw, shard):
            yield number, raw


class Reader(threading.Thread):
    """Reads the input into sorted windows of Items and error records, put on `out` as (items, records); then None
    (the end) or the exception that stopped it. `done`: the lines answered before (output.Done)."""

    def __init__(self, ctx: Context, inp: JobInput, shard, done, window: int, stop: threading.Event):
        super().__init__(name="hybridinfer-batch-reader", daemon=True)
        self.ctx, self.inp, self.shard, self.done, self.window, self.stop = ctx, inp, shard, done, window, stop
        self.out: queue.Queue = queue.Queue(maxsize=1)  # one window read ahead of the one running
        self.seen: dict = {}  # custom_id -> the line that used it first

    def run(self) -> None:
        try:
            items, errors = [], []
            for number, raw in input_lines(self.inp, self.shard):
                if self.stop.is_set():
                    return
                got = self._line(number, raw)
                if got is None:
                    continue
                (items if isinstance(got, Item) else errors).append(got)
                if len(items) >= self.window or len(errors) >= self.window:
                    self._put(items, errors)
                    items, errors = [], []
            self._put(items, errors)
            self._send(None)
        except BaseException as e:  # noqa: BLE001 - the job's thread raises it
            self._send(e)

    def _answered(self, number: int, custom_id: str | None) -> bool:
        """Was this line answered before? Its record must then carry the line's custom_id, or none (the line was
        read then with a lower max_line_bytes: answered as too long)."""
        if number not in self.done:
            return False
        if not (self.done.matches(number, custom_id) or self.done.matches(number, None)):
            raise BatchOutputError(f"the output's record of input line {number} carries another custom_id than "
                                   f"that line's ({custom_id!r}): the output is not this input's; name another "
                                   f"output")
        return True

    def _line(self, number: int, raw):
        """An Item, an error record, or None (a line done before)."""
        if isinstance(raw, TooLong):
            err = LineError("line_too_long", f"line {number} is {raw.nbytes} bytes long, over the limit of "
                                             f"{self.inp.max_line_bytes} bytes a line (max_line_bytes)")
            return None if self._answered(number, None) else line_error_record(number, err)
        try:
            line = read_line(number, raw, self.ctx.model_name)
        except LineError as e:
            if e.custom_id is not None:  # a custom_id is taken by any line that carries it, answered or refused
                self.seen.setdefault(_dup_key(e.custom_id), number)
            return None if self._answered(number, e.custom_id) else line_error_record(number, e)
        first = self.seen.setdefault(_dup_key(line.custom_id), number)
        if self._answered(number, line.custom_id):
            return None
        if first != number:
            return line_error_record(number, LineError("duplicate_custom_id", f"line {number}: custom_id "
                                                       f"{line.custom_id!r} is used by line {first} already",
                                                       line.custom_id))
        try:
            call = make_call(self.ctx, line)
            if getattr(call, "n", 1) != 1:  # the server's n choices are several sequences; a batch line is one
                raise unsupported("n", call.n)
            req = call.build()
            sched = self.ctx.engine.scheduler
            need = sched.request_bytes(req)
            if sched.state_budget is not None and need > sched.state_budget:
                raise CapacityError(f"a request of {len(req.ids)} prompt tokens + max_tokens {req.max_tokens} needs "
                                    f"{need} bytes of state, more than the state budget of {sched.state_budget} "
                                    f"bytes")
        except Exception as e:  # noqa: BLE001 - a bad body, or a bug in one request: its line alone fails
            return failure_record(line, e)
        return Item(line, call, req)

    def _put(self, items: list[Item], errors: list[dict]) -> None:
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

"""The output file of a batch job: append-only, one whole line per result, resumable.

Each record is one `write` of one whole line to a file opened O_APPEND, so a process killed at any point leaves
every earlier line whole and at most a torn last line (and a machine that loses power, unsynced lines: `sync_every`
bounds how many). Opening an existing output finds the last line that is a record of this job, truncates what
follows it (the torn end) and reports which input lines are done; a line that is no record before that is not a
torn end but another file, and is refused rather than truncated."""

from __future__ import annotations

import json
import os
from array import array

from ...engine.fsutil import fsync_dir
from ...errors import ParameterError
from .jobfile import dumps, line_number


class LineSet:
    """A set of line numbers as a bitmap (an eighth of a byte a line, so a job of millions of lines stays small)."""

    def __init__(self):
        self._bits = bytearray()
        self.count = 0

    def add(self, n: int) -> None:
        i, b = divmod(n, 8)
        if i >= len(self._bits):
            self._bits.extend(bytes(max(i + 1 - len(self._bits), len(self._bits))))
        if not self._bits[i] >> b & 1:
            self._bits[i] |= 1 << b
            self.count += 1

    def __contains__(self, n: int) -> bool:
        i, b = divmod(n, 8)
        return i < len(self._bits) and bool(self._bits[i] >> b & 1)

    def __len__(self) -> int:
        return self.count


def scan(path: str) -> tuple[LineSet, int, int]:
    """(input lines done, byte length of the whole records, bytes after them: a torn end) of an output file."""
    done, good_end, pos = LineSet(), 0, 0
    bad_at = None  # the first line that is no record (it must be part of the torn end)
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            end = pos + len(raw)
            rec = None
            if raw.endswith(b"\n"):
                try:
                    rec = json.loads(raw)
                except (ValueError, RecursionError):
                    rec = None
            num = line_number(rec) if isinstance(rec, dict) else None
            if num is None:
                bad_at = bad_at or n
            else:
                if bad_at is not None:
                    raise ParameterError(f"the output {path!r} has a line that is no batch record (line {bad_at}) "
                                         f"before others that are: it is not the output of a batch job, or it was "
                                         f"edited; name another output file")
                done.add(num)
                good_end = end
            pos = end
    return done, good_end, pos - good_end


class Output:
    """Appends records to `path` (made if missing); `done` holds the input lines it already answers. `sync_every`:
    fsync after that many records (0: only at close)."""

    def __init__(self, path: str, sync_every: int = 100):
        self.path, self.sync_every = path, sync_every
        self.torn_bytes = 0
        if os.path.exists(path):
            self.done, good, self.torn_bytes = scan(path)
            if self.torn_bytes:
                os.truncate(path, good)  # a torn last line from a crash: its request runs again
        else:
            self.done = LineSet()
        self.done_before = len(self.done)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self.done_before == 0:
            # the file's name survives a crash too, not only its contents
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        self._unsynced = 0

    def write(self, record: dict) -> None:
        data = memoryview(dumps(record))
        while data:  # a regular file takes it whole; a short write (disk full) goes on where it stopped
            n = os.write(self._fd, data)
            data = data[n:]
        num = line_number(record)
        if num is not None:
            self.done.add(num)
        self._unsynced += 1
        if self.sync_every and self._unsynced >= self.sync_every:
            self.sync()

    def sync(self) -> None:
        if self._unsynced:
            os.fsync(self._fd)
            self._unsynced = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


def sort_records(path: str, out_path: str | None = None) -> None:
    """Rewrite an output file in input-line order (atomically: a temporary file renamed over it). Holds three
    numbers per line, not the lines."""
    keys, starts, lens = array("q"), array("q"), array("q")
    with open(path, "rb") as f:
        pos = 0
        for raw in f:
            keys.append(line_number(json.loads(raw)) or 0)
            starts.append(pos)
            lens.append(len(raw))
            pos += len(raw)
    order = sorted(range(len(keys)), key=keys.__getitem__)
    dst = out_path or path
    tmp = dst + ".sorting"
    with open(path, "rb") as src, open(tmp, "wb") as out:
        for i in order:
            src.seek(starts[i])
            out.write(src.read(lens[i]))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))

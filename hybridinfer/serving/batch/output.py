"""The output file of a batch job: append-only, one whole line per result, resumable.

Each record is one `write` of one whole line to a file opened O_APPEND, so a process killed at any point leaves
every earlier line whole and at most a torn last line (and a machine that loses power, unsynced lines: `sync_every`
bounds how many). Opening an existing output finds the last line that is a record of this job, truncates what
follows it (the torn end) and reports which input lines are done; a line that is no record before that is not a
torn end but another file, and is refused rather than truncated."""

from __future__ import annotations

import errno
import json
import os
import zlib
from array import array

from ...engine.fsutil import fsync_dir
from .guard import BatchOutputError
from .jobfile import dumps, line_number


def id_tag(custom_id: str | None) -> int:
    """A 32-bit tag of a custom_id (odd), or 2 for a record without one: what a resumed job checks each answered
    line's custom_id against (a tag, not the id, so that memory stays 4 bytes a line)."""
    if custom_id is None:
        return 2
    return zlib.crc32(custom_id.encode("utf-8", "surrogatepass")) | 1


class Done:
    """The input lines an output answers, each with the tag of the custom_id its record carries."""

    def __init__(self):
        self._tags = array("I")
        self.count = 0

    def add(self, n: int, custom_id: str | None) -> None:
        if n >= len(self._tags):  # grown by doubling
            self._tags.frombytes(bytes(self._tags.itemsize * max(n + 1 - len(self._tags), len(self._tags))))
        if not self._tags[n]:
            self.count += 1
        self._tags[n] = id_tag(custom_id)

    def __contains__(self, n: int) -> bool:
        return 0 <= n < len(self._tags) and self._tags[n] != 0

    def matches(self, n: int, custom_id: str | None) -> bool:
        """Does the record of line n carry this custom_id?"""
        return n in self and self._tags[n] == id_tag(custom_id)

    def __len__(self) -> int:
        return self.count


def scan(path: str) -> tuple[Done, int, int]:
    """(input lines done, byte length of the whole records, bytes after them: a torn end) of an output file."""
    done, good_end, pos = Done(), 0, 0
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
                    raise BatchOutputError(f"the output {path!r} has a line that is no batch record (line {bad_at}) "
                                           f"before others that are: it is not the output of a batch job, or it "
                                           f"was edited; name another output file")
                done.add(num, rec.get("custom_id") if isinstance(rec.get("custom_id"), str) else None)
                good_end = end
            pos = end
    return done, good_end, pos - good_end


class Output:
    """Appends records to `path` (made if missing); `done` holds the input lines it already answers. `sync_every`:
    fsync after that many records (0: only at close). Call it holding the output's lock (guard.py), once the
    output is known to be this job's. A write that fails (a full disk) takes back what it wrote of its line and
    raises BatchOutputError naming the line."""

    def __init__(self, path: str, sync_every: int = 100):
        self.path, self.sync_every = path, sync_every
        self.torn_bytes = 0
        if os.path.exists(path):
            self.done, good, self.torn_bytes = scan(path)
            if self.torn_bytes:
                os.truncate(path, good)  # a torn last line from a crash: its request runs again
        else:
            self.done = Done()
        self.done_before = len(self.done)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size  # the end of the last whole record
        if self.done_before == 0:
            # the file's name survives a crash too, not only its contents
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        self._unsynced = 0
        self.failed = False  # a write failed: the job is stopping and writes nothing more

    def write(self, record: dict) -> None:
        num = line_number(record)
        data = dumps(record)
        view = memoryview(data)
        try:
            while view:  # a regular file takes it whole; a short write goes on where it stopped
                n = os.write(self._fd, view)
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                view = view[n:]
        except OSError as e:
            self._fail(f"writing the answer to input line {num}", e)
        self._size += len(data)
        if num is not None:
            cid = record.get("custom_id")
            self.done.add(num, cid if isinstance(cid, str) else None)
        self._unsynced += 1
        if self.sync_every and self._unsynced >= self.sync_every:
            self.sync(num)

    def _fail(self, what: str, e: OSError):
        self.failed = True
        try:  # the part of the line that was written goes (a resumed job would drop it as a torn end anyway)
            os.ftruncate(self._fd, self._size)
        except OSError:
            pass
        raise BatchOutputError(f"{what} to the batch output {self.path!r} failed: {e.strerror or e}; the job "
                               f"stopped (run it again to go on once that is fixed)") from e

    def sync(self, num: int | None = None) -> None:
        if self._unsynced:
            try:
                os.fsync(self._fd)
            except OSError as e:
                self._fail(f"syncing the answers up to input line {num}" if num else "syncing the answers", e)
            self._unsynced = 0

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.fsync(fd)
            except OSError as e:
                raise BatchOutputError(f"syncing the batch output {self.path!r} failed: {e.strerror or e}") from e
            finally:
                os.close(fd)


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

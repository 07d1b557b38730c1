"""The input of a batch job: read in lines of bounded length, hashed, and readable twice even from a pipe.

A job reads its input twice: once to count and hash it (the hash is what names the job's output, guard.py), once
to run it. A regular file is opened again for the second pass; a pipe (`/dev/stdin`, `<(cat job.jsonl)`) can be
read only once, so its bytes are copied into an unnamed temporary file beside the output as they are read, and the
second pass reads the copy. Anything else (a terminal, a device) is refused: `/dev/zero` would never end.

No line is held whole beyond `max_line_bytes`: a longer line is read on in chunks only to find its end and is
answered with an error line naming its length and the limit, before any JSON parsing (a 10 MB line once cost
1.7 GB of memory on its way to being refused)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass

from ...errors import ParameterError

MIN_LINE_BYTES = 1 << 20  # the default limit never goes under this
LINE_BYTES_PER_TOKEN = 64  # room for a context's worth of tokens as escaped JSON text, with its markup
_CHUNK = 1 << 20


def default_max_line_bytes(n_ctx: int) -> int:
    """The default bound on an input line: enough for a prompt that fills the context, written as JSON with
    escapes (a token is some 4 characters of text, 6 bytes per character as \\uXXXX), and no less than 1 MiB."""
    return max(MIN_LINE_BYTES, LINE_BYTES_PER_TOKEN * n_ctx)


@dataclass(frozen=True)
class TooLong:
    """A line over the limit, in place of its bytes: how long it was."""

    nbytes: int


def bounded_lines(f, limit: int, hasher=None):
    """(line number, bytes or TooLong) of each line of the binary file `f`, holding at most `limit` + 1 bytes of a
    line (`limit` counts a line's bytes without its newline); `hasher` (a hashlib object) is fed every byte read."""
    number = 0
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        if hasher is not None:
            hasher.update(raw)
        number += 1
        if raw.endswith(b"\n") or len(raw) <= limit:
            yield number, raw
            continue
        nbytes = len(raw)
        while not raw.endswith(b"\n"):  # the rest of the long line, read and dropped
            raw = f.readline(_CHUNK)
            if not raw:
                break
            if hasher is not None:
                hasher.update(raw)
            nbytes += len(raw)
        yield number, TooLong(nbytes - raw.endswith(b"\n"))


class JobInput:
    """The input file at `path` (a regular file or a pipe; a pipe is copied into a temporary file in `spool_dir`
    as it is read). `lines()` once per pass; passes run one after another."""

    def __init__(self, path: str, max_line_bytes: int, spool_dir: str | None = None):
        if type(max_line_bytes) is not int or max_line_bytes < 1:
            raise ParameterError(f"max_line_bytes must be a whole number >= 1, got {max_line_bytes!r}")
        self.path, self.max_line_bytes, self.spool_dir = path, max_line_bytes, spool_dir
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            raise ParameterError(f"the batch input {path!r} is neither a file nor a pipe; name a JSONL file")
        self.is_pipe = not stat.S_ISREG(mode)
        self._spool = None

    def _load(self) -> None:
        """A pipe's bytes, read once into the spool."""
        self._spool = tempfile.TemporaryFile(dir=self.spool_dir)
        with open(self.path, "rb") as src:
            shutil.copyfileobj(src, self._spool, _CHUNK)
        self._spool.flush()

    def open(self):
        """A binary file object at the start of the input; close it after use. For a pipe, one reader at a time."""
        if not self.is_pipe:
            return open(self.path, "rb")
        if self._spool is None:
            self._load()
        f = os.fdopen(os.dup(self._spool.fileno()), "rb")  # shares the spool's offset: passes run one at a time
        f.seek(0)
        return f

    def lines(self, hasher=None):
        """(line number, bytes or TooLong) of every line, in one pass."""
        with self.open() as f:
            yield from bounded_lines(f, self.max_line_bytes, hasher)

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None

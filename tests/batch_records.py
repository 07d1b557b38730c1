"""Helpers of the batch tests: a job's input file from its lines, its output file as {record id: record}, failing on
any id written twice (no line may be doubled), and an `os` for output.py whose disk fills up."""

from __future__ import annotations

import errno
import json
import os


def write_job(path, lines) -> None:
    """A job file: each line a dict (written as JSON) or a str (written as it is: malformed lines)."""
    with open(path, "w") as f:
        for ln in lines:
            f.write((ln if isinstance(ln, str) else json.dumps(ln)) + "\n")


def records(path) -> dict[str, dict]:
    out = {}
    with open(path, "rb") as f:
        for raw in f:
            r = json.loads(raw)
            assert r["id"] not in out, f"{r['id']} written twice"
            out[r["id"]] = r
    return out


class FullDisk:
    """os for output.py whose writes fail (ENOSPC) after `ok` of them; short_last: the last one that succeeds writes
    only half its bytes (a short write, then the disk is full)."""

    def __init__(self, ok: int, short_last: bool = False):
        self.ok, self.short_last = ok, short_last

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        if self.ok <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.ok -= 1
        if self.short_last and self.ok == 0:
            return os.write(fd, bytes(data[: len(data) // 2]))
        return os.write(fd, data)

"""Opening the files a user names (a model, a chat template, a cache entry): regular files only, so that a FIFO
with no writer cannot hang its reader and a device (/dev/zero) cannot feed it without end."""

from __future__ import annotations

import os
import stat

from ..errors import NotRegularFileError, ParameterError


def describe_mode(mode: int) -> str:
    """What a file of this st_mode is, in words ("a FIFO")."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return f"mode {mode:#o}"


def check_regular(path: str, mode: int, what: str) -> None:
    """NotRegularFileError naming `what` and `path` unless `mode` is a regular file's."""
    if not stat.S_ISREG(mode):
        kind = describe_mode(mode)
        raise NotRegularFileError(f"{what} {path!r} is {kind}, not a regular file", kind)


def open_regular(path: str, what: str = "file"):
    """`path` opened for reading as a binary file object if it is a regular file; NotRegularFileError naming it
    otherwise, OSError when it cannot be opened. The name is checked first, so a device is not even opened (opening
    some has side effects); then it is opened with O_NONBLOCK, so that a FIFO put in its place meanwhile cannot wait
    for a writer, and the opened file is checked with fstat, the check that counts."""
    check_regular(path, os.stat(path).st_mode, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        check_regular(path, os.fstat(fd).st_mode, what)
        os.set_blocking(fd, True)  # a regular file ignores the flag; cleared so the file object reads as any other
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: str, what: str, max_bytes: int) -> str:
    """A regular file of at most `max_bytes` as UTF-8 text; ParameterError naming `what` and `path` when it cannot
    be opened, is larger or is not UTF-8 (never more than max_bytes + 1 bytes are read, even of a file that grows
    meanwhile)."""
    try:
        f = open_regular(path, what)
    except OSError as e:
        raise ParameterError(f"{what} {path!r}: {e.strerror or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
    if size > max_bytes or len(data) > max_bytes:
        raise ParameterError(f"{what} {path!r} is over the limit of {max_bytes} bytes ({max(size, len(data))} bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParameterError(f"{what} {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None

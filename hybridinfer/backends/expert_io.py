"""Byte ranges of a model file read into numpy buffers by a small pool of threads, with the checks a file read while
the model runs needs: the CPU's expert store (cpu/expert_store.py) and the GPU prefill's disk staging
(gpu/disk_stage.py) both read routed experts through an ExpertReader.

Reads are plain `os.pread` (through the page cache), or with `io="direct"` through `O_DIRECT` into aligned per-thread
buffers. Bad conditions are typed errors naming the file and the byte range (ExpertReadError): a short read (the file
was truncated), a file whose size or modification time changed or whose name now points at another file, a failed
read, or a read not done within `timeout` seconds.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import numpy as np

from ..errors import ExpertReadError, ParameterError

IO_MODES = ("pread", "direct")
DIRECT_ALIGN = 4096  # O_DIRECT: offset, length and buffer address aligned to this


def aligned_span(offset: int, nbytes: int, align: int = DIRECT_ALIGN) -> tuple[int, int, int]:
    """An O_DIRECT read of [offset, offset + nbytes): (aligned start, aligned length, where the range begins in
    what is read)."""
    a0 = offset // align * align
    a1 = -(-(offset + nbytes) // align) * align
    return a0, a1 - a0, offset - a0


class ExpertReader:
    """A pool of threads reading byte ranges of one file into numpy buffers (os.pread; O_DIRECT with `io`
    "direct"). `drop_cache`: each range read is dropped from the page cache after (posix_fadvise DONTNEED), so a
    benchmark's reads come from the disk."""

    def __init__(self, path: str, io: str = "pread", threads: int = 4, timeout: float = 30.0,
                 drop_cache: bool = False, max_range: int = 0):
        if io not in IO_MODES:
            raise ParameterError(f"expert_io must be one of {', '.join(IO_MODES)}, got {io!r}")
        if not timeout > 0:
            raise ParameterError(f"read_timeout must be more than 0 seconds, got {timeout!r}")
        self.path, self.io, self.timeout, self.drop_cache = path, io, float(timeout), bool(drop_cache)
        self.fd = os.open(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.dfd = None
        if io == "direct":
            if not hasattr(os, "O_DIRECT"):
                raise ParameterError("expert_io='direct': this system has no O_DIRECT")
            try:
                self.dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                raise ParameterError(f"expert_io='direct': {path!r} cannot be opened with O_DIRECT ({e.strerror}); "
                                     "use expert_io='pread'") from None
        self.bounce_bytes = (max_range + 2 * DIRECT_ALIGN) if io == "direct" else 0  # per thread
        self.threads = int(threads)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hybridinfer-expert-read")
        self._local = threading.local()
        self.bytes_read = 0  # counted on the caller's thread when a read is issued
        self.reads = 0

    def check(self, where: str) -> None:
        """The file is still the one loaded: same size and modification time, and its name still points at it."""
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) != self.ident[2:]:
            raise ExpertReadError(f"{self.path!r} changed while the model runs (size {self.ident[2]} -> "
                                  f"{st.st_size} B or modified) before reading {where}")
        try:
            sp = os.stat(self.path)
        except OSError as e:
            raise ExpertReadError(f"{self.path!r} is gone ({e.strerror}: moved or deleted) before reading "
                                  f"{where}") from None
        if (sp.st_dev, sp.st_ino) != self.ident[:2]:
            raise ExpertReadError(f"{self.path!r} was replaced by another file before reading {where}")

    def submit(self, dst: np.ndarray, offset: int, after=None):
        """Read len(dst) bytes at `offset` into dst on a pool thread, then after(dst) there; a Future."""
        self.bytes_read += dst.nbytes
        self.reads += 1
        return self.pool.submit(self._read, dst, int(offset), after)

    def _read(self, dst: np.ndarray, offset: int, after) -> None:
        n = dst.nbytes
        what = f"bytes {offset}..{offset + n}"
        try:
            if self.dfd is None:
                self._pread(self.fd, dst, offset, what)
            else:
                a0, alen, skip = aligned_span(offset, n)
                buf = self._bounce(alen)
                got = self._pread(self.dfd, buf[:alen], a0, what, short_ok=True)
                if got < skip + n:
                    raise ExpertReadError(f"{self.path!r}: {what}: the file ends at byte {a0 + got} (truncated)")
                np.copyto(dst, buf[skip : skip + n])
            if self.drop_cache:
                os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise ExpertReadError(f"{self.path!r}: reading {what} failed: {e.strerror or e}") from None
        if after is not None:
            after(dst)

    def _pread(self, fd: int, dst: np.ndarray, offset: int, what: str, short_ok: bool = False) -> int:
        view, done = memoryview(dst).cast("B"), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                if short_ok:
                    return done
                raise ExpertReadError(f"{self.path!r}: {what}: the file ends at byte {offset + done} (truncated)")
            done += got
        return done

    def _bounce(self, n: int) -> np.ndarray:
        b = getattr(self._local, "buf", None)
        if b is None or b.nbytes < n:
            m = mmap.mmap(-1, max(n, self.bounce_bytes))  # page-aligned, as O_DIRECT wants
            b = self._local.buf = np.frombuffer(m, np.uint8)
        return b

    def wait(self, futs, where: str) -> None:
        """Every future done within the timeout, else ExpertReadError; a read's own error raised as it is."""
        if not futs:
            return
        done, left = wait_futures(futs, timeout=self.timeout)
        if left:
            raise ExpertReadError(f"{self.path!r}: reading {where} did not finish within {self.timeout:g} s")
        for f in futs:
            e = f.exception()
            if e is not None:
                raise e

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for fd in (self.fd, self.dfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.dfd = None

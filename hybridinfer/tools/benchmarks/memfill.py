"""A host-wide stand-in for a memory limit, for `bench disk --llama-fill-memory` where no cgroup can be made (no
writable cgroup v2, systemd-run refused): anonymous memory is taken and touched until the host's MemAvailable is
about the limit. Without swap the kernel cannot move those pages out, so whatever runs beside the fill (llama-bench,
and the page cache it reads the model through) has only what is left; where the host has swap the pages are also
locked (mlock), and the fill says whether that was allowed. Everything on the host shares what is left: run nothing
else beside it, and never in a test suite's process on a shared machine with a limit far below what is free."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

CHUNK = 1 << 30
PAGE = mmap.PAGESIZE


def meminfo() -> dict[str, int]:
    """/proc/meminfo's fields in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            parts = rest.split()
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


class MemoryFill:
    """Take memory until MemAvailable is about `limit` bytes (within one chunk's re-check; never below it by more
    than a page per chunk). `taken` is what it holds, `locked` whether the pages are locked, `how` one line for a
    table. release() gives it back; a context manager too."""

    def __init__(self, limit: int, chunk: int = CHUNK):
        if not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"memory fill: the limit must be a positive number of bytes, got {limit!r}")
        self.limit, self.maps, self.taken = limit, [], 0
        swap = meminfo().get("SwapTotal", 0) > 0
        self.locked = False
        libc = ctypes.CDLL(None, use_errno=True) if swap else None
        while True:
            excess = meminfo()["MemAvailable"] - limit
            n = min(chunk, excess // PAGE * PAGE)
            if n < PAGE:
                break
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
            np.frombuffer(m, np.uint8)[::PAGE] = 1  # touched: MAP_POPULATE is a hint some kernels skip
            if libc is not None:
                buf = (ctypes.c_char * n).from_buffer(m)
                self.locked = libc.mlock(ctypes.addressof(buf), ctypes.c_size_t(n)) == 0
                del buf
            self.maps.append(m)
            self.taken += n
        self.left = left = meminfo()["MemAvailable"]
        self.how = (f"host memory filled: {self.taken} B taken, {left} B left available for a limit of {limit} B"
                    + (" (swap present: pages locked)" if self.locked else " (swap present, pages NOT locked)"
                       if swap else " (no swap)"))

    def release(self) -> None:
        for m in self.maps:
            m.close()
        self.maps, self.taken = [], 0

    def __enter__(self) -> MemoryFill:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class FillProcess:
    """A MemoryFill held by a child process that asks the kernel's OOM killer to spare it (oom_score_adj -1000,
    where allowed): when the command under the limit outgrows it, the command is killed, not the fill nor the
    benchmark that started it. `how` is the child's line; release() ends it."""

    def __init__(self, limit: int):
        import subprocess
        import sys

        self.p = subprocess.Popen([sys.executable, "-m", __name__, str(int(limit))], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.how = self.p.stdout.readline().strip() or f"memory fill failed (exit {self.p.wait()})"

    def release(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            self.p.wait(timeout=60)


def _spared() -> bool:
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
        return True
    except OSError:
        return False


if __name__ == "__main__":
    import sys

    spared = _spared()
    fill = MemoryFill(int(sys.argv[1]))
    print(fill.how + ("; the fill spared by the OOM killer" if spared else "; the fill NOT spared by the OOM killer"),
          flush=True)
    sys.stdin.read()  # held until the parent closes our stdin
    fill.release()

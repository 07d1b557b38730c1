"""Where the CPU backend reads its weight matrices from: the GGUF's memory mapping, or one anonymous copy.

Decode reads every active weight byte once per token, so it runs at the memory's streaming rate only if the
hardware prefetchers and the TLB keep up. A file mapping is made of 4 KiB page-cache pages scattered over
physical memory: the prefetchers stop at every page boundary and each page costs a TLB miss. The expert
matrices of a MoE model, touched a few hundred KiB at a time, suffer most (measured on a 16-core Xeon with a
35B-A3B Q4_K_M: the experts' gate/up products ran at 72 GB/s from the mapping and 88 GB/s from a copy).
A copy into one anonymous mapping advised for transparent huge pages (2 MiB) avoids both, at the price of
reading the file once at load and holding the weights in process memory.
"""

from __future__ import annotations

import mmap
from dataclasses import replace

import numpy as np

WEIGHTS_MODES = ("auto", "copy", "mmap")
_HUGE = 2 << 20  # a transparent huge page
_ALIGN = 64  # every matrix starts on a cache line


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (free memory plus reclaimable caches), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def choose_weights_mode(mode: str, nbytes: int, available: int | None) -> str:
    """'copy' or 'mmap' for `mode` (one of WEIGHTS_MODES) and weights of `nbytes`. 'auto' copies when the
    weights take at most half the available memory (the rest stays for the page cache, the KV cache and
    the prefix cache), and maps the file when the available memory is unknown."""
    if mode not in WEIGHTS_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    if available is None:
        return "mmap"
    return "copy" if 2 * int(nbytes) <= int(available) else "mmap"


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of nbytes in its own anonymous mapping, aligned to 2 MiB and advised for
    huge pages where the kernel offers them (transparent huge pages in 'always' or 'madvise' mode)."""
    nbytes = int(nbytes)
    if nbytes < 1:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    m = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, np.uint8)
    start = (-whole.ctypes.data) % _HUGE
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE, start, (nbytes // _HUGE) * _HUGE or nbytes)
        except OSError:  # a kernel without transparent huge pages: plain pages
            pass
    return whole[start : start + nbytes]


def copy_mats(owners: list[tuple[dict, str]], repack=None, progress: bool = False) -> int:
    """Replace the Mat at owner[key], for every pair, by one whose bytes live in a single shared huge-page buffer
    (the same bytes; the file mapping is no longer read). Returns the buffer's size.
    repack: None, or `SimdLib.repack`: each copy is then repacked for the unit that reads it (the Mat takes
    the qtype it returns). progress: a tqdm bar of the bytes copied on stderr (a large model's copy reads the whole
    file: minutes from a cold disk)."""
    mats = [o[k] for o, k in owners]
    sizes = [(m.raw.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN for m in mats]
    if not mats:
        return 0
    buf = huge_page_buffer(sum(sizes))
    off = 0
    from tqdm import tqdm

    with tqdm(total=sum(m.raw.nbytes for m in mats), unit="B", unit_scale=True, unit_divisor=1024, leave=False,
              desc="copying weights" if repack is None else "copying and repacking weights",
              disable=not progress) as bar:
        for (o, k), m, n in zip(owners, mats, sizes, strict=True):
            dst = buf[off : off + m.raw.nbytes]
            np.copyto(dst, m.raw)
            o[k] = replace(m, raw=dst, qtype=m.qtype if repack is None else repack(dst, m.qtype))
            off += n
            bar.update(m.raw.nbytes)
    return buf.nbytes


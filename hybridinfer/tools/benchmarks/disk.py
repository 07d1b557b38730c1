"""`hybridinfer bench disk`: decode tok/s under several RAM budgets, the routed experts read from the file.

For each budget and read mode (pread through the page cache with every range dropped from it after the read, so the
bytes come from the disk; or O_DIRECT), a greedy decode is timed after the file's pages are dropped
(posix_fadvise DONTNEED), and the expert store's counters give the bytes read from the disk per token and the cache's
hit rate. The disk's read bandwidth is probed on the file itself (sequential 8 MiB reads, and random reads of one
expert's range from several threads as decode issues them), so floor = bytes per token / random-read bandwidth
is the least time a token can take from this disk, and the fraction reached is that over the time taken.
The peak resident memory of the process (interpreter, work buffers and states included) is reported for the timed
steps, and separately for the load (which reads the resident part through the file's mapping before copying it).
llama.cpp's llama-bench runs on the same file under the same memory limit: the peak this engine's process took at
that budget (a cgroup v2 memory.max, or systemd-run's MemoryMax, where one can be set, else with --llama-fill-memory
the host's memory filled until that much is left: memfill.py; the table says how it was limited), its page cache
counted against it.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import random
import resource
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SEQ_CHUNK = 8 << 20


def _drop(path: str) -> None:
    """The file's pages out of the page cache (where the system lets us)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _open(path: str) -> tuple[int, bool]:
    """A descriptor reading past the page cache: O_DIRECT where the file system takes it, else a plain one after
    the file's pages are dropped."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except (OSError, AttributeError):
        _drop(path)
        return os.open(path, os.O_RDONLY), False


def probe_disk(path: str, seq_bytes: int = 1 << 30, rand_bytes: int = 1 << 20, rand_reads: int = 512,
               threads: int = 8, seed: int = 0) -> dict:
    """Read bandwidth of the file's disk in bytes/s: sequential (SEQ_CHUNK reads over up to seq_bytes) and random
    (rand_reads reads of rand_bytes at aligned random offsets, on `threads` threads), past the page cache."""
    size = os.path.getsize(path)
    fd, direct = _open(path)
    buf = np.frombuffer(mmap.mmap(-1, SEQ_CHUNK), np.uint8)
    try:
        n = min(size, int(seq_bytes)) // 4096 * 4096
        t0, done = time.perf_counter(), 0
        while done < n:
            got = os.preadv(fd, [memoryview(buf)[: min(SEQ_CHUNK, n - done)]], done)
            if got <= 0:
                break
            done += got
        seq = done / max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
    span = max(4096, -(-int(rand_bytes) // 4096) * 4096)
    rng = random.Random(seed)
    offs = [rng.randrange(0, max(1, size - span)) // 4096 * 4096 for _ in range(int(rand_reads))]
    if not direct:
        _drop(path)
    fd, _ = _open(path)

    def one(off: int) -> int:
        b = _local_buf(span)
        return os.preadv(fd, [memoryview(b)[:span]], off)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(one, offs))
        rand = got / max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
    return {"seq_bytes_s": seq, "rand_bytes_s": rand, "rand_read_bytes": span, "direct": direct,
            "threads": threads}


_bufs: dict = {}


def _local_buf(n: int) -> np.ndarray:
    import threading

    key = (threading.get_ident(), n)
    if key not in _bufs:
        _bufs[key] = np.frombuffer(mmap.mmap(-1, n), np.uint8)  # page-aligned for O_DIRECT
    return _bufs[key]


def memory_limited(cmd: list[str], limit: int, fill: bool = False) -> tuple[list[str], str, object]:
    """cmd run under a memory limit of `limit` bytes: (command, how it is limited, cleanup). A child of this
    process's cgroup v2 with memory.max where it is writable, else systemd-run --scope -p MemoryMax (as root, or
    --user), else with `fill` the host's memory filled until about `limit` is left (memfill.py: host-wide; cleanup
    gives it back), else the command as it is and the reason."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        cg = os.path.join("/sys/fs/cgroup", rel.lstrip("/"), f"hybridinfer-bench-{os.getpid()}")
        os.makedirs(cg, exist_ok=True)
        with open(os.path.join(cg, "memory.max"), "w") as f:
            f.write(str(int(limit)))
        wrapped = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cg, *cmd]
        return wrapped, f"cgroup v2 memory.max={limit}", lambda: _rmdir(cg)
    except (OSError, StopIteration):
        pass
    exe = shutil.which("systemd-run")
    if exe:
        for user in ([], ["--user"]):
            probe = [exe, *user, "--scope", "--quiet", "-p", f"MemoryMax={int(limit)}", "true"]
            try:
                if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
                    return ([*probe[:-1], *cmd], f"systemd-run {' '.join(user)} --scope MemoryMax={limit}".replace(
                        "  ", " "), lambda: None)
            except (OSError, subprocess.TimeoutExpired):
                continue
    if fill:
        from .memfill import FillProcess

        f = FillProcess(int(limit))
        return cmd, f"no cgroup (none writable, systemd-run refused): {f.how}", f.release
    return cmd, "could not be limited (no writable cgroup v2, systemd-run refused)", lambda: None


def _rmdir(cg: str) -> None:
    try:
        os.rmdir(cg)
    except OSError:
        pass


def llama_bench_limited(exe: str, path: str, threads: int, n_tokens: int, limit: int, timeout: float = 180.0,
                        fill: bool = False) -> dict:
    """llama-bench's decode tok/s on the file under a memory limit of `limit` bytes (its default mmap: the page
    cache it reads through counts against the limit). A run past `timeout` seconds (a file paging through a small
    limit can take hours) is stopped: its speed is then below n_tokens / timeout (`tok_s_below`)."""
    # --repack 0: the weights stay in the file's mapping (repacked, llama.cpp copies the whole model into anonymous
    # memory, which no limit below the model's size holds)
    cmd = [exe, "-m", path, "-p", "0", "-n", str(n_tokens), "-t", str(threads), "-o", "json", "-r", "1",
           "--repack", "0"]
    _drop(path)
    cmd, how, cleanup = memory_limited(cmd, limit, fill)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"limit": how, "tok_s": None, "tok_s_below": n_tokens / timeout,
                "error": f"stopped after {timeout:.0f} s (below {n_tokens / timeout:.3f} tok/s)"}
    finally:
        cleanup()
    out = {"limit": how, "tok_s": None}
    if r.returncode == -9:
        out["error"] = "killed by signal 9 (the OOM killer: it outgrew the limit)"
        return out
    if r.returncode != 0:
        out["error"] = f"exit {r.returncode}: {r.stderr.strip()[-300:]}"
        return out
    try:
        out["tok_s"] = float(json.loads(r.stdout)[-1]["avg_ts"])
    except (ValueError, KeyError, IndexError):
        out["error"] = "no result in its output"
    return out


def measure(path: str, budget: int, io: str, threads: int, n_tokens: int, context: int, drop: bool = True,
            seed: int = 0) -> dict:
    """One budget and read mode: greedy decode timed after a warm-up, the expert counters over the timed steps."""
    from ...engine.api import Engine
    from .decode import greedy_steps

    _reset_peak()
    eng = Engine.load(path, backend="cpu", n_threads=threads, n_ctx=context + n_tokens + 32, spec_type="none",
                      ram_budget=budget, expert_io=io, drop_cache=drop and io == "pread")
    try:
        load_peak = _peak_rss()
        _reset_peak()
        be = eng.backend
        plan, store = be.ram_plan, be.experts
        rng = np.random.default_rng(seed)
        ids = [int(x) for x in rng.integers(0, min(eng.args.n_vocab, 32000), max(context, 1))]
        st = eng.new_state()
        t = int(np.argmax(eng.prefill(ids, st)[-1]))
        t, _ = greedy_steps(be, st, t, 2)  # warm-up (numba, the recorded step)
        if drop:
            _drop(path)
        s0 = store.stats() if store else None
        t, secs = greedy_steps(be, st, t, n_tokens)
        s1 = store.stats() if store else None
        row = {"budget": budget, "io": io, "tok_s": n_tokens / secs, "resident_bytes": plan.resident_bytes,
               "on_disk": plan.on_disk, "summary": plan.summary(),
               "peak_rss_bytes": _peak_rss(), "load_peak_rss_bytes": load_peak}
        if s0 is not None:
            hits, misses = s1["hits"] - s0["hits"], s1["misses"] - s0["misses"]
            row.update(bytes_per_token=(s1["bytes_read"] - s0["bytes_read"]) / n_tokens,
                       hit_rate=hits / max(1, hits + misses), wait_s_per_token=(s1["wait_s"] - s0["wait_s"]) / n_tokens,
                       prefetch_hits=s1["prefetch_hits"] - s0["prefetch_hits"])
        else:
            row.update(bytes_per_token=0.0, hit_rate=1.0, wait_s_per_token=0.0, prefetch_hits=0)
        return row
    finally:
        eng.close()
        del eng
        gc.collect()  # the next budget's peak starts without this one's buffers


def _reset_peak() -> None:
    """Start this process's peak resident memory (VmHWM) afresh, where Linux lets us (/proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM since _reset_peak; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(path: str, budgets: list[int], threads: int, n_tokens: int = 32, context: int = 16,
        io_modes: tuple[str, ...] = ("pread", "direct"), llama_bench: str | None = None, probe: dict | None = None,
        drop: bool = True, llama_timeout: float = 180.0, llama_fill: bool = False) -> dict:
    """The table: every budget x read mode (a mode this file system refuses is noted, not timed), against the
    disk's floor; llama-bench under each budget when given."""
    from ...errors import ParameterError

    probe = probe_disk(path, rand_bytes=expert_range(path)) if probe is None else probe  # as many threads as readers
    rows = []
    for b in budgets:
        mine = []
        for io in io_modes:
            try:
                r = measure(path, b, io, threads, n_tokens, context, drop)
            except ParameterError as e:
                rows.append({"budget": b, "io": io, "error": str(e)})
                continue
            bpt = r["bytes_per_token"]
            r["floor_s_per_token"] = bpt / probe["rand_bytes_s"] if bpt else 0.0
            r["floor_frac"] = r["floor_s_per_token"] * r["tok_s"] if bpt else None
            rows.append(r)
            mine.append(r["peak_rss_bytes"])
        if llama_bench:  # the memory this engine's process took at this budget (its interpreter and buffers too)
            limit = max([b, *mine])
            rows.append({"budget": b, "io": "llama-bench (mmap)", "limit_bytes": limit,
                         **llama_bench_limited(llama_bench, path, threads, n_tokens, limit, llama_timeout,
                                             llama_fill)})
    return {"model": path, "threads": threads, "n_tokens": n_tokens, "context": context, "disk": probe, "rows": rows}


def expert_range(path: str) -> int:
    """The largest byte range of one expert of one stacked tensor in the file (what one expert read is)."""
    from ...format.gguf_model import GGUFModel

    gm = GGUFModel(path)
    try:
        return max((t.nbytes // t.ne[2] for n, t in gm.tensors.items() if n.endswith("_exps.weight") and
                    len(t.ne) == 3), default=1 << 20)
    finally:
        gm.close()


def _size(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def markdown(res: dict) -> str:
    d = res["disk"]
    mb = 1e6
    lines = [f"disk: {d['seq_bytes_s'] / mb:.0f} MB/s sequential, {d['rand_bytes_s'] / mb:.0f} MB/s random "
             f"({d['rand_read_bytes'] >> 10} KiB reads, {d['threads']} threads, "
             f"{'O_DIRECT' if d['direct'] else 'page cache dropped'})", "",
             "| budget | read | tok/s | MB read/token | floor ms/token | of floor | hit rate | resident "
             "| run peak RSS | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        b = _size(r["budget"])
        if "bytes_per_token" not in r:  # a refused read mode, or llama-bench
            tok = f"{r['tok_s']:.2f}" if r.get("tok_s") else "-"
            note = "; ".join(x for x in (r.get("limit"), r.get("error")) if x)
            lines.append(f"| {b} | {r['io']} | {tok} | | | | | | | {note} |")
            continue
        frac = f"{r['floor_frac']:.0%}" if r["floor_frac"] is not None else "-"
        lines.append(f"| {b} | {r['io']} | {r['tok_s']:.2f} | {r['bytes_per_token'] / mb:.1f} | "
                     f"{r['floor_s_per_token'] * 1e3:.1f} | {frac} | {r['hit_rate']:.0%} | "
                     f"{_size(r['resident_bytes'])} | {_size(r['peak_rss_bytes'])} | "
                     f"{'all resident' if not r['on_disk'] else ''} |")
    return "\n".join(lines)

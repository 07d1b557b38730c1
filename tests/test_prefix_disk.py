"""The on-disk snapshot store: a fresh cache (or another process) restores what one saved, bit for bit; another
model's files are misses; damaged files are reported, removed and missed; a writer killed mid-write leaves the
store readable; the disk budget holds."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
from test_prefix_cache import ARGS, FP, N_CTX, advance, assert_same, garbage, run, sizes, tokens

from hybridinfer.backends.state import DecoderState
from hybridinfer.engine.prefix import PrefixCache, SnapshotWarning
from hybridinfer.engine.prefix.snapshot import load_file, write_file

B = 16
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def _cache(d, **kw) -> PrefixCache:
    kw = {"block_size": B, "ram_bytes": 1 << 24, **kw}
    return PrefixCache(FP, ARGS.layer_types, disk_dir=str(d), **kw)


def _files(d) -> dict[str, int]:
    return {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".snap")}


def _save_chain(cache, base, positions, logits_at_end=True):
    st = DecoderState.new(ARGS, N_CTX)
    keys = {}
    for p in positions:
        advance(st, base[st.pos : p])
        lg = np.arange(300, dtype=np.float32) * p if (logits_at_end and p == positions[-1]) else None
        keys[p] = cache.save(st, lg)
    return keys


def _py(code: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120, **kw)


def test_a_fresh_cache_restores_from_disk(tmp_path):
    base = tokens(120, seed=1)
    a = _cache(tmp_path)
    keys = _save_chain(a, base, [16, 40, 64, 100])
    assert set(_files(tmp_path)) == {k + ".snap" for k in keys.values()}
    for ram in (1 << 24, 0):  # with RAM (the hit is promoted into it) and disk only
        b = _cache(tmp_path, ram_bytes=ram)
        assert b.stats["snapshots_disk"] == 4 and b.stats["snapshots_ram"] == 0
        for prompt, want in ((base, 100), (base[:99], 64), (base[:50] + [6001], 40), (base[:16], 16)):
            hit = b.lookup(prompt)
            assert hit.pos == want
            tgt = garbage()
            lg = b.restore(hit, tgt)
            assert_same(tgt, run(base[:want]))
            assert (lg is not None) == (want == 100)
            if lg is not None:
                assert lg.tobytes() == (np.arange(300, dtype=np.float32) * 100).tobytes()
        assert b.stats["snapshots_ram"] == (4 if ram else 0)
    # K/V rows are stored once along the chain on disk too
    rec, row = sizes()
    payload = sum(_files(tmp_path).values())
    assert 4 * rec + 100 * row + 300 * 4 <= payload < 4 * rec + 100 * row + 300 * 4 + 4 * 8192


def test_ram_eviction_falls_back_to_disk(tmp_path):
    rec, row = sizes()
    base = tokens(80, seed=2)
    c = _cache(tmp_path, ram_bytes=rec + 20 * row)  # RAM keeps about one snapshot
    _save_chain(c, base, [16, 32, 48, 64, 80])
    assert len(c.ram) == 1 and len(_files(tmp_path)) == 5
    for p in (16, 32, 48, 64, 80):
        tgt = garbage()
        c.restore(c.lookup(base[:p]), tgt)
        assert_same(tgt, run(base[:p]))
        assert c.ram.bytes <= c.ram.budget


def test_another_model_is_a_miss(tmp_path):
    base = tokens(40, seed=3)
    a = _cache(tmp_path)
    key_a = a.save(run(base))
    other = PrefixCache("another-model", ARGS.layer_types, block_size=B, disk_dir=str(tmp_path))
    assert other.lookup(base) is None
    # even a file under the very key the other model looks for, whose header names model a's fingerprint
    key_b = other.save(run(base))
    other.clear()
    _, snap = load_file(str(tmp_path / f"{key_a}.snap"))
    write_file(str(tmp_path), dataclasses.replace(snap, key=bytes.fromhex(key_b)), a.disk.meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a miss, not a damaged file
        fresh = PrefixCache("another-model", ARGS.layer_types, block_size=B, disk_dir=str(tmp_path))
        assert fresh.lookup(base) is None
        assert fresh.disk.load(bytes.fromhex(key_b)) is None
    assert len(_files(tmp_path)) == 2  # and left alone
    # a different block size files keys differently: also a miss
    assert _cache(tmp_path, block_size=8).lookup(base) is None
    assert _cache(tmp_path).lookup(base).pos == 40


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) - 100]
    elif how == "payload bit flip":
        data[-50] ^= 0x10
    elif how == "header bit flip":
        data[40] ^= 0x01
    elif how == "empty":
        data = b""
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "payload bit flip", "header bit flip", "empty"])
def test_a_damaged_file_is_reported_removed_and_missed(tmp_path, how):
    base = tokens(70, seed=4)
    keys = _save_chain(_cache(tmp_path), base, [32, 64])
    victim = tmp_path / f"{keys[64]}.snap"
    _damage(victim, how)
    with pytest.warns(SnapshotWarning, match="damaged"):
        c = _cache(tmp_path)  # a header problem shows at the scan, a payload one at first use
        hit = c.lookup(base)
    assert hit.pos == 32  # the damaged snapshot is a miss; its parent still serves
    assert not victim.exists() and c.stats["damaged_disk"] == 1
    tgt = garbage()
    c.restore(hit, tgt)
    assert_same(tgt, run(base[:32]))
    # a damaged parent: the child cannot be restored either, and goes too
    keys = _save_chain(_cache(tmp_path), base, [32, 64])
    _damage(tmp_path / f"{keys[32]}.snap", how)
    with pytest.warns(SnapshotWarning):
        c = _cache(tmp_path)
        assert c.lookup(base) is None
    assert _files(tmp_path) == {}


def test_a_file_whose_parent_vanished_is_dropped(tmp_path):
    base = tokens(70, seed=5)
    keys = _save_chain(_cache(tmp_path), base, [16, 48])
    os.unlink(tmp_path / f"{keys[16]}.snap")  # e.g. another process evicted it
    c = _cache(tmp_path)
    assert c.lookup(base) is None
    assert _files(tmp_path) == {}
    # files vanishing between a scan and their use are plain misses
    keys = _save_chain(_cache(tmp_path), base, [16, 48])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = _cache(tmp_path, disk_rescan_s=3600, ram_bytes=0)
        assert len(c.disk.index) == 2
        for p, want in ((48, 16), (16, None)):
            st = os.stat(tmp_path)
            os.unlink(tmp_path / f"{keys[p]}.snap")
            os.utime(tmp_path, ns=(st.st_atime_ns, st.st_mtime_ns))  # so no rescan notices before the load
            hit = c.lookup(base)
            assert (hit.pos if hit else None) == want


def test_a_killed_writer_leaves_the_store_readable(tmp_path):
    base = tokens(60, seed=6)
    r = _py(f"""
        import os
        from test_prefix_cache import ARGS, FP, run
        from hybridinfer.engine.prefix import PrefixCache
        base = {base!r}
        c = PrefixCache(FP, ARGS.layer_types, block_size={B}, disk_dir={str(tmp_path)!r})
        c.save(run(base[:20]))
        os.fsync = lambda fd: os._exit(3)  # killed after writing the temp file, before its rename
        c.save(run(base[:50]))
        os._exit(0)
    """)
    assert r.returncode == 3, r.stderr
    names = os.listdir(tmp_path)
    tmp = [n for n in names if n.startswith(".tmp-")]
    assert len(tmp) == 1 and len(_files(tmp_path)) == 1
    half = tmp_path / ".tmp-0123-partial.part"  # and one cut off in the middle of its payload
    half.write_bytes((tmp_path / tmp[0]).read_bytes()[:300])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = _cache(tmp_path, tmp_max_age_s=3600)
        hit = c.lookup(base)
    assert hit.pos == 20
    tgt = garbage()
    c.restore(hit, tgt)
    assert_same(tgt, run(base[:20]))
    c.save(run(base[:50]))  # the interrupted save, done again
    assert c.lookup(base).pos == 50
    # a later scan removes temp files once they are old
    old = time.time() - 7200
    for n in tmp:
        os.utime(tmp_path / n, (old, old))
    os.utime(half, (old, old))
    _cache(tmp_path, tmp_max_age_s=3600)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_two_processes_share_a_directory(tmp_path):
    base = tokens(90, seed=7)
    here = _cache(tmp_path, disk_rescan_s=3600)  # made first: it must notice the other process's file
    assert here.lookup(base) is None
    r = _py(f"""
        from test_prefix_cache import ARGS, FP, N_CTX, advance
        from hybridinfer.engine.prefix import PrefixCache
        from hybridinfer.backends.state import DecoderState
        import numpy as np
        base = {base!r}
        c = PrefixCache(FP, ARGS.layer_types, block_size={B}, disk_dir={str(tmp_path)!r})
        st = DecoderState.new(ARGS, N_CTX)
        for p in (32, 90):
            advance(st, base[st.pos : p])
            c.save(st, np.full(300, p, np.float32) if p == 90 else None)
    """)
    assert r.returncode == 0, r.stderr
    hit = here.lookup(base)
    assert hit is not None and hit.pos == 90 and hit.has_logits
    tgt = garbage()
    assert np.all(here.restore(hit, tgt) == 90)
    assert_same(tgt, run(base))
    # and the other way: this process saves a continuation, a new process restores it bit for bit
    longer = base + tokens(30, seed=8)
    here.save(run(longer))
    assert len(_files(tmp_path)) == 3
    r = _py(f"""
        from test_prefix_cache import ARGS, FP, assert_same, garbage, run
        from hybridinfer.engine.prefix import PrefixCache
        longer = {longer!r}
        c = PrefixCache(FP, ARGS.layer_types, block_size={B}, disk_dir={str(tmp_path)!r}, ram_bytes=0)
        hit = c.lookup(longer)
        assert hit.pos == len(longer), hit
        tgt = garbage()
        c.restore(hit, tgt)
        assert_same(tgt, run(longer))
        print("ok", [s.kv_from for s in hit._chain])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "ok" and "[0, 32, 90]" in r.stdout


def test_disk_budget_holds_and_evicts_lru_leaves(tmp_path):
    rec, row = sizes()
    rng = np.random.default_rng(9)
    roots = [tokens(100, seed=30 + i) for i in range(3)]
    budget = 6 * rec + 200 * row + 8 * 4096
    c = _cache(tmp_path, ram_bytes=0, disk_bytes=budget)
    for _ in range(60):
        base = roots[int(rng.integers(len(roots)))]
        cut = int(rng.integers(1, len(base)))
        prompt = base[:cut] + [int(t) for t in rng.integers(0, 5000, int(rng.integers(0, 10)))]
        if rng.random() < 0.6:
            key = c.save(run(prompt))
            if rec + len(prompt) * row + 8192 <= budget:  # the newest is kept whenever it fits alone
                assert key + ".snap" in _files(tmp_path)
        else:
            hit = c.lookup(prompt)
            if hit:
                tgt = garbage()
                c.restore(hit, tgt)
                assert_same(tgt, run(prompt[: hit.pos]))
        files = _files(tmp_path)
        assert sum(files.values()) <= budget
        ents = c.disk.entries
        assert set(files) == {k.hex() + ".snap" for k in ents}
        assert all(e.parent is None or e.parent in ents for e in ents.values())  # chains stay whole
    assert c.stats["evictions_disk"] > 0

    # LRU among leaves, by file mtime: the chain that was just used survives, the stale prompt goes
    probe = _cache(tmp_path / "probe", ram_bytes=0)
    probe.save(run(tokens(16, seed=43)))
    one = probe.stats["bytes_disk"]  # the file of a 16-token segment
    c = _cache(tmp_path / "lru", ram_bytes=0, disk_bytes=3 * one + 200)  # room for three such files
    a, b = tokens(40, seed=40), tokens(40, seed=41, lo=6000, hi=7000)
    _save_chain(c, a, [16, 32], logits_at_end=False)
    time.sleep(0.02)
    c.save(run(b[:16]))
    time.sleep(0.02)
    c.lookup(a[:32])  # touches a16 and a32
    time.sleep(0.02)
    c.save(run(tokens(16, seed=42, lo=7000, hi=8000)))
    assert c.lookup(b[:16]) is None and c.lookup(a).pos == 32


def test_clear_removes_only_this_models_files(tmp_path):
    base = tokens(40, seed=10)
    mine = _cache(tmp_path)
    theirs = PrefixCache("another-model", ARGS.layer_types, block_size=B, disk_dir=str(tmp_path))
    mine.save(run(base))
    theirs.save(run(base))
    mine.clear()
    assert len(_files(tmp_path)) == 1 and theirs.lookup(base).pos == 40 and mine.lookup(base) is None

"""The prefix cache in RAM: save/lookup/restore is bit-exact for prefixes of every shape, a divergence falls back
to the last snapshot before it, K/V rows are stored once along a chain, eviction keeps chains whole and the byte
budget is never exceeded. CPU only, on small synthetic states (tests/test_prefix_disk.py uses the helpers)."""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from hybridinfer.backends.state import DecoderState
from hybridinfer.engine.prefix import PrefixCache
from hybridinfer.errors import ContextLengthError, SnapshotError

B = 16
N_CTX = 320
FP = "test-model-fingerprint"
ARGS = SimpleNamespace(layer_types=("gdn", "gdn", "attention", "gdn", "attention"), ssm_conv_kernel=4,
                       ssm_conv_channels=6, ssm_n_v_heads=2, ssm_d_k=3, ssm_d_v=2, n_head_kv=2, head_dim=4)


# a fake model: K/V row i is a function of tokens[:i+1], conv and S of all tokens so far ----------------------
def _h(h: bytes, t: int) -> bytes:
    return hashlib.blake2b(h + int(t).to_bytes(4, "little", signed=True), digest_size=16).digest()


def _rng(h: bytes) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def advance(st: DecoderState, new) -> None:
    h = b"fake-model"
    for t in st.tokens[: st.pos]:
        h = _h(h, t)
    for t in new:
        h = _h(h, t)
        st.tokens[st.pos] = t
        rng = _rng(h)
        for a in (*st.k, *st.v):
            if a is not None:
                a[st.pos] = rng.standard_normal(a.shape[1:], dtype=np.float32)
        st.pos += 1
    rng = _rng(h + b"recurrent")
    for a in (*st.conv, *st.ssm):
        if a is not None:
            a[...] = rng.standard_normal(a.shape, dtype=np.float32)


def run(tokens, n_ctx: int = N_CTX, args=ARGS) -> DecoderState:
    st = DecoderState.new(args, n_ctx)
    advance(st, [int(t) for t in tokens])
    return st


def garbage(n_ctx: int = N_CTX, seed: int = 99) -> DecoderState:
    """A state full of noise (restore must overwrite everything it promises)."""
    st = DecoderState.new(ARGS, n_ctx)
    rng = np.random.default_rng(seed)
    st.tokens[:] = rng.integers(0, 1 << 20, n_ctx)
    st.pos = int(rng.integers(0, n_ctx))
    for a in (*st.conv, *st.ssm, *st.k, *st.v):
        if a is not None:
            a[...] = rng.standard_normal(a.shape, dtype=np.float32)
    return st


def assert_same(got: DecoderState, want: DecoderState) -> None:
    """Bit-identical: pos, tokens[:pos], conv, S and K/V rows < pos."""
    p = want.pos
    assert got.pos == p
    assert got.tokens[:p].tobytes() == want.tokens[:p].tobytes()
    for x, y in zip((*got.conv, *got.ssm), (*want.conv, *want.ssm), strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.tobytes() == y.tobytes()
    for x, y in zip((*got.k, *got.v), (*want.k, *want.v), strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x[:p].tobytes() == y[:p].tobytes()


def tokens(n: int, seed: int = 0, lo: int = 0, hi: int = 5000) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(lo, hi, n)]


def sizes(args=ARGS) -> tuple[int, int]:
    """(recurrent bytes, bytes per position: K/V rows of every attention layer plus the token id)."""
    st = DecoderState.new(args, 1)
    rec = sum(a.nbytes for a in (*st.conv, *st.ssm) if a is not None)
    return rec, 4 + sum(a[0].nbytes for a in (*st.k, *st.v) if a is not None)


def check_invariants(cache: PrefixCache) -> None:
    ram = cache.ram
    assert ram.bytes <= ram.budget
    assert ram.bytes == sum(s.nbytes for s in ram.snaps.values())
    assert set(ram.index.entries) == set(ram.snaps)
    for s in ram.snaps.values():  # closed under ancestors, segments contiguous
        if s.parent is None:
            assert s.kv_from == 0
        else:
            assert s.parent in ram.snaps and ram.snaps[s.parent].pos == s.kv_from


def cached_tokens(cache: PrefixCache, key: bytes) -> list[int]:
    return [int(t) for s in cache.ram.chain(key) for t in s.tokens]


# tests ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [B, 5, 1])
def test_roundtrip_many_lengths(block):
    base = tokens(200, seed=1)
    cache = PrefixCache(FP, ARGS.layer_types, block_size=block, ram_bytes=1 << 24)
    positions = [1, block - 1, block, block + 1, 5 * block + 3, 100, 150, 200]
    positions = sorted({p for p in positions if p >= 1})
    st = DecoderState.new(ARGS, N_CTX)
    for p in positions:  # one state walked along the prompt, snapshotted on the way
        advance(st, base[st.pos : p])
        assert cache.save(st) is not None
    check_invariants(cache)
    for p in positions:
        for q in (p, p + 1, p + block + 2):  # the prompt itself, and longer ones below the next snapshot
            nxt = min([x for x in positions if x > p], default=10**9)
            if q >= nxt or q > len(base):
                continue
            hit = cache.lookup(base[:q])
            assert hit is not None and hit.pos == p, (p, q, hit)
            tgt = garbage()
            assert cache.restore(hit, tgt) is None
            assert_same(tgt, run(base[:p]))
    hit = cache.lookup(np.asarray(base, np.int64), max_pos=99)
    assert hit.pos == max(x for x in positions if x <= 99)
    assert cache.lookup(base, max_pos=0) is None


def test_divergence_falls_back_to_the_last_snapshot_before_it():
    base = tokens(140, seed=2)
    cache = PrefixCache(FP, ARGS.layer_types, block_size=B)
    st = DecoderState.new(ARGS, N_CTX)
    for p in (32, 64, 70, 96, 128, 140):
        advance(st, base[st.pos : p])
        cache.save(st)
    other = tokens(40, seed=3, lo=6000, hi=7000)  # never equal to a base token
    cases = {
        "same prompt": (base, 140),
        "longer": (base + other, 140),
        "diverges inside a block": (base[:75] + other, 70),
        "diverges inside the tail of a snapshot": (base[:68] + other, 64),
        "diverges at a snapshot": (base[:64] + other, 64),
        "diverges in the first block after a snapshot": (base[:40] + other, 32),
        "diverges at position 0": (other + base, None),
        "shorter than the first snapshot": (base[:20], None),
        "a prefix ending inside a block": (base[:100], 96),
        "empty": ([], None),
    }
    for name, (prompt, want) in cases.items():
        hit = cache.lookup(prompt)
        assert (hit.pos if hit else None) == want, name
        if hit:
            tgt = garbage()
            cache.restore(hit, tgt)
            assert_same(tgt, run(prompt[:want]))
    assert cache.lookup(base, max_pos=69).pos == 64
    s = cache.stats
    assert s["misses"] == 3 and s["hits"] == 7 and s["reused_tokens"] == 140 + 140 + 70 + 64 + 64 + 32 + 96


def test_exact_repeat_returns_the_logits():
    base = tokens(50, seed=4)
    cache = PrefixCache(FP, ARGS.layer_types)
    st = run(base)
    lg = np.random.default_rng(5).standard_normal(300, dtype=np.float32)
    key = cache.save(st, lg)
    hit = cache.lookup(base)
    assert hit.key == key and hit.pos == 50 and hit.has_logits
    got = cache.restore(hit, garbage())
    assert got.tobytes() == lg.tobytes()
    got[:] = 0  # the caller's copy
    lg[:] = 1  # and the cache took its own
    assert cache.restore(cache.lookup(base), garbage()).tobytes() != got.tobytes()
    # saving again is a no-op returning the key; a snapshot saved without logits gains them later
    assert cache.save(st) == key and cache.stats["saves"] == 1
    st2 = run(base[:40])
    cache.save(st2)
    assert not cache.lookup(base[:40]).has_logits
    cache.save(st2, np.ones(300, np.float32))
    hit = cache.lookup(base[:40])
    assert hit.has_logits and np.all(cache.restore(hit, garbage()) == 1)
    check_invariants(cache)


def test_kv_rows_are_stored_once_along_a_chain():
    rec, row = sizes()
    base = tokens(60, seed=6)
    cache = PrefixCache(FP, ARGS.layer_types, block_size=B, ram_bytes=3 * (rec + 16 * row))
    st = DecoderState.new(ARGS, N_CTX)
    for p in (16, 32, 48):
        advance(st, base[st.pos : p])
        cache.save(st)
    snaps = {s.pos: s for s in cache.ram.snaps.values()}
    assert [(s.kv_from, s.parent) for s in (snaps[16], snaps[32], snaps[48])] == [
        (0, None), (16, snaps[16].key), (32, snaps[32].key)]
    for s in snaps.values():
        assert s.nbytes == rec + 16 * row and all(a.shape[0] == 16 for a in (*s.k.values(), *s.v.values()))
    assert cache.stats["bytes_ram"] == 3 * rec + 48 * row  # each of the 48 K/V rows once
    for p in (16, 32, 48):
        tgt = garbage()
        cache.restore(cache.lookup(base[:p] + [7001]), tgt)
        assert_same(tgt, run(base[:p]))

    # the budget is full: a new snapshot evicts the LRU leaf (48), never 16 or 32, which others depend on
    other = tokens(40, seed=7, lo=6000, hi=7000)
    cache.save(run(other[:16]))
    assert sorted(s.pos for s in cache.ram.snaps.values()) == [16, 16, 32]
    assert cache.lookup(base[:48]).pos == 32
    check_invariants(cache)
    # a hit touches the chain: after using base[:32], the other prompt's snapshot is the LRU leaf
    cache.lookup(base[:32])
    cache.save(run(tokens(16, seed=8, lo=7000, hi=8000)))
    assert cache.lookup(other[:16]) is None and cache.lookup(base[:32]).pos == 32
    check_invariants(cache)
    # a snapshot whose whole chain cannot fit is stored self-contained (its own K/V from 0) if that fits
    cache2 = PrefixCache(FP, ARGS.layer_types, block_size=B, ram_bytes=rec + 40 * row)
    cache2.save(run(base[:16]))
    cache2.save(run(base[:40]))
    s = cache2.ram.get(bytes.fromhex(cache2.lookup(base[:40]).key))
    assert s.kv_from == 0 and s.parent is None and len(cache2.ram) == 1
    tgt = garbage()
    cache2.restore(cache2.lookup(base), tgt)
    assert_same(tgt, run(base[:40]))


def test_eviction_of_a_shared_ancestor_takes_its_dependants():
    base = tokens(64, seed=9)
    cache = PrefixCache(FP, ARGS.layer_types, block_size=B)
    st = DecoderState.new(ARGS, N_CTX)
    for p in (16, 32, 48):
        advance(st, base[st.pos : p])
        cache.save(st)
    cache.save(run(base[:32] + [6001] * 10))  # a branch off the snapshot at 32
    k32 = bytes.fromhex(cache.lookup(base[:32]).key)
    cache.ram.remove(k32)
    assert sorted(s.pos for s in cache.ram.snaps.values()) == [16]
    check_invariants(cache)


def test_ram_budget_holds_under_a_random_workload():
    rec, row = sizes()
    rng = np.random.default_rng(10)
    roots = [tokens(120, seed=s) for s in range(4)]
    for budget in (0, rec + 5 * row, 3 * rec + 100 * row, 10 * rec + 400 * row):
        cache = PrefixCache(FP, ARGS.layer_types, block_size=8, ram_bytes=budget)
        for _ in range(120):
            base = roots[int(rng.integers(len(roots)))]
            cut = int(rng.integers(1, len(base)))
            prompt = base[:cut] + [int(t) for t in rng.integers(0, 5000, int(rng.integers(0, 20)))]
            if rng.random() < 0.6:
                st = run(prompt)
                key = bytes.fromhex(cache.save(st))
                if rec + len(prompt) * row <= budget:  # the most recent snapshot is kept whenever it fits
                    assert key in cache.ram
            else:
                hit = cache.lookup(prompt)
                cached = [s for s in cache.ram.snaps.values() if s.pos <= len(prompt)
                          and cached_tokens(cache, s.key) == prompt[: s.pos]]
                assert (hit.pos if hit else 0) == max((s.pos for s in cached), default=0)
                if hit:
                    tgt = garbage()
                    cache.restore(hit, tgt)
                    assert_same(tgt, run(prompt[: hit.pos]))
            check_invariants(cache)


def test_a_snapshot_larger_than_the_budget_is_not_stored():
    rec, row = sizes()
    cache = PrefixCache(FP, ARGS.layer_types, ram_bytes=rec + 10 * row)
    base = tokens(30, seed=11)
    assert cache.save(run(base)) is not None
    assert len(cache.ram) == 0 and cache.stats["bytes_ram"] == 0 and cache.lookup(base) is None
    assert cache.save(DecoderState.new(ARGS, 8)) is None  # position 0: nothing to keep


def test_restore_checks_the_target_state():
    base = tokens(40, seed=12)
    cache = PrefixCache(FP, ARGS.layer_types)
    cache.save(run(base))
    hit = cache.lookup(base)
    with pytest.raises(ContextLengthError):
        cache.restore(hit, DecoderState.new(ARGS, 20))
    other = SimpleNamespace(**{**vars(ARGS), "layer_types": ("gdn", "attention")})
    with pytest.raises(SnapshotError):
        cache.restore(hit, DecoderState.new(other, N_CTX))
    wide = SimpleNamespace(**{**vars(ARGS), "head_dim": 8})
    tgt = DecoderState.new(wide, N_CTX)
    with pytest.raises(SnapshotError):
        cache.restore(hit, tgt)
    assert tgt.pos == 0 and not tgt.tokens.any()  # nothing was written
    with pytest.raises(SnapshotError):
        cache.save(DecoderState.new(other, N_CTX))


def test_stats_and_clear():
    base = tokens(40, seed=13)
    cache = PrefixCache(FP, ARGS.layer_types)
    cache.save(run(base[:16]))
    cache.save(run(base))
    cache.restore(cache.lookup(base), garbage())
    assert cache.lookup([1, 2, 3]) is None
    s = cache.stats
    assert (s["hits"], s["misses"], s["reused_tokens"], s["saves"], s["snapshots_ram"]) == (1, 1, 40, 2, 2)
    assert s["bytes_ram"] > 0 and s["restore_s"] >= 0 and s["save_s"] > 0 and s["snapshots_disk"] == 0
    cache.clear()
    s = cache.stats
    assert s["snapshots_ram"] == 0 and s["bytes_ram"] == 0 and s["hits"] == 0 and cache.lookup(base) is None


def test_the_model_fingerprint_separates_caches():
    base = tokens(40, seed=14)
    a = PrefixCache("model-a", ARGS.layer_types)
    b = PrefixCache("model-b", ARGS.layer_types)
    assert a.save(run(base)) != b.save(run(base))


def test_threads_share_one_cache():
    rec, row = sizes()
    cache = PrefixCache(FP, ARGS.layer_types, block_size=8, ram_bytes=4 * rec + 150 * row)
    roots = [tokens(100, seed=20 + i) for i in range(3)]
    states = {(i, p): run(roots[i][:p]) for i in range(3) for p in (8, 24, 50, 77, 100)}
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                i, p = list(states)[int(rng.integers(len(states)))]
                if rng.random() < 0.5:
                    cache.save(states[(i, p)])
                else:
                    hit = cache.lookup(roots[i][:p])
                    if hit:
                        tgt = garbage()
                        cache.restore(hit, tgt)
                        assert_same(tgt, states[(i, hit.pos)])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    check_invariants(cache)



def test_known_prefix_reports_the_shared_block_aligned_prefix(tmp_path):
    for disk in (None, str(tmp_path)):
        c = PrefixCache(FP, ARGS.layer_types, block_size=B, ram_bytes=0 if disk else 1 << 30, disk_dir=disk)
        base = list(range(100, 100 + 5 * B + 7))
        assert c.known_prefix(base) == 0  # empty cache
        c.save(run(base))
        assert c.known_prefix(base) == 5 * B  # the tail past the last whole block is not a block
        assert c.known_prefix(base[: 3 * B + 4] + [1, 2, 3] + base[3 * B + 7 :]) == 3 * B  # diverges in block 4
        assert c.known_prefix(base[: 2 * B]) == 2 * B
        assert c.known_prefix([7] + base[1:]) == 0


def test_deferred_disk_copies_are_written_by_flush(tmp_path):
    base = list(range(300, 300 + 5 * B + 3))
    c = PrefixCache(FP, ARGS.layer_types, block_size=B, ram_bytes=1 << 30, disk_dir=str(tmp_path))
    for p in (2 * B, 4 * B, len(base)):  # a chain: each snapshot's K/V segment continues its parent's
        c.save(run(base[:p]), defer_disk=True)
    assert not list(tmp_path.glob("*.snap"))  # nothing written yet
    assert c.flush() == 3 and c.flush() == 0
    assert len(list(tmp_path.glob("*.snap"))) == 3
    other = PrefixCache(FP, ARGS.layer_types, block_size=B, ram_bytes=0, disk_dir=str(tmp_path))
    for p in (2 * B, 4 * B, len(base)):
        hit = other.lookup(base[:p])
        assert hit is not None and hit.pos == p
        st = garbage()
        other.restore(hit, st)
        assert_same(st, run(base[:p]))
    # the disk copies share K/V along the chain as the RAM ones do: rows stored once
    rows = sum(s.pos - s.kv_from for s in (other.disk.load(bytes.fromhex(h.key)) for h in
                                           [other.lookup(base[:p]) for p in (2 * B, 4 * B, len(base))]))
    assert rows == len(base)

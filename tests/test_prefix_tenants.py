"""Issue 29, item 7 in the prefix cache: snapshots saved under a salt (a tenant, e.g. an API key's hash) are found
only with that salt, in RAM and in a disk store another process reads; unsalted lookups never see them."""

from __future__ import annotations

from test_prefix_cache import ARGS, FP, N_CTX, advance, assert_same, garbage, run, tokens

from hybridinfer.backends.state import DecoderState
from hybridinfer.engine.prefix import PrefixCache


def _cache(d, **kw) -> PrefixCache:
    return PrefixCache(FP, ARGS.layer_types, **{"block_size": 16, "ram_bytes": 1 << 24, "disk_dir": str(d), **kw})


def test_salted_snapshots_are_found_only_with_their_salt(tmp_path):
    base = tokens(80, seed=3)
    a = _cache(tmp_path)
    st = DecoderState.new(ARGS, N_CTX)
    advance(st, base[:64])
    one = a.save(st, salt="tenant-1")
    assert a.lookup(base, salt="tenant-1").pos == 64
    assert a.lookup(base) is None and a.lookup(base, salt="tenant-2") is None
    assert a.known_prefix(base, salt="tenant-1") == 64 and a.known_prefix(base) == 0
    assert a.known_prefix(base, salt="tenant-2") == 0
    assert a.save(st) != one and a.lookup(base).pos == 64  # the same tokens unsalted: a snapshot of their own
    b = _cache(tmp_path, ram_bytes=0)  # another process over the same directory
    for salt in ("tenant-1", None):
        hit = b.lookup(base, salt=salt)
        assert hit.pos == 64
        tgt = garbage()
        b.restore(hit, tgt)
        assert_same(tgt, run(base[:64]))
    assert b.lookup(base, salt="tenant-2") is None

"""Hardening of the prefix cache (issue 19): snapshots are keyed by the whole model's content and the backend's
numeric path, so a restored run always equals a cold run of the same engine; anything in the cache directory that
is not a well-formed snapshot of this model (FIFOs, directories, symlinks, wrong shapes or dtypes, short or missing
logits, garbage) is a miss with a warning, removed where possible, and never hangs or fails a run; the model's
content hash is computed once per file and remembered in the directory."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import warnings

import numpy as np
import pytest

from hybridinfer.engine.api import Engine, model_cache_fingerprint
from hybridinfer.engine.prefix import PrefixCache, SnapshotWarning, model_key
from hybridinfer.engine.prefix import snapshot as snapfile
from hybridinfer.errors import SnapshotError
from hybridinfer.format.gguf_model import GGUFModel
from hybridinfer.tools.synth import synth_model

SHAPE = dict(n_embd=64, n_layer=4, n_head=2, n_head_kv=1, head_dim=32, n_vocab=300, ssm_d_state=32, ssm_n_group=1,
             ssm_dt_rank=2, n_ff=64)
IDS = [int(x) for x in np.random.default_rng(0).integers(0, 250, 40)]
N_GEN = 6
RUN_TIMEOUT_S = 120  # a run blocked on a FIFO fails here instead of hanging the suite


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny qwen35 files that differ only in the data of the attention layer's V projection (a fine-tune)."""
    d = tmp_path_factory.mktemp("robust")
    a, b = str(d / "a.gguf"), str(d / "b.gguf")
    synth_model(a, "qwen35", SHAPE, "q8_0", seed=1)
    _copy_with_changed_attn_v(a, b)
    return a, b


def _copy_with_changed_attn_v(src: str, dst: str) -> None:
    t = GGUFModel(src).tensors["blk.3.attn_v.weight"]
    assert t.type_name == "Q8_0"
    with open(src, "rb") as f:
        data = bytearray(f.read())
    blocks = np.frombuffer(data, np.uint8, t.nbytes, t.offset).reshape(-1, 34).copy()
    q = blocks[:, 2:].view(np.int8)
    q[...] = np.clip(-q.astype(np.int16), -127, 127)  # the quants negated, the scales kept: same size, same layout
    data[t.offset : t.offset + t.nbytes] = blocks.tobytes()
    with open(dst, "wb") as f:
        f.write(data)


def _load(path, backend="cpu", cache=None, stride=16, **kw):
    return Engine.load(path, backend=backend, n_ctx=256, prefix_cache=cache, snapshot_stride=stride, **kw)


def _gen(eng):
    r = eng.generate(IDS, max_tokens=N_GEN, temperature=0)
    return r.tokens, r.timings["reused_tokens"]


def _first_logits(eng):
    lg, stats = eng.start(IDS, eng.new_state())
    return np.array(lg), stats["reused_tokens"]


def _snaps(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".snap"))


# keys: whole content and numeric path -------------------------------------------------------------------------
def test_models_differing_in_one_tensor_share_no_snapshots(models, tmp_path):
    a, b = models
    shared = str(tmp_path / "shared")
    want = {}
    for name, path in (("a", a), ("b", b)):  # cold: each engine with a private, empty cache
        want[name] = (_gen(_load(path, cache={"disk_dir": str(tmp_path / f"cold-{name}")}))[0],
                      _first_logits(_load(path, cache={"disk_dir": str(tmp_path / f"cold-l-{name}")}))[0])
    assert want["a"][1].tobytes() != want["b"][1].tobytes()  # the changed tensor changes the answer
    assert _gen(_load(a, cache={"disk_dir": shared})) == (want["a"][0], 0)
    n_a = len(_snaps(shared))
    assert n_a >= 3
    # model b: nothing of a's is found (the old sampled fingerprint gave a's snapshots to b)
    assert _gen(_load(b, cache={"disk_dir": shared})) == (want["b"][0], 0)
    assert len(_snaps(shared)) > n_a
    for name, path in (("a", a), ("b", b)):  # and each restores its own, equal to its cold run
        toks, reused = _gen(_load(path, cache={"disk_dir": shared}))
        assert toks == want[name][0] and reused == len(IDS)
        lg, reused = _first_logits(_load(path, cache={"disk_dir": shared}))
        assert reused == len(IDS) and lg.tobytes() == want[name][1].tobytes()
    fa = _load(a, cache={"disk_dir": shared}).prefix_cache.fingerprint
    fb = _load(b, cache={"disk_dir": shared}).prefix_cache.fingerprint
    assert fa != fb and fa.split("/")[1] == fb.split("/")[1]


@pytest.mark.parametrize("first,second", [
    (("reference", {}), ("cpu", {})),
    (("cpu", {"isa": "scalar"}), ("cpu", {})),
], ids=["reference-vs-cpu", "scalar-vs-default-isa"])
def test_numeric_paths_share_no_snapshots(models, tmp_path, first, second):
    a = models[0]
    shared = str(tmp_path / "shared")
    cold = {}
    for i, (be, kw) in enumerate((first, second)):
        cold[i] = (_gen(_load(a, be, {"disk_dir": str(tmp_path / f"cold{i}")}, **kw))[0],
                   _first_logits(_load(a, be, {"disk_dir": str(tmp_path / f"cold-l{i}")}, **kw))[0])
    paths = [_load(a, be, True, **kw).backend.numeric_path for be, kw in (first, second)]
    assert paths[0] != paths[1]
    for i, (be, kw) in enumerate((first, second)):
        assert _gen(_load(a, be, {"disk_dir": shared}, **kw)) == (cold[i][0], 0)  # the other path's: not found
    for i, (be, kw) in enumerate((first, second)):
        toks, reused = _gen(_load(a, be, {"disk_dir": shared}, **kw))
        assert toks == cold[i][0] and reused == len(IDS)
        lg, reused = _first_logits(_load(a, be, {"disk_dir": shared}, **kw))
        assert reused == len(IDS) and lg.tobytes() == cold[i][1].tobytes()


def test_a_cache_object_of_another_model_or_path_is_refused(models, tmp_path):
    a, b = models
    for spec in (True, {"disk_dir": str(tmp_path / "d")}):
        mine = _load(a, cache=spec).prefix_cache
        assert _load(a, cache=mine).prefix_cache is mine  # the same model and path: shared
        with pytest.raises(SnapshotError, match="keyed"):
            _load(b, cache=mine)
        with pytest.raises(SnapshotError, match="keyed"):
            _load(a, "reference", mine)
    # made by hand with the documented key: accepted, and it checks files against the state layout from then on
    gm = GGUFModel(a)
    eng = _load(a, cache=True)
    fp = model_cache_fingerprint(gm, eng.backend.numeric_path, str(tmp_path / "e"))
    own = PrefixCache(fp, eng.args.layer_types, disk_dir=str(tmp_path / "e"))
    assert _load(a, cache=own).prefix_cache.disk.layout is not None


# the remembered content hash ----------------------------------------------------------------------------------
def test_the_content_hash_is_remembered_per_file_identity(models, tmp_path, monkeypatch):
    src = models[0]
    path = str(tmp_path / "m.gguf")
    with open(src, "rb") as f, open(path, "wb") as g:
        g.write(f.read())
    calls = []
    real_hash = model_key.hash_file
    monkeypatch.setattr(model_key, "hash_file", lambda p, t=None: calls.append(p) or real_hash(p, t))
    d = str(tmp_path / "cache")
    fp1 = _load(path, cache={"disk_dir": d}).prefix_cache.fingerprint
    assert len(calls) == 1
    records = [n for n in os.listdir(d) if n.startswith(model_key.RECORD_PREFIX)]
    assert len(records) == 1
    for _ in range(2):  # later loads (as another process would) read the record
        assert _load(path, cache={"disk_dir": d}).prefix_cache.fingerprint == fp1
    assert len(calls) == 1
    _load(path, cache=True)  # a RAM-only cache hashes nothing
    assert len(calls) == 1
    # the same bytes under a new mtime: hashed again, the same key
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert _load(path, cache={"disk_dir": d}).prefix_cache.fingerprint == fp1
    assert len(calls) == 2
    # new content (one V quant changed in place): hashed again, a new key
    _copy_with_changed_attn_v(src, path)
    fp2 = _load(path, cache={"disk_dir": d}).prefix_cache.fingerprint
    assert len(calls) == 3 and fp2 != fp1
    assert _load(path, cache={"disk_dir": d}).prefix_cache.fingerprint == fp2 and len(calls) == 3
    # a damaged record is absent: hashed again and rewritten
    rec = os.path.join(d, records[0])
    for junk in (b"{not json", json.dumps({"algo": model_key.ALGO, "hash": 5}).encode(), b""):
        with open(rec, "wb") as f:
            f.write(junk)
        n = len(calls)
        assert _load(path, cache={"disk_dir": d}).prefix_cache.fingerprint == fp2
        assert len(calls) == n + 1
    os.unlink(rec)
    os.mkfifo(rec)  # not a regular file: absent (and never read, which would block)
    assert _run_with_timeout(lambda: _load(path, cache={"disk_dir": d}).prefix_cache.fingerprint) == fp2
    assert os.path.isfile(rec)  # replaced by a record
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]


def test_hash_file_reads_in_leaves_and_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(model_key, "LEAF_BYTES", 4096)
    monkeypatch.setattr(model_key, "READ_BYTES", 1000)
    data = np.random.default_rng(1).integers(0, 256, 3 * 4096 + 17, dtype=np.uint8).tobytes()
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    top = hashlib.blake2b(f"{model_key.ALGO}|{len(data)}".encode(), digest_size=32)
    for i in range(0, len(data), 4096):
        top.update(hashlib.blake2b(data[i : i + 4096], digest_size=32).digest())
    assert model_key.hash_file(str(p), 1) == model_key.hash_file(str(p), 3) == top.hexdigest()
    p.write_bytes(b"")
    assert model_key.hash_file(str(p), 2) == hashlib.blake2b(f"{model_key.ALGO}|0".encode(),
                                                             digest_size=32).hexdigest()


# a damaged directory -----------------------------------------------------------------------------------------
def _run_with_timeout(fn, timeout=RUN_TIMEOUT_S):
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # reported in the test's thread
            out["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"the run did not finish in {timeout} s (blocked on the cache directory?)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _rewrite(path: str, edit) -> None:
    """Rewrite a snapshot file with edit(header dict) applied and both checksums valid again."""
    with open(path, "rb") as f:
        raw = f.read()
    magic, version, hlen, _ = snapfile._PRE.unpack_from(raw)
    h = json.loads(raw[snapfile._PRE.size : snapfile._PRE.size + hlen])
    payload = raw[snapfile._align(snapfile._PRE.size + hlen) :]
    edit(h)
    hb = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    pre = snapfile._PRE.pack(magic, version, len(hb), hashlib.blake2b(hb, digest_size=16).digest())
    head = pre + hb
    with open(path, "wb") as f:
        f.write(head + bytes(snapfile._align(len(head)) - len(head)) + payload)


def _array(h: dict, kind: str) -> dict:
    return next(d for d in h["arrays"] if d["kind"] == kind)


def _reshape(kind):
    def edit(h):
        d = _array(h, kind)
        d["shape"] = [d["shape"][0], int(np.prod(d["shape"][1:])) // 2, 2] if kind == "k" else d["shape"][::-1]
    return edit


def _retype(h):
    _array(h, "conv")["dtype"] = "<i4"


def _short_logits(h):
    d = _array(h, "logits")
    d["shape"], d["nbytes"] = [d["shape"][0] - 10], d["nbytes"] - 40


def _no_logits(h):
    h["arrays"] = [d for d in h["arrays"] if d["kind"] != "logits"]


def _bad_tokens(path: str) -> None:
    """A well-formed, checksummed file whose tokens are not those its key names."""
    hdr, snap = snapfile.load_file(path)
    meta = {"fingerprint": hdr.fingerprint, "layer_types": list(hdr.layer_types), "block_size": hdr.block_size}
    snap = snap.in_ram()
    os.unlink(path)
    tokens = snap.tokens.copy()
    tokens[-1] = (tokens[-1] + 1) % SHAPE["n_vocab"]
    snapfile.write_file(os.path.dirname(path), dataclasses.replace(snap, tokens=tokens), meta)


def _garbage_header(path: str) -> None:
    """Our magic and format version, then a header that is not what its checksum says."""
    with open(path, "wb") as f:
        f.write(snapfile._PRE.pack(snapfile.MAGIC, snapfile.VERSION, 100, bytes(16)) + os.urandom(300))


def _not_a_snapshot(path: str) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(300))


def _fifo(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path)


def _directory(path: str) -> None:
    os.unlink(path)
    os.makedirs(os.path.join(path, "inside"))  # not empty: it cannot be removed, so it is reported once


def _link_to_fifo(path: str) -> None:
    target = path + ".target-fifo"  # a name the store does not read
    os.mkfifo(target)
    os.unlink(path)
    os.symlink(target, path)


def _link_to_device(path: str) -> None:
    os.unlink(path)
    os.symlink("/dev/zero", path)


def _dangling_link(path: str) -> None:
    os.unlink(path)
    os.symlink(path + ".nothing", path)


DAMAGE = {
    "fifo": _fifo,
    "directory": _directory,
    "symlink to a fifo": _link_to_fifo,
    "symlink to a device": _link_to_device,
    "dangling symlink": _dangling_link,
    "garbage header": _garbage_header,
    "not a snapshot": _not_a_snapshot,
    "wrong K shape": lambda p: _rewrite(p, _reshape("k")),
    "wrong conv shape": lambda p: _rewrite(p, _reshape("conv")),
    "wrong dtype": lambda p: _rewrite(p, _retype),
    "short logits": lambda p: _rewrite(p, _short_logits),
    "missing logits": lambda p: _rewrite(p, _no_logits),
    "other tokens": _bad_tokens,
    "truncated": lambda p: os.truncate(p, os.path.getsize(p) - 64),
}
REMOVABLE = set(DAMAGE) - {"directory"}


@pytest.fixture(scope="module")
def cold_a(models, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("cold"))
    return _gen(_load(models[0], cache={"disk_dir": d}))[0]


def _prompt_snapshot(d: str, eng) -> str:
    """Path of the snapshot at the end of the prompt (the one the next run of IDS restores)."""
    hit = eng.prefix_cache.lookup(IDS)
    assert hit is not None and hit.pos == len(IDS) and hit.has_logits
    return os.path.join(d, hit.key + ".snap")


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_entry_is_a_miss_and_never_blocks(models, cold_a, tmp_path, how):
    d = str(tmp_path / "cache")
    eng = _load(models[0], cache={"disk_dir": d, "ram_bytes": 0})
    assert _gen(eng) == (cold_a, 0)
    victim = _prompt_snapshot(d, eng)
    DAMAGE[how](victim)
    stray = os.path.join(d, "0" * 32 + ".snap")  # and a FIFO under a name no prompt asks for
    os.mkfifo(stray)

    def warm():
        return _gen(_load(models[0], cache={"disk_dir": d}))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        toks, reused = _run_with_timeout(warm)
    assert toks == cold_a
    assert reused == 32  # the damaged snapshot missed; its parent (the stride snapshot at 32) served
    msgs = [str(w.message) for w in caught if issubclass(w.category, SnapshotWarning)]
    assert any(os.path.basename(victim) in m for m in msgs), msgs
    assert any(os.path.basename(stray) in m for m in msgs), msgs
    assert not os.path.lexists(stray)
    if how in REMOVABLE:  # removed, and written anew by the run's own snapshot at the end of the prompt
        assert os.path.isfile(victim) and not os.path.islink(victim)
        hdr, snap = snapfile.load_file(victim)
        assert snap.logits.shape == (SHAPE["n_vocab"],) and snap.tokens.tolist() == IDS[snap.kv_from :]
    else:
        assert os.path.isdir(victim)
    if how == "directory":  # what cannot be removed is reported once by a cache, not on every scan
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            eng = _load(models[0], cache={"disk_dir": d, "ram_bytes": 0, "disk_rescan_s": 0.0})
            assert [_run_with_timeout(lambda: _gen(eng)) for _ in range(3)] == [(cold_a, 32)] * 3
        assert len([w for w in again if os.path.basename(victim) in str(w.message)]) == 1
    else:  # the run saved a good snapshot in its place: the next one reuses the whole prompt
        assert _run_with_timeout(warm) == (cold_a, len(IDS))


def test_an_unreadable_file_is_a_miss(models, cold_a, tmp_path, monkeypatch):
    """Permission denied (as a non-root user on a file of mode 000), simulated: this suite may run as root."""
    d = str(tmp_path / "cache")
    eng = _load(models[0], cache={"disk_dir": d, "ram_bytes": 0})
    _gen(eng)
    victim = _prompt_snapshot(d, eng)
    real_open = os.open

    def deny(path, flags, *a, **kw):
        if os.fspath(path) == victim:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *a, **kw)

    ino = os.stat(victim).st_ino
    monkeypatch.setattr(os, "open", deny)
    with pytest.warns(SnapshotWarning, match="unreadable"):
        assert _run_with_timeout(lambda: _gen(_load(models[0], cache={"disk_dir": d}))) == (cold_a, 32)
    assert os.stat(victim).st_ino != ino  # removed, then written anew by the run (through os.replace)

"""The model half of a snapshot's key: what makes two GGUF files interchangeable for the prefix cache.

A snapshot restored into another model's run would print that model's answer, and a fine-tune differs from its
base only in tensor data (the same metadata, layout and, often, most tensors), so a directory shared by processes
and models keys snapshots by a hash of the whole file (`content_key`). Hashing a multi-GB file takes seconds,
so the digest is remembered in the cache directory, one record per model path (`.model-<hash of path>.json`,
written atomically), valid while the file's identity (device, inode, size, mtime_ns, ctime_ns) is unchanged: the
next process to open the same file reads the record instead of the file. A record that is damaged, of another
identity or not a regular file counts as absent.

A RAM-only cache lives in one process, where the file's identity names its content, so `identity_key` is enough.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

from ...errors import SnapshotError
from .disk import TMP_PREFIX, SnapshotWarning

ALGO = "blake2b-256/tree-64MiB/v1"  # a record of another algorithm is not ours to trust
LEAF_BYTES = 64 << 20  # part of ALGO: the digest depends on the leaf size
READ_BYTES = 8 << 20  # per read call, so each hashing thread holds one such buffer
RECORD_PREFIX = ".model-"
_MAX_RECORD = 1 << 16
_HEX64 = re.compile(r"[0-9a-f]{64}")


def file_identity(path: str) -> tuple[int, ...]:
    """(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) of the file `path` names (symlinks followed): a file
    rewritten or replaced changes at least one of them."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def identity_key(path: str, fingerprint: str) -> str:
    """A cheap model key for a cache that lives in this process: the metadata fingerprint and the file's identity
    (distinct files never share it; a changed file gets a new one)."""
    real = os.path.realpath(path)
    text = f"hybridinfer-model-identity|{fingerprint}|{real}|{file_identity(real)}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# hashing ------------------------------------------------------------------------------------------------------
def _leaf(fd: int, off: int, n: int, local: threading.local) -> bytes:
    buf = getattr(local, "buf", None)
    if buf is None:
        buf = local.buf = bytearray(READ_BYTES)
    h = hashlib.blake2b(digest_size=32)
    mv = memoryview(buf)
    end = off + n
    while off < end:
        got = os.preadv(fd, [mv[: min(READ_BYTES, end - off)]], off)
        if got <= 0:
            raise OSError(f"the file ended at byte {off} while it was hashed (it changed)")
        h.update(mv[:got])  # hashlib drops the GIL for large buffers: leaves hash in parallel
        off += got
    return h.digest()


def hash_file(path: str, threads: int | None = None) -> str:
    """blake2b-256 over the digests of the file's 64 MiB leaves, hashed by `threads` threads (default: up to 8
    cores). Reads with pread into one 8 MiB buffer per thread: memory stays bounded for any file size."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        offs = range(0, size, LEAF_BYTES)
        n_threads = max(1, min(threads or min(8, os.cpu_count() or 1), len(offs) or 1))
        local = threading.local()
        if n_threads == 1:
            leaves = [_leaf(fd, o, min(LEAF_BYTES, size - o), local) for o in offs]
        else:
            with ThreadPoolExecutor(n_threads) as ex:
                leaves = list(ex.map(lambda o: _leaf(fd, o, min(LEAF_BYTES, size - o), local), offs))
    finally:
        os.close(fd)
    top = hashlib.blake2b(f"{ALGO}|{size}".encode(), digest_size=32)
    for d in leaves:
        top.update(d)
    return top.hexdigest()


# remembered digests -------------------------------------------------------------------------------------------
def record_path(hash_dir: str, real: str) -> str:
    return os.path.join(hash_dir, RECORD_PREFIX + hashlib.blake2b(real.encode(), digest_size=16).hexdigest()
                        + ".json")


def _read_record(rec: str, real: str, ident: tuple) -> str | None:
    """The remembered digest, or None when the record is absent, unreadable, damaged or of another file."""
    try:
        fd = os.open(rec, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO must not block
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_RECORD:
            return None
        h = json.loads(os.read(fd, _MAX_RECORD + 1))
        digest = h["hash"]
        ok = (h["algo"] == ALGO and h["path"] == real and tuple(h["identity"]) == tuple(ident)
              and isinstance(digest, str) and _HEX64.fullmatch(digest) is not None)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
    return digest if ok else None


def _write_record(rec: str, real: str, ident: tuple, digest: str) -> None:
    """Atomically (temp file, rename) remember `digest`; a failure only costs the next process a hash."""
    d = os.path.dirname(rec)
    body = json.dumps({"algo": ALGO, "path": real, "identity": list(ident), "hash": digest}).encode()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}model-", suffix=".part", dir=d)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, rec)
        tmp = None
    except OSError as e:
        warnings.warn(f"prefix cache: cannot remember the model's hash in {d}: {e}", SnapshotWarning, stacklevel=3)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def content_digest(path: str, hash_dir: str | None = None, threads: int | None = None) -> str:
    """The digest of the file's bytes, read from `hash_dir`'s record when it is there for this identity of the
    file, else hashed (and, with hash_dir, remembered)."""
    real = os.path.realpath(path)
    ident = file_identity(real)
    rec = None
    if hash_dir is not None:
        try:
            os.makedirs(hash_dir, exist_ok=True)
            rec = record_path(hash_dir, real)
        except OSError:
            pass  # the disk store reports an unusable directory itself
    if rec is not None and (got := _read_record(rec, real, ident)) is not None:
        return got
    digest = hash_file(real, threads)
    if rec is not None and file_identity(real) == ident:  # a file changed while hashed is not remembered
        _write_record(rec, real, ident, digest)
    return digest


def content_key(path: str, fingerprint: str, hash_dir: str | None = None, threads: int | None = None) -> str:
    """The model key for a cache shared by processes and models: the metadata fingerprint and the digest of every
    byte of the file (every tensor's data)."""
    try:
        digest = content_digest(path, hash_dir, threads)
    except OSError as e:
        raise SnapshotError(f"cannot hash the model file {path!r} for the prefix cache: {e}") from e
    text = f"hybridinfer-model-content|{fingerprint}|{digest}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

"""The on-disk snapshot store: one file per snapshot in a directory that several processes may share.

Files are `<key hex>.snap` (format in snapshot.py), written atomically (temp file `.tmp-*` in the same
directory, fsync, rename, fsync of the directory), so a reader sees a whole file or none; a writer killed
mid-write leaves only a temp file, which readers ignore and a scan removes once it is `tmp_max_age_s` old.

The in-process index is rebuilt from headers alone (the payload is not read): at most every `rescan_s` seconds
and whenever the directory's mtime changed (a file was added, replaced or removed). Payloads are mapped lazily
and their checksum is verified on first use, then every array's dtype and shape against this model's state layout
(layout.py). A damaged file (bad header, truncated, payload checksum mismatch, arrays that do not fit the state, a
logits vector of the wrong length) and anything else under a snapshot's name (a FIFO, a device, a directory, a
symlink to one or to nothing, a file we may not read) is reported with a SnapshotWarning, removed where possible
(else remembered, so it is reported once) and counted as a miss: nothing in the directory can block or fail a
run. Files are opened with O_NONBLOCK and checked with fstat, so a FIFO cannot hang a reader. A file of another
model (fingerprint), block size or format version is a miss and left alone. Files vanishing under us (another
process evicted them) are misses.

Like the RAM store, the directory is closed under ancestors: a file's parent is written before it and eviction
takes only leaves, least recently used first by file mtime (touched on every use). Files of every model in the
directory count against `budget`, which holds after each write of this process (writers racing in several
processes may briefly overshoot by the files in flight).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass

from ...errors import SnapshotError
from ...format.files import describe_mode
from .index import BlockIndex, Entry
from .layout import StateLayout, check_snapshot
from .snapshot import FileHeader, Snapshot, file_size, load_file, read_header, write_file

SNAP_RE = re.compile(r"^([0-9a-f]{32})\.snap$")
TMP_PREFIX = ".tmp-"
# errors that say nothing about the file (the process or the system is short of something): a plain miss
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN, errno.EBUSY}


class SnapshotWarning(UserWarning):
    """A damaged or foreign entry was found in the snapshot directory and removed where possible (a miss)."""


@dataclass(frozen=True)
class DiskEntry:
    key: bytes
    parent: bytes | None
    pos: int
    kv_from: int
    size: int
    ident: tuple
    ours: bool
    has_logits: bool


def _ident(st) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size)


class DiskStore:
    def __init__(self, directory: str, fingerprint: str, layer_types, block_size: int, budget: int | None = None,
                 rescan_s: float = 1.0, tmp_max_age_s: float = 600.0, keep_mapped: int = 16,
                 layout: StateLayout | None = None):
        self.dir = os.path.abspath(directory)
        os.makedirs(self.dir, exist_ok=True)
        self.meta = {"fingerprint": fingerprint, "layer_types": list(layer_types), "block_size": int(block_size)}
        self.budget = None if budget is None else int(budget)
        self.layer_types, self.layout = tuple(layer_types), layout
        self.rescan_s, self.tmp_max_age_s, self.keep_mapped = rescan_s, tmp_max_age_s, keep_mapped
        self.entries: dict[bytes, DiskEntry] = {}  # every readable snapshot file in the directory
        self.index = BlockIndex()  # this model's
        self._mapped: OrderedDict[bytes, tuple[tuple, Snapshot]] = OrderedDict()  # verified, mapped payloads
        self._bad: dict[bytes, tuple] = {}  # damaged entries we could not remove, by ident: reported once
        self._dir_mtime: int | None = None
        self._scan_t = float("-inf")
        self.evictions = self.damaged = 0
        self.refresh(force=True)

    # index ------------------------------------------------------------------------------------------------
    def path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + ".snap")

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def _ours(self, hdr: FileHeader) -> bool:
        m = self.meta
        return (hdr.fingerprint == m["fingerprint"] and hdr.block_size == m["block_size"]
                and list(hdr.layer_types) == m["layer_types"])

    def _add(self, hdr: FileHeader) -> None:
        ours = self._ours(hdr)
        self.entries[hdr.key] = DiskEntry(hdr.key, hdr.parent, hdr.pos, hdr.kv_from, hdr.ident[2], hdr.ident, ours,
                                          hdr.has_logits)
        if ours:
            self.index.add(Entry(key=hdr.key, pos=hdr.pos, block_key=hdr.block_key, tail=hdr.tail,
                                 seg_blocks=hdr.seg_blocks, has_logits=hdr.has_logits))
        else:
            self.index.remove(hdr.key)

    def _forget(self, key: bytes) -> None:
        self.entries.pop(key, None)
        self.index.remove(key)
        self._mapped.pop(key, None)

    @staticmethod
    def _remove(path: str, ident: tuple | None) -> OSError | None:
        """Remove `path` unless it was replaced by another file since we looked (ident differs); an empty
        directory under a snapshot's name goes too. The error when it could not be removed, else None."""
        try:
            if ident is not None and _ident(os.stat(path)) != ident:
                return None
            try:
                os.unlink(path)
            except (IsADirectoryError, PermissionError):  # unlink(2) of a directory says EISDIR or EPERM
                if not os.path.isdir(path) or os.path.islink(path):
                    raise
                os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            return e
        return None

    def _unlink(self, path: str, ident: tuple | None) -> None:
        err = self._remove(path, ident)
        if err is not None:
            warnings.warn(f"prefix cache: cannot remove {path}: {err}", SnapshotWarning, stacklevel=3)

    def _damaged(self, path: str, key: bytes | None, err, ident: tuple | None) -> None:
        failed = self._remove(path, ident)
        what = "removed" if failed is None else f"could not remove it ({failed}), ignored"
        warnings.warn(f"prefix cache: damaged snapshot entry {path}: {err}; {what}", SnapshotWarning, stacklevel=3)
        self.damaged += 1
        if key is not None:
            self._forget(key)
            if failed is not None and ident is not None:
                self._bad[key] = ident

    def _unreadable(self, path: str, key: bytes, err: OSError, ident: tuple | None) -> None:
        """An error opening or reading an entry: damaged unless it is the system's, not the file's, fault."""
        if err.errno in _TRANSIENT:
            return
        self._damaged(path, key, f"unreadable ({err.strerror or err})", ident)

    def refresh(self, force: bool = False) -> None:
        """Re-read the directory when it changed (mtime) or `rescan_s` passed; only new files' headers are read."""
        try:
            m = os.stat(self.dir).st_mtime_ns
        except FileNotFoundError:
            os.makedirs(self.dir, exist_ok=True)
            m = os.stat(self.dir).st_mtime_ns
        now = time.monotonic()
        if force or m != self._dir_mtime or now - self._scan_t >= self.rescan_s:
            self._scan(m, now)

    def _scan(self, dir_mtime: int, now: float) -> None:
        self._dir_mtime, self._scan_t = dir_mtime, now
        seen, old_bad, self._bad = set(), self._bad, {}
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name.startswith(TMP_PREFIX):
                self._maybe_remove_tmp(path)
                continue
            mt = SNAP_RE.match(name)
            if mt is None:
                continue
            key = bytes.fromhex(mt.group(1))
            try:
                st = os.stat(path)
            except FileNotFoundError:
                if os.path.islink(path):
                    self._damaged(path, key, "a symlink to nothing", None)
                continue
            except OSError as err:  # e.g. a symlink loop
                self._unreadable(path, key, err, None)
                continue
            ident = _ident(st)
            if old_bad.get(key) == ident:  # reported already and still there
                self._bad[key] = ident
                continue
            e = self.entries.get(key)
            if e is not None and e.ident == ident:
                seen.add(key)
                continue
            self._forget(key)
            if not stat.S_ISREG(st.st_mode):  # never opened: a FIFO or device must not be read at all
                self._damaged(path, key, f"not a regular file ({describe_mode(st.st_mode)})", ident)
                continue
            try:
                hdr = read_header(path)
            except FileNotFoundError:
                continue
            except SnapshotError as err:
                self._damaged(path, key, err, ident)
                continue
            except OSError as err:
                self._unreadable(path, key, err, ident)
                continue
            if hdr is None:
                continue  # another format version
            if hdr.key != key:
                self._damaged(path, key, "its header names another key", ident)
                continue
            self._add(hdr)
            seen.add(key)
        for key in [k for k in self.entries if k not in seen]:
            self._forget(key)
        self._drop_orphans()

    def _drop_orphans(self) -> None:
        """Remove files whose parent is gone (evicted by a process racing with their write, or damaged): they
        can never be restored. A parent missing from the listing is looked up once more before."""
        while True:
            orphans = [k for k, e in self.entries.items() if e.parent is not None and e.parent not in self.entries
                       and not os.path.exists(self.path(e.parent))]
            if not orphans:
                return
            for k in orphans:
                self.drop_broken(k)

    def _maybe_remove_tmp(self, path: str) -> None:
        try:
            if time.time() - os.stat(path).st_mtime > self.tmp_max_age_s:
                os.unlink(path)
        except OSError:
            pass

    def chain_keys(self, key: bytes | None) -> list[bytes] | None:
        """`key` and its ancestors, leaf first, per the index; None when one is missing."""
        out = []
        while key is not None:
            e = self.entries.get(key)
            if e is None or len(out) > len(self.entries):
                return None
            out.append(key)
            key = e.parent
        return out

    def chain_bytes(self, key: bytes | None) -> int:
        return sum(self.entries[k].size for k in self.chain_keys(key) or ())

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    # data -------------------------------------------------------------------------------------------------
    def load(self, key: bytes) -> Snapshot | None:
        """The snapshot stored under `key`, its payload mapped and verified; None when absent, damaged (then
        removed, with a warning) or another model's."""
        path = self.path(key)
        try:
            ident = _ident(os.stat(path))
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as err:
            self._unreadable(path, key, err, None)
            return None
        if self._bad.get(key) == ident:
            return None
        got = self._mapped.get(key)
        if got is not None and got[0] == ident:
            self._mapped.move_to_end(key)
            return got[1]
        try:
            res = load_file(path)
        except FileNotFoundError:
            self._forget(key)
            return None
        except (SnapshotError, ValueError) as err:
            self._damaged(path, key, err, ident)
            return None
        except OSError as err:
            self._unreadable(path, key, err, ident)
            return None
        if res is None:
            return None
        hdr, snap = res
        if hdr.key != key:
            self._damaged(path, key, "its header names another key", hdr.ident)
            return None
        if not self._ours(hdr):
            return None  # another model's file: a miss
        try:
            if hdr.has_logits != (snap.logits is not None):
                raise SnapshotError("its header and its arrays disagree on the logits")
            check_snapshot(snap, self.layer_types, self.layout)
        except SnapshotError as err:
            self._damaged(path, key, err, hdr.ident)
            return None
        if key not in self.entries or self.entries[key].ident != hdr.ident:
            self._add(hdr)
        self._mapped[key] = (hdr.ident, snap)
        while len(self._mapped) > self.keep_mapped:
            self._mapped.popitem(last=False)
        return snap

    def reject(self, key: bytes, why: str) -> None:
        """Treat the file of `key`, read and verified already, as damaged (a check above this store failed)."""
        e = self.entries.get(key)
        self._damaged(self.path(key), key, why, e.ident if e is not None else None)

    def drop_broken(self, key: bytes) -> None:
        """Remove a file whose parent is gone (an eviction in another process raced with its write)."""
        e = self.entries.get(key)
        self._unlink(self.path(key), e.ident if e is not None else None)
        self._forget(key)

    def touch(self, keys) -> None:
        for k in keys:
            if k in self.entries:
                try:
                    os.utime(self.path(k))
                except OSError:
                    pass

    def size_of(self, snap: Snapshot) -> int:
        return file_size(snap, self.meta)

    def fits(self, size: int, parent: bytes | None) -> bool:
        chain = self.chain_keys(parent)
        return chain is not None and (self.budget is None or size + self.chain_bytes(parent) <= self.budget)

    def _make_room(self, need: int, protect: set[bytes]) -> bool:
        total = self.bytes
        if self.budget is None or total + need <= self.budget:
            return True
        stamp = {}
        for k in list(self.entries):
            try:
                stamp[k] = os.stat(self.path(k)).st_mtime_ns
            except FileNotFoundError:
                self._forget(k)
        total = self.bytes
        children: dict[bytes, int] = {}
        for e in self.entries.values():
            if e.parent is not None:
                children[e.parent] = children.get(e.parent, 0) + 1
        order = sorted(stamp, key=stamp.__getitem__)
        while total + need > self.budget:
            victim = next((k for k in order if k in self.entries and not children.get(k) and k not in protect), None)
            if victim is None:
                return False
            order.remove(victim)
            e = self.entries[victim]
            self._unlink(self.path(victim), e.ident)
            self._forget(victim)
            total -= e.size
            self.evictions += 1
            if e.parent is not None:
                children[e.parent] -= 1
        return True

    def write(self, snap: Snapshot) -> bool:
        """Write `snap` (its parent must be on disk), evicting LRU leaf files outside its chain first so the
        directory stays within budget; False when it cannot fit or the write failed."""
        self.refresh(force=True)
        if snap.key in self._bad:  # something we could not remove holds the name (reported already)
            return False
        size = self.size_of(snap)
        chain = self.chain_keys(snap.parent)
        if chain is None or not self.fits(size, snap.parent):
            return False
        old = self.entries.get(snap.key)
        if not self._make_room(size - (old.size if old is not None else 0), {*chain, snap.key}):
            return False
        try:
            path = write_file(self.dir, snap, self.meta)
            ident = _ident(os.stat(path))
        except OSError as e:
            warnings.warn(f"prefix cache: cannot write a snapshot to {self.dir}: {e}", SnapshotWarning,
                          stacklevel=3)
            return False
        self._mapped.pop(snap.key, None)
        self.entries[snap.key] = DiskEntry(snap.key, snap.parent, snap.pos, snap.kv_from, ident[2], ident, True,
                                           snap.logits is not None)
        self.index.add(Entry(key=snap.key, pos=snap.pos, block_key=snap.block_key, tail=snap.tail,
                             seg_blocks=snap.seg_blocks, has_logits=snap.logits is not None))
        self.touch(chain)
        return True

    def clear(self) -> None:
        """Remove this model's files (other models' files in a shared directory stay)."""
        self.refresh(force=True)
        for k, e in list(self.entries.items()):
            if e.ours:
                self._unlink(self.path(k), e.ident)
                self._forget(k)

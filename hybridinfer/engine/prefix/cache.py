"""PrefixCache: reuse the decoder state of a prompt's longest cached prefix.

    cache = PrefixCache(fingerprint, layer_types, block_size=16, ram_bytes=2 << 30, disk_dir=None, disk_bytes=None,
                        state_layout=StateLayout.of_state(state, n_vocab))
    key = cache.save(state, logits)           # snapshot of `state` at state.pos (copied)
    hit = cache.lookup(tokens, max_pos)       # Hit(pos, key, has_logits) or None
    logits = cache.restore(hit, state)        # into state's own buffers; the stored logits or None

The GDN recurrent state cannot be truncated, so a prompt resumes only from a position where a snapshot was taken:
the deepest p <= max_pos with tokens[:p] cached. Snapshots live in RAM (LRU, `ram_bytes`) and, with `disk_dir`,
also in a directory shared by processes (`disk_bytes`, None: unbounded); a lookup takes the deepest snapshot of
either and copies a disk hit into RAM. Along one token chain each K/V row is stored once per store: a snapshot
keeps the rows after its deepest cached ancestor in that store (see snapshot.py). One lock makes a cache safe to
share between threads; restore copies outside it (a Hit holds the arrays it needs).

`fingerprint` names the model and the numeric path that made the snapshots (api.model_cache_fingerprint); only
snapshots of the same fingerprint, layer layout and block size are ever found. `state_layout` lets the disk store
check a file's arrays before they are restored (a file that does not fit is a miss, removed); a hit's tokens are
checked against the prompt as well.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...errors import SnapshotError
from .disk import DiskStore
from .index import KeyChain, as_tokens, known_blocks, root_key, walk, with_images
from .layout import StateLayout
from .ram import RamStore
from .snapshot import Snapshot, from_state, recurrent_bytes, restore_chain, row_bytes


@dataclass(frozen=True)
class Hit:
    pos: int  # tokens[:pos] are restored
    key: str  # the snapshot's key, hex
    has_logits: bool  # restore returns the logits of token pos - 1 (an exact repeat needs no compute)
    _chain: tuple = field(default=(), repr=False, compare=False)


class PrefixCache:
    def __init__(self, fingerprint: str, layer_types: tuple, block_size: int = 16, ram_bytes: int = 2 << 30,
                 disk_dir: str | None = None, disk_bytes: int | None = None, *, disk_rescan_s: float = 1.0,
                 tmp_max_age_s: float = 600.0, state_layout: StateLayout | None = None):
        if int(block_size) < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if ram_bytes is None or int(ram_bytes) < 0:
            raise ValueError(f"ram_bytes must be >= 0, got {ram_bytes}")
        if disk_bytes is not None and int(disk_bytes) < 0:
            raise ValueError(f"disk_bytes must be >= 0 or None, got {disk_bytes}")
        self.fingerprint, self.layer_types, self.block_size = str(fingerprint), tuple(layer_types), int(block_size)
        if state_layout is not None and tuple(state_layout.layer_types) != self.layer_types:
            raise SnapshotError(f"the state layout's layers {state_layout.layer_types} are not {self.layer_types}")
        self.state_layout = state_layout
        self.root = root_key(self.fingerprint, self.layer_types, self.block_size)
        self.ram = RamStore(int(ram_bytes))
        self.disk = None
        if disk_dir:
            self.disk = DiskStore(str(disk_dir), self.fingerprint, self.layer_types, self.block_size, disk_bytes,
                                  rescan_s=disk_rescan_s, tmp_max_age_s=tmp_max_age_s, layout=state_layout)
        self._lock = threading.RLock()
        self._pending: list[bytes] = []  # keys whose disk copy waits for flush()
        self._counters = self._zero()

    def use_layout(self, layout: StateLayout) -> None:
        """Check snapshot files against `layout` from now on (for a cache made without one); SnapshotError when
        the cache was made for a state of another layout."""
        if self.state_layout is not None and self.state_layout != layout:
            raise SnapshotError("this prefix cache was made for a decoder state of another layout")
        if tuple(layout.layer_types) != self.layer_types:
            raise SnapshotError(f"the state layout's layers {layout.layer_types} are not {self.layer_types}")
        self.state_layout = layout
        if self.disk is not None:
            self.disk.layout = layout

    @staticmethod
    def _zero() -> dict:
        return {"hits": 0, "misses": 0, "reused_tokens": 0, "restore_s": 0.0, "saves": 0, "save_s": 0.0}

    def _check_layout(self, state) -> None:
        if tuple(state.layer_types) != self.layer_types:
            raise SnapshotError(f"the state's layer layout {tuple(state.layer_types)} is not this cache's "
                                f"{self.layer_types}")

    def _indexes(self) -> list:
        """The RAM index and (re-scanned if the directory changed) the disk index; call with the lock held."""
        if self.disk is not None:
            self.disk.refresh()
        return [self.ram.index] + ([self.disk.index] if self.disk is not None else [])

    # lookup ----------------------------------------------------------------------------------------------
    def _resolve(self, key: bytes) -> list[Snapshot] | None:
        """The snapshot `key` and its ancestors, root first, each from RAM or else from disk (verified); None
        when one is missing or damaged (a disk file whose parent is gone is removed)."""
        chain: list[Snapshot] = []
        child_on_disk = False
        while key is not None:
            s, on_disk = self.ram.get(key), False
            if s is None and self.disk is not None:
                s, on_disk = self.disk.load(key), True
            if s is None or (chain and s.pos != chain[-1].kv_from):
                if chain and child_on_disk:
                    self.disk.drop_broken(chain[-1].key)
                return None
            chain.append(s)
            child_on_disk = on_disk
            key = s.parent
        chain.reverse()
        return chain

    def _tokens_match(self, chain: list[Snapshot], t: np.ndarray) -> bool:
        """Whether the chain's tokens are the prompt's (keys name token prefixes, but a file's arrays are only
        checksummed: a well-formed file may still hold other tokens); a mismatching snapshot is dropped."""
        for s in chain:
            if not np.array_equal(s.tokens, t[s.kv_from : s.pos]):
                if self.ram.get(s.key) is s:
                    self.ram.remove(s.key)
                elif self.disk is not None:
                    self.disk.reject(s.key, "its tokens are not those its key names")
                return False
        return True

    def _promote(self, chain: list[Snapshot]) -> None:
        """Copy the disk-held part of a chain into RAM, root first, as far as the budget allows."""
        for s in chain:
            if s.key in self.ram:
                continue
            if not self.ram.fits(s.nbytes, s.parent) or not self.ram.put(s.in_ram()):
                return

    def _root(self, salt: str | None) -> bytes:
        """The key of the empty prefix of one tenant: snapshots saved under a salt are found only with it."""
        return self.root if salt is None else root_key(f"{self.fingerprint}|tenant:{salt}", self.layer_types,
                                                       self.block_size)

    def lookup(self, tokens: Sequence[int] | np.ndarray, max_pos: int | None = None,
               salt: str | None = None) -> Hit | None:
        """The cached snapshot with the largest pos <= max_pos (default len(tokens)) whose tokens are
        tokens[:pos], or None (pos 0 is never a hit). Touches the snapshot and its ancestors. salt: a tenant's
        name (e.g. a hash of an API key): only snapshots saved with the same salt are found."""
        t = as_tokens(tokens)
        mp = len(t) if max_pos is None else min(int(max_pos), len(t))
        with self._lock:
            if mp >= 1:
                indexes = self._indexes()
                for e in walk(indexes, KeyChain(self._root(salt), t, self.block_size), mp):
                    chain = self._resolve(e.key)
                    if chain is None or not self._tokens_match(chain, t):
                        continue
                    keys = [s.key for s in chain]
                    self.ram.touch_keys(keys)
                    if self.disk is not None:
                        self.disk.touch(keys)
                        self._promote(chain)
                    last = chain[-1]
                    return Hit(last.pos, last.key.hex(), last.logits is not None, tuple(chain))
            self._counters["misses"] += 1
            return None

    def known_prefix(self, tokens: Sequence[int] | np.ndarray, salt: str | None = None) -> int:
        """Length (a multiple of block_size) of the longest prefix of `tokens` that a cached snapshot's tokens
        also start with. Where a new prompt leaves such a prefix, another prompt shared it: a snapshot there
        serves the next prompt that shares it too (a system prompt followed by varied questions)."""
        t = as_tokens(tokens)
        kc = KeyChain(self._root(salt), t, self.block_size)
        with self._lock:
            return known_blocks(self._indexes(), kc, len(t)) * self.block_size

    def restore(self, hit: Hit, state, copy=None) -> np.ndarray | None:
        """Write the snapshot's tokens, K/V rows, conv and S states and pos into `state`'s existing buffers (with
        copy(dsts, srcs), the backend's copy, if given); returns a copy of the stored logits of token hit.pos - 1,
        or None."""
        self._check_layout(state)
        chain = list(hit._chain)
        if not chain:
            with self._lock:
                chain = self._resolve(bytes.fromhex(hit.key))
            if chain is None:
                raise SnapshotError(f"snapshot {hit.key} (position {hit.pos}) is no longer cached")
        t0 = time.perf_counter()
        restore_chain(chain, state, copy)
        dt = time.perf_counter() - t0
        with self._lock:
            c = self._counters
            c["hits"] += 1
            c["reused_tokens"] += chain[-1].pos
            c["restore_s"] += dt
        lg = chain[-1].logits
        return None if lg is None else np.array(lg)

    # save ------------------------------------------------------------------------------------------------
    def save(self, state, logits: np.ndarray | None = None, defer_disk: bool = False,
             salt: str | None = None, copied=None) -> str | None:
        """Snapshot `state` at state.pos (its data is copied: by copied(arrays), the backend's, if given) with the
        logits of its last token (optional); returns the key (hex), or None at pos 0. Already cached: only touched
        (and given the logits if it had none). defer_disk: when the snapshot is in RAM, its disk copy is written by
        the next flush() (so a prompt's time to first token does not include file writes and fsyncs). salt: as
        lookup's."""
        self._check_layout(state)
        p = int(state.pos)
        if p <= 0:
            return None
        t0 = time.perf_counter()
        kc = KeyChain(self._root(salt), with_images(state.tokens[:p], getattr(state, "images", ())), self.block_size)
        with self._lock:
            bkey, tail, key = kc.locate(p)
            created = False
            if self.ram.budget > 0:
                created |= self._save_ram(state, kc, bkey, tail, key, logits, copied)
            if self.disk is not None:
                if defer_disk and key in self.ram:
                    self._pending.append(key)
                else:
                    created |= self._save_disk(state, kc, bkey, tail, key, logits)
            self._counters["saves"] += int(created)
            self._counters["save_s"] += time.perf_counter() - t0
        return key.hex()

    def flush(self) -> int:
        """Write the deferred disk copies (oldest first, each after its RAM ancestors); returns how many files
        were written. Snapshots evicted from RAM meanwhile are skipped."""
        if self.disk is None:
            return 0
        with self._lock:
            keys, self._pending = self._pending, []
            written = 0
            for key in keys:
                chain = []
                k = key
                while k is not None and (s := self.ram.get(k)) is not None:
                    chain.append(s)
                    k = s.parent
                if k is not None:  # an ancestor left RAM: this chain cannot be written as it is
                    continue
                for s in reversed(chain):
                    if s.key in self.disk:
                        continue
                    if not self.disk.write(s):
                        break
                    written += 1
            return written

    def _save_ram(self, state, kc, bkey, tail, key, logits, copied=None) -> bool:
        ram, p = self.ram, state.pos
        old = ram.get(key)
        if old is not None:
            if logits is not None and old.logits is None:
                ram.put(old.with_logits(np.array(logits, dtype=np.float32).reshape(-1)))
            ram.touch(key)
            return False
        rec, row = recurrent_bytes(state), row_bytes(state)
        lg = 0 if logits is None else 4 * int(np.size(logits))
        # the deepest cached ancestor whose chain leaves room, else a self-contained snapshot
        for e in [*walk([ram.index], kc, p - 1), None]:
            pkey, ppos = (None, 0) if e is None else (e.key, e.pos)
            if ram.fits(rec + (p - ppos) * row + lg, pkey):
                snap = from_state(state, key=key, block_key=bkey, tail=tail, parent=pkey, kv_from=ppos,
                                  seg_blocks=kc.seg_blocks(ppos, p), logits=logits, tokens=kc.tokens,
                                  copied=copied)
                return ram.put(snap)
        return False

    def _save_disk(self, state, kc, bkey, tail, key, logits) -> bool:
        d, p = self.disk, state.pos
        d.refresh()
        if key in d:
            ent = d.entries[key]
            if logits is not None and not ent.has_logits and d.chain_keys(ent.parent) is not None:
                d.write(from_state(state, key=key, block_key=bkey, tail=tail, parent=ent.parent, kv_from=ent.kv_from,
                                   seg_blocks=kc.seg_blocks(ent.kv_from, p), logits=logits, copy=False,
                                   tokens=kc.tokens))
            d.touch(d.chain_keys(key) or ())
            return False
        for e in [*walk([d.index], kc, p - 1), None]:
            pkey, ppos = (None, 0) if e is None else (e.key, e.pos)
            if d.chain_keys(pkey) is None:
                continue
            snap = from_state(state, key=key, block_key=bkey, tail=tail, parent=pkey, kv_from=ppos,
                              seg_blocks=kc.seg_blocks(ppos, p), logits=logits, copy=False, tokens=kc.tokens)
            if d.fits(d.size_of(snap), pkey):
                return d.write(snap)
        return False

    # bookkeeping -----------------------------------------------------------------------------------------
    @property
    def save_s(self) -> float:
        """Seconds spent in save so far (stats' save_s, without the rest of stats: the scheduler reads it around
        every prefill pass)."""
        with self._lock:
            return self._counters["save_s"]

    @property
    def stats(self) -> dict:
        """Counters since creation (or clear()): hits, reused_tokens and restore_s count restores; misses counts
        lookups that found nothing; saves counts snapshots created (save_s: time in save). The RAM figures are
        this cache's; the disk figures are the whole directory's (what disk_bytes bounds) as last scanned."""
        with self._lock:
            s = dict(self._counters)
            s.update(snapshots_ram=len(self.ram), bytes_ram=self.ram.bytes, evictions_ram=self.ram.evictions,
                     snapshots_disk=0, bytes_disk=0, evictions_disk=0, damaged_disk=0)
            if self.disk is not None:
                s.update(snapshots_disk=len(self.disk), bytes_disk=self.disk.bytes,
                         evictions_disk=self.disk.evictions, damaged_disk=self.disk.damaged)
            return s

    def clear(self) -> None:
        """Drop every snapshot in RAM and this model's snapshot files on disk; zero the counters."""
        self._pending.clear()
        with self._lock:
            self.ram.clear()
            if self.disk is not None:
                self.disk.clear()
            self._counters = self._zero()

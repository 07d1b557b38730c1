"""The in-RAM snapshot store: LRU under a byte budget, closed under ancestors.

Every snapshot's parent (the holder of its earlier K/V rows) is in the store while the snapshot is, so eviction
only takes leaves: the least recently used snapshot that no other cached snapshot depends on. A hit touches the
whole chain, so shared ancestors stay as recent as their most recent descendant. The stored bytes (the sum of
Snapshot.nbytes) never exceed the budget; a snapshot whose chain cannot fit is not stored.
"""

from __future__ import annotations

from collections import OrderedDict

from .index import BlockIndex, Entry
from .snapshot import Snapshot


def entry_of(s: Snapshot) -> Entry:
    return Entry(key=s.key, pos=s.pos, block_key=s.block_key, tail=s.tail, seg_blocks=s.seg_blocks,
                 has_logits=s.logits is not None)


class RamStore:
    def __init__(self, budget: int):
        self.budget = int(budget)
        self.snaps: OrderedDict[bytes, Snapshot] = OrderedDict()  # least recently used first
        self.children: dict[bytes, int] = {}
        self.bytes = 0
        self.evictions = 0
        self.index = BlockIndex()

    def __contains__(self, key: bytes) -> bool:
        return key in self.snaps

    def __len__(self) -> int:
        return len(self.snaps)

    def get(self, key: bytes) -> Snapshot | None:
        return self.snaps.get(key)

    def chain_keys(self, key: bytes | None) -> list[bytes]:
        """`key` and its ancestors, leaf first (all present: the store is closed under ancestors)."""
        out = []
        while key is not None:
            out.append(key)
            key = self.snaps[key].parent
        return out

    def chain(self, key: bytes) -> list[Snapshot]:
        return [self.snaps[k] for k in reversed(self.chain_keys(key))]

    def chain_bytes(self, key: bytes | None) -> int:
        return sum(self.snaps[k].nbytes for k in self.chain_keys(key))

    def touch(self, key: bytes | None) -> None:
        """Mark `key` and its ancestors used (ancestors first, so the leaf is the most recent)."""
        if key in self.snaps:
            for k in reversed(self.chain_keys(key)):
                self.snaps.move_to_end(k)

    def touch_keys(self, keys) -> None:
        """Mark these keys used, in order (the last becomes the most recent); absent keys are skipped."""
        for k in keys:
            if k in self.snaps:
                self.snaps.move_to_end(k)

    def _make_room(self, need: int, protect: set[bytes]) -> bool:
        while self.bytes + need > self.budget:
            victim = next((k for k in self.snaps if not self.children.get(k) and k not in protect), None)
            if victim is None:
                return False
            self._drop(victim)
            self.evictions += 1
        return True

    def fits(self, nbytes: int, parent: bytes | None) -> bool:
        """Whether a snapshot of `nbytes` under `parent` can be stored (evicting everything else if need be)."""
        return self.budget > 0 and nbytes + self.chain_bytes(parent) <= self.budget

    def put(self, snap: Snapshot) -> bool:
        """Store `snap` (its parent must be stored), evicting LRU leaves outside its chain; False when it cannot
        fit. A snapshot already stored under the key is replaced (e.g. by one that carries logits)."""
        if snap.parent is not None and snap.parent not in self.snaps:
            return False
        old = self.snaps.get(snap.key)
        if old is not None and (old.parent != snap.parent or old.kv_from != snap.kv_from):
            return False  # only the same segment may replace a stored snapshot (children depend on it)
        protect = set(self.chain_keys(snap.parent))
        if old is not None:
            protect.add(snap.key)
        need = snap.nbytes - (old.nbytes if old is not None else 0)
        if not self.fits(snap.nbytes, snap.parent) or not self._make_room(need, protect):
            return False
        if old is None:
            if snap.parent is not None:
                self.children[snap.parent] = self.children.get(snap.parent, 0) + 1
        self.snaps[snap.key] = snap
        self.snaps.move_to_end(snap.key)
        self.bytes += need
        self.index.add(entry_of(snap))
        return True

    def _drop(self, key: bytes) -> None:
        s = self.snaps.pop(key)
        self.bytes -= s.nbytes
        self.children.pop(key, None)
        if s.parent is not None:
            n = self.children.get(s.parent, 0) - 1
            if n > 0:
                self.children[s.parent] = n
            else:
                self.children.pop(s.parent, None)
        self.index.remove(key)

    def remove(self, key: bytes) -> None:
        """Remove `key` together with every snapshot that depends on it."""
        if key not in self.snaps:
            return
        doomed = {key}
        changed = True  # LRU order is not topological: iterate to a fixed point
        while changed:
            changed = False
            for k, s in self.snaps.items():
                if k not in doomed and s.parent in doomed:
                    doomed.add(k)
                    changed = True
        while doomed:
            leaf = next(k for k in doomed if not self.children.get(k))
            self._drop(leaf)
            doomed.discard(leaf)

    def clear(self) -> None:
        self.snaps.clear()
        self.children.clear()
        self.bytes = 0
        self.index.clear()

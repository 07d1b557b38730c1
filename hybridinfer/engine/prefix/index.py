"""The block hash chain that indexes snapshots by the tokens before them.

Tokens are cut into blocks of B. The key of the empty prefix is a hash of the model fingerprint (and the layer
layout and B); the key of block j is blake2b(key of block j-1 || the B tokens of block j as little-endian int32),
16 bytes. A snapshot at position p is filed under the key of its last full block (p // B blocks) plus its tail,
the p % B tokens after that block; its own key is a hash of both, so it names the token prefix exactly.

A lookup walks the new prompt's block keys while some snapshot's prefix passes through them (`known`), one dict
lookup per block, and at each block checks the few snapshots filed there whose tails match the prompt.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16


def root_key(fingerprint: str, layer_types, block_size: int) -> bytes:
    """Key of the empty prefix: a model (and block size) never shares keys with another."""
    text = f"hybridinfer-prefix|{fingerprint}|{','.join(layer_types)}|{block_size}"
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def block_key(parent: bytes, block: np.ndarray) -> bytes:
    return hashlib.blake2b(parent + np.asarray(block, "<i4").tobytes(), digest_size=KEY_BYTES).digest()


def snap_key(bkey: bytes, tail) -> bytes:
    """Key of the snapshot filed under block key `bkey` with tail tokens `tail` (distinct from any block key)."""
    raw = bkey + np.asarray(tail, "<i4").tobytes()
    return hashlib.blake2b(raw, digest_size=KEY_BYTES, person=b"hi-snapshot").digest()


def as_tokens(tokens) -> np.ndarray:
    """Token ids as a contiguous int32 vector (the dtype of DecoderState.tokens)."""
    a = np.asarray(tokens)
    if a.ndim != 1:
        a = a.reshape(-1)
    return np.ascontiguousarray(a, dtype=np.int32)


def image_key_id(digest: str) -> int:
    """The id an image's rows take in cache keys: negative (no token has it), from its digest, so two different images
    never share a key and the same image always does."""
    h = hashlib.blake2b(str(digest).encode(), digest_size=4).digest()
    return -1 - (int.from_bytes(h, "little") & 0x7FFFFFFF)


def with_images(tokens, images) -> np.ndarray:
    """Token ids as the cache keys them (int32): each image's rows (models/mrope.ImageSpan) as its image_key_id."""
    t = as_tokens(tokens)
    if not images:
        return t
    t = t.copy()
    for s in images:
        if s.row < len(t):
            t[s.row : min(s.end, len(t))] = image_key_id(s.digest)
    return t


class KeyChain:
    """Block keys of one token sequence, computed on demand and remembered."""

    def __init__(self, root: bytes, tokens: np.ndarray, block_size: int):
        self.tokens, self.B = tokens, block_size
        self._keys = [root]

    def key(self, j: int) -> bytes:
        """Key after the first j blocks (j * B <= len(tokens))."""
        while len(self._keys) <= j:
            i = len(self._keys) - 1
            self._keys.append(block_key(self._keys[i], self.tokens[i * self.B : (i + 1) * self.B]))
        return self._keys[j]

    def seg_blocks(self, lo: int, hi: int) -> tuple[bytes, ...]:
        """Keys of the blocks that end in (lo, hi]: what a snapshot whose K/V segment is [lo, hi) adds to
        `known` (its ancestors add the ones before)."""
        return tuple(self.key(j) for j in range(lo // self.B + 1, hi // self.B + 1))

    def locate(self, pos: int) -> tuple[bytes, np.ndarray, bytes]:
        """(block key, tail tokens, snapshot key) of the prefix tokens[:pos]."""
        nb = pos // self.B
        bkey = self.key(nb)
        tail = self.tokens[nb * self.B : pos]
        return bkey, tail, snap_key(bkey, tail)


@dataclass(frozen=True)
class Entry:
    key: bytes
    pos: int
    block_key: bytes
    tail: tuple[int, ...]
    seg_blocks: tuple[bytes, ...]
    has_logits: bool


class BlockIndex:
    """Snapshot keys filed by block key and tail; `known` counts the indexed prefixes through each block."""

    def __init__(self):
        self.known: dict[bytes, int] = {}
        self.at: dict[bytes, dict[bytes, Entry]] = {}
        self.entries: dict[bytes, Entry] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes) -> Entry | None:
        return self.entries.get(key)

    def add(self, e: Entry) -> None:
        if e.key in self.entries:
            self.remove(e.key)
        self.entries[e.key] = e
        self.at.setdefault(e.block_key, {})[e.key] = e
        for b in e.seg_blocks:
            self.known[b] = self.known.get(b, 0) + 1

    def remove(self, key: bytes) -> None:
        e = self.entries.pop(key, None)
        if e is None:
            return
        lvl = self.at.get(e.block_key)
        if lvl is not None:
            lvl.pop(key, None)
            if not lvl:
                del self.at[e.block_key]
        for b in e.seg_blocks:
            n = self.known.get(b, 0) - 1
            if n > 0:
                self.known[b] = n
            else:
                self.known.pop(b, None)

    def clear(self) -> None:
        self.known.clear()
        self.at.clear()
        self.entries.clear()


def known_blocks(indexes, kc: KeyChain, max_pos: int) -> int:
    """How many whole blocks of kc.tokens[:max_pos] some indexed prefix passes through (one lookup per block)."""
    j, max_pos = 0, min(max_pos, len(kc.tokens))
    while (j + 1) * kc.B <= max_pos and any(kc.key(j + 1) in ix.known for ix in indexes):
        j += 1
    return j


def walk(indexes, kc: KeyChain, max_pos: int) -> list[Entry]:
    """Entries of `indexes` whose prefix is kc.tokens[:pos] with 1 <= pos <= max_pos, deepest first (one entry
    per key). Walks block keys while one of the indexes knows them."""
    tokens, B = kc.tokens, kc.B
    max_pos = min(max_pos, len(tokens))
    found: dict[bytes, Entry] = {}
    for j in range(known_blocks(indexes, kc, max_pos) + 1):
        bkey = kc.key(j)
        lvl = [ix.at[bkey] for ix in indexes if bkey in ix.at]
        if lvl:
            blk = tokens[j * B : min((j + 1) * B, max_pos)].tolist()
            for entries in lvl:
                for e in entries.values():
                    n = len(e.tail)
                    if 1 <= e.pos <= max_pos and n <= len(blk) and tuple(blk[:n]) == e.tail:
                        found.setdefault(e.key, e)
    return sorted(found.values(), key=lambda e: -e.pos)


# prompts sharing a prefix (the scheduler snapshots where they part ways)
MIN_SHARED_PREFIX = 16  # tokens: a shorter common prefix is not worth a snapshot of the whole state


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def shared_points(ids: list[int], others: list[list[int]], min_len: int = MIN_SHARED_PREFIX) -> set[int]:
    """Positions where `ids` parts ways with prompts queued after it (at least `min_len` tokens in): the prefill of
    `ids` snapshots there, so those prompts restore the shared prefix instead of processing it again."""
    return {p for p in (common_prefix(ids, o) for o in others) if p >= min_len}

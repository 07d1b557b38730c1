"""A snapshot of a DecoderState at position p, and its file format.

A snapshot holds every recurrent array of the state (GDN conv, S; models/state_kinds.py declares them), the logits
of the last token (optional) and one segment [kv_from, p) of every per-token array (attention K/V) and of the
token ids; `parent` names the snapshot at kv_from (None when kv_from == 0) that, with its own ancestors, holds the
rows before. Restoring a snapshot copies the segments of its chain, root first, then its recurrent state.

File (one per snapshot, `<key hex>.snap`), all little-endian:

    0   8   magic b"HYBSNAP\\0"
    8   4   u32 format version (1)
    12  4   u32 header length H
    16  16  blake2b-128 of the header
    32  H   header: UTF-8 JSON {fingerprint, layer_types, block_size, key, pos, block_key, tail, parent,
            kv_from, seg_blocks, has_logits, payload_size, payload_blake2b, arrays: [{kind, layer, dtype,
            shape, offset, nbytes}]}  (keys in hex, array offsets relative to the payload)
    align64(32 + H)   payload: the arrays, each at a 64-byte aligned offset; the file ends with the payload
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass, field, fields, replace

import numpy as np

from ...backends.state import copy_each
from ...errors import ContextLengthError, NotRegularFileError, SnapshotError
from ...format import files
from ...models.state_kinds import ARRAYS
from ..fsutil import fsync_dir

MAGIC = b"HYBSNAP\0"
VERSION = 1
_PRE = struct.Struct("<8sII16s")
_ALIGN = 64
_MAX_HEADER = 64 << 20
# float32 state, int32 tokens, and the K/V rows of an f16 or quantized cache (state_kinds.StateArray.storage)
_DTYPES = {d.str: d for d in (np.dtype("<f4"), np.dtype("<i4"), np.dtype("<f2"), np.dtype("|u1"))}
# what a header's JSON can make its parsing raise: each means a damaged file, not a bug here
_MALFORMED = (ValueError, KeyError, TypeError, OverflowError, IndexError, AttributeError)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True, eq=False)
class ChainLink:
    """A snapshot's place in its prefix chain: what a Snapshot in memory and a file's FileHeader share."""

    key: bytes
    pos: int
    block_key: bytes
    tail: tuple[int, ...]
    parent: bytes | None
    kv_from: int
    seg_blocks: tuple[bytes, ...]

    def link(self) -> dict:
        """The chain fields as keyword arguments (to build the other kind of record from this one)."""
        return {f.name: getattr(self, f.name) for f in fields(ChainLink)}

    def link_json(self) -> dict:
        return {"key": self.key.hex(), "pos": self.pos, "block_key": self.block_key.hex(), "tail": list(self.tail),
                "parent": None if self.parent is None else self.parent.hex(), "kv_from": self.kv_from,
                "seg_blocks": [b.hex() for b in self.seg_blocks]}

    @staticmethod
    def link_from_json(h: dict) -> dict:
        return {"key": bytes.fromhex(h["key"]), "pos": int(h["pos"]), "block_key": bytes.fromhex(h["block_key"]),
                "tail": tuple(int(t) for t in h["tail"]),
                "parent": None if h["parent"] is None else bytes.fromhex(h["parent"]),
                "kv_from": int(h["kv_from"]), "seg_blocks": tuple(bytes.fromhex(b) for b in h["seg_blocks"])}


@dataclass(frozen=True, eq=False)
class Snapshot(ChainLink):
    tokens: np.ndarray  # (pos - kv_from,) int32: tokens[kv_from:pos]
    # per declared state array (models/state_kinds.py), by layer: a recurrent array whole (GDN conv (K-1, C), S
    # (H_v, d_k, d_v)), a per-token array's rows [kv_from, pos) (attention K, V (pos - kv_from, H_kv, row) in the
    # cache type's storage); read as snap.conv, snap.k, ...
    parts: dict[str, dict[int, np.ndarray]]
    logits: np.ndarray | None = None
    nbytes: int = field(default=0, compare=False)

    def __post_init__(self):
        for name in ARRAYS:
            self.parts.setdefault(name, {})
        object.__setattr__(self, "nbytes", sum(a.nbytes for _, _, a in self.arrays()))

    def __getattr__(self, name: str):
        parts = self.__dict__.get("parts")
        if parts is not None and name in parts:
            return parts[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def arrays(self):
        """(kind, layer, array) in file order; layer -1 for tokens and logits."""
        yield "tokens", -1, self.tokens
        for i in sorted({i for d in self.parts.values() for i in d}):
            for name in ARRAYS:
                if i in self.parts[name]:
                    yield name, i, self.parts[name][i]
        if self.logits is not None:
            yield "logits", -1, self.logits

    def with_logits(self, logits: np.ndarray) -> Snapshot:
        return replace(self, logits=logits)

    def in_ram(self) -> Snapshot:
        """A copy whose arrays are plain in-memory arrays (for a snapshot read from a mapped file)."""
        return replace(self, tokens=np.array(self.tokens),
                       parts={name: {i: np.array(a) for i, a in d.items()} for name, d in self.parts.items()},
                       logits=None if self.logits is None else np.array(self.logits))


def from_state(state, *, key: bytes, block_key: bytes, tail, parent: bytes | None, kv_from: int,
               seg_blocks: tuple[bytes, ...], logits: np.ndarray | None = None, copy: bool = True,
               tokens: np.ndarray | None = None, copied=None) -> Snapshot:
    """The snapshot of `state` at state.pos holding per-token rows [kv_from, pos). copy=False keeps views of the
    state's buffers (only to write them out at once); else copied(arrays) makes the copies (the backend's,
    Backend.copied), by default numpy's. tokens: the ids [0, pos) as the cache keys them (its images' rows as their
    key ids, index.with_images; default the state's own)."""
    p = state.pos
    views = [(name, i, a[kv_from:p] if s.per_token else a) for name, s in ARRAYS.items()
             for i, a in enumerate(state.arrays[name]) if a is not None]
    if not copy:
        got = [np.asarray(v) for _, _, v in views]
    else:
        got = copied([v for _, _, v in views]) if copied is not None else [np.array(v) for _, _, v in views]
    parts = {name: {} for name in ARRAYS}
    for (name, i, _), a in zip(views, got, strict=True):
        parts[name][i] = a
    cp = np.array if copy else np.asarray
    if logits is not None:
        logits = np.array(logits, dtype=np.float32).reshape(-1)  # always a copy: a backend may reuse its buffer
    return Snapshot(key=key, pos=p, block_key=block_key, tail=tuple(int(t) for t in tail), parent=parent,
                    kv_from=kv_from, seg_blocks=tuple(seg_blocks),
                    tokens=cp((state.tokens if tokens is None else tokens)[kv_from:p]),
                    parts=parts, logits=logits)


def recurrent_bytes(state) -> int:
    return sum(a.nbytes for _, _, a in state.held(per_token=False))


def row_bytes(state) -> int:
    """Bytes of one position's per-token rows (all layers) plus its token id."""
    return 4 + sum(a[0].nbytes for _, _, a in state.held(per_token=True))


def check_chain(chain) -> None:
    if not chain or chain[0].kv_from != 0 or chain[0].parent is not None:
        raise SnapshotError("snapshot chain does not start at position 0")
    for a, b in zip(chain, chain[1:], strict=False):
        if b.parent != a.key or b.kv_from != a.pos:
            raise SnapshotError(f"broken snapshot chain at position {b.kv_from}")


def restore_chain(chain, state, copy=None) -> None:
    """Write the state at chain[-1].pos into `state`'s existing buffers (every shape is checked before any
    write, so a mismatch leaves the state as it was). copy(dsts, srcs): the backend's copy of the arrays
    (Backend.copy_into), else numpy's (copy_each)."""
    check_chain(chain)
    last = chain[-1]
    if last.pos > state.n_ctx:
        raise ContextLengthError(f"snapshot at position {last.pos} exceeds n_ctx={state.n_ctx}")
    held = {name: {i for i, a in enumerate(state.arrays[name]) if a is not None} for name in ARRAYS}
    for name, s in ARRAYS.items():
        if not s.per_token and set(last.parts[name]) != held[name]:
            raise SnapshotError(f"the snapshot's {s.label} layers differ from the state's")
    copies = []
    for snap in chain:
        for name, s in ARRAYS.items():
            if s.per_token and set(snap.parts[name]) != held[name]:
                raise SnapshotError(f"the snapshot's {s.label} layers differ from the state's")
        a, b = snap.kv_from, snap.pos
        copies.append((state.tokens[a:b], snap.tokens, "tokens"))
        copies += [(arr[a:b], snap.parts[s.name][i], f"{s.label} of layer {i}") for s, i, arr in state.held(True)]
    copies += [(arr, last.parts[s.name][i], f"{s.label} of layer {i}") for s, i, arr in state.held(False)]
    for dst, src, what in copies:
        if dst.shape != src.shape:
            raise SnapshotError(f"snapshot {what} has shape {src.shape}, the state expects {dst.shape}")
    (copy or copy_each)([d for d, _, _ in copies], [x for _, x, _ in copies])
    state.pos = last.pos


# file format ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileHeader(ChainLink):
    fingerprint: str
    layer_types: tuple[str, ...]
    block_size: int
    has_logits: bool
    payload_offset: int
    payload_size: int
    payload_blake2b: str
    arrays: tuple
    ident: tuple  # (st_dev, st_ino, st_size) of the file read


def _layout(snap: Snapshot):
    descs, off = [], 0
    for kind, layer, a in snap.arrays():
        a = np.asarray(a)
        descs.append({"kind": kind, "layer": layer, "dtype": a.dtype.newbyteorder("<").str, "shape": list(a.shape),
                      "offset": off, "nbytes": a.nbytes})
        off = _align(off + a.nbytes)
    return descs, (descs[-1]["offset"] + descs[-1]["nbytes"]) if descs else 0


def _header_bytes(snap: Snapshot, meta: dict, descs, payload_size: int, checksum: str) -> bytes:
    hdr = {**meta, **snap.link_json(), "has_logits": snap.logits is not None, "payload_size": payload_size,
           "payload_blake2b": checksum, "arrays": descs}
    return json.dumps(hdr, sort_keys=True, separators=(",", ":")).encode()


def file_size(snap: Snapshot, meta: dict) -> int:
    descs, size = _layout(snap)
    return _align(_PRE.size + len(_header_bytes(snap, meta, descs, size, "0" * 32))) + size


def write_file(directory: str, snap: Snapshot, meta: dict) -> str:
    """Write `snap` to <directory>/<key hex>.snap atomically (temp file in the same directory, fsync, rename,
    fsync of the directory). meta: fingerprint, layer_types, block_size. Returns the path."""
    descs, size = _layout(snap)
    hlen = len(_header_bytes(snap, meta, descs, size, "0" * 32))
    payload_offset = _align(_PRE.size + hlen)
    final = os.path.join(directory, snap.key.hex() + ".snap")
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{snap.key.hex()}-", suffix=".part", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.seek(payload_offset)
            h, cur = hashlib.blake2b(digest_size=16), 0
            for d, (_, _, a) in zip(descs, snap.arrays(), strict=True):
                if d["offset"] > cur:
                    pad = bytes(d["offset"] - cur)
                    f.write(pad)
                    h.update(pad)
                buf = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                f.write(buf)
                h.update(buf)
                cur = d["offset"] + d["nbytes"]
            hb = _header_bytes(snap, meta, descs, size, h.hexdigest())
            assert len(hb) == hlen
            f.seek(0)
            f.write(_PRE.pack(MAGIC, VERSION, hlen, hashlib.blake2b(hb, digest_size=16).digest()))
            f.write(hb)
            f.write(bytes(payload_offset - _PRE.size - hlen))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)
    return final


def _parse_header(f) -> FileHeader | None:
    st = os.fstat(f.fileno())
    pre = f.read(_PRE.size)
    if len(pre) < _PRE.size:
        raise SnapshotError(f"truncated: {st.st_size} bytes, shorter than the header")
    magic, version, hlen, hsum = _PRE.unpack(pre)
    if magic != MAGIC:
        raise SnapshotError("bad magic (not a snapshot file)")
    if version != VERSION:
        return None  # another format version: not ours to read or remove
    if hlen > _MAX_HEADER:
        raise SnapshotError(f"implausible header length {hlen}")
    hb = f.read(hlen)
    if len(hb) < hlen:
        raise SnapshotError("truncated header")
    if hashlib.blake2b(hb, digest_size=16).digest() != hsum:
        raise SnapshotError("header checksum mismatch")
    try:
        h = json.loads(hb)
        payload_offset = _align(_PRE.size + hlen)
        hdr = FileHeader(
            fingerprint=str(h["fingerprint"]), layer_types=tuple(h["layer_types"]), block_size=int(h["block_size"]),
            **ChainLink.link_from_json(h), has_logits=bool(h["has_logits"]), payload_offset=payload_offset,
            payload_size=int(h["payload_size"]), payload_blake2b=str(h["payload_blake2b"]), arrays=tuple(h["arrays"]),
            ident=(st.st_dev, st.st_ino, st.st_size))
    except _MALFORMED as e:
        raise SnapshotError(f"malformed header ({e!r})") from None
    want = payload_offset + hdr.payload_size
    if st.st_size != want:
        raise SnapshotError(f"{st.st_size} bytes, the header promises {want} (truncated or damaged)")
    return hdr


class NotAFileError(SnapshotError):
    """A name in the store that is not a regular file (a FIFO, a device, a directory, a symlink to one)."""


def open_regular(path: str):
    """`path` opened for reading as a binary file object, if it is a regular file (NotAFileError otherwise), as
    format.files.open_regular opens it: a FIFO cannot make the open wait for a writer."""
    try:
        return files.open_regular(path)
    except NotRegularFileError as e:
        raise NotAFileError(f"not a regular file ({e.kind})") from None


def read_header(path: str) -> FileHeader | None:
    """The header of a snapshot file (reads only the header); None for another format version. Raises
    SnapshotError for a damaged or truncated file or one that is not a regular file, OSError (FileNotFoundError)
    when it cannot be opened."""
    with open_regular(path) as f:
        return _parse_header(f)


def load_file(path: str) -> tuple[FileHeader, Snapshot] | None:
    """Map a snapshot file and verify its payload checksum; arrays are read-only views of the mapping. None for
    another format version; SnapshotError when damaged."""
    with open_regular(path) as f:
        hdr = _parse_header(f)
        if hdr is None:
            return None
        if hdr.payload_size <= 0:
            raise SnapshotError("empty payload")
        mm = np.memmap(f, dtype=np.uint8, mode="r", offset=hdr.payload_offset, shape=(hdr.payload_size,))
    if hashlib.blake2b(mm, digest_size=16).hexdigest() != hdr.payload_blake2b:
        raise SnapshotError("payload checksum mismatch")
    parts: dict[str, dict[int, np.ndarray]] = {name: {} for name in (*ARRAYS, "tokens", "logits")}
    try:
        for d in hdr.arrays:
            dt = _DTYPES[d["dtype"]]
            off, n = int(d["offset"]), int(d["nbytes"])
            shape = tuple(int(x) for x in d["shape"])
            bad_shape = min(shape, default=0) < 0 or n != math.prod(shape) * dt.itemsize
            if off < 0 or off + n > hdr.payload_size or bad_shape:
                raise SnapshotError(f"array descriptor out of range: {d}")
            parts[d["kind"]][int(d["layer"])] = np.asarray(mm[off : off + n]).view(dt).reshape(shape)
        n_seg = hdr.pos - hdr.kv_from
        tokens = parts["tokens"][-1]
        if tokens.shape != (n_seg,) or any(a.shape[0] != n_seg for name, s in ARRAYS.items() if s.per_token
                                           for a in parts[name].values()):
            raise SnapshotError("segment arrays disagree with pos - kv_from")
        snap = Snapshot(**hdr.link(), tokens=tokens, parts={name: parts[name] for name in ARRAYS},
                        logits=parts["logits"].get(-1))
    except _MALFORMED as e:
        raise SnapshotError(f"malformed array descriptors ({e!r})") from None
    return hdr, snap

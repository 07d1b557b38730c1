"""Reading GGUF files: metadata, tensor views (memory-mapped, never copied), typed errors.

This layer knows no architecture. `models/<arch>.py` turns metadata into `ModelArgs` and asks for
tensors by their GGUF names.

The header is parsed here rather than by `gguf.GGUFReader`: every read is bounds-checked against the file
size (a cut file gives `TruncatedGGUFError` saying where and what), unknown tensor types are reported by
tensor name, and large string arrays (a 250k-token vocabulary) take a fraction of a second instead of the
tens of seconds the reader spends building one numpy part per element.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    GGUFError,
    MissingMetadataError,
    MissingTensorError,
    NonFiniteWeightsError,
    NotGGUFError,
    NotRegularFileError,
    TensorShapeError,
    TruncatedGGUFError,
    UnsupportedTensorTypeError,
)
from .files import open_regular
from .quant import SUPPORTED_TYPES, block_info, dequantize, type_name

GGUF_MAGIC = b"GGUF"
_REQUIRED = object()


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file. `ne` is ggml order (fastest first); `shape` is numpy order."""

    name: str
    qtype: int  # ggml type id (gguf.GGMLQuantizationType value)
    ne: tuple[int, ...]
    nbytes: int
    offset: int  # absolute offset of the data in the file
    data: np.ndarray  # raw bytes or typed view, memory-mapped, read-only

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne, dtype=np.int64))

    def raw(self) -> np.ndarray:
        """The stored bytes as a flat uint8 view (no copy)."""
        return self.data.reshape(-1).view(np.uint8)


# GGUF metadata value types (gguf.GGUFValueType)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


def _text(b) -> str:
    try:
        return str(b, "utf-8")
    except UnicodeDecodeError:
        return str(b, "utf-8", "replace")


class _HeaderParser:
    """Bounds-checked reads of the GGUF header from a memory map."""

    def __init__(self, path: str, buf: memoryview, size: int, endian: str):
        self.path, self.buf, self.size, self.e = path, buf, size, endian
        self.where = "the header"

    def need(self, off: int, n: int) -> None:
        if off + n > self.size:
            raise TruncatedGGUFError(
                f"{self.path!r} is truncated: {self.where} needs bytes up to {off + n}, but the file has "
                f"{self.size}")

    def scalar(self, off: int, code: str) -> tuple[Any, int]:
        n = struct.calcsize(code)
        self.need(off, n)
        return struct.unpack_from(self.e + code, self.buf, off)[0], off + n

    def string(self, off: int) -> tuple[str, int]:
        n, off = self.scalar(off, "Q")
        self.need(off, n)
        return _text(self.buf[off:off + n]), off + n

    def value(self, off: int, vtype: int, key: str) -> tuple[Any, int]:
        code = _SCALAR.get(vtype)
        if code is not None:
            return self.scalar(off, code)
        if vtype == _STRING:
            return self.string(off)
        if vtype != _ARRAY:
            raise GGUFError(f"{self.path!r}: metadata key {key!r} has unknown value type {vtype}")
        itype, off = self.scalar(off, "I")
        count, off = self.scalar(off, "Q")
        code = _SCALAR.get(itype)
        if code is not None:
            n = struct.calcsize(code)
            self.need(off, count * n)
            dt = np.dtype(self.e + code) if code != "?" else np.dtype(np.bool_)
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=off)
            return arr.tolist(), off + count * n
        if itype == _STRING:
            self.need(off, count * 8)  # every string has at least its 8-byte length
            out = []
            unpack = struct.Struct(self.e + "Q").unpack_from
            buf, size = self.buf, self.size
            for _ in range(count):
                if off + 8 > size:
                    self.need(off, 8)
                (n,) = unpack(buf, off)
                off += 8
                if off + n > size:
                    self.need(off, n)
                out.append(_text(buf[off:off + n]))
                off += n
            return out, off
        if itype == _ARRAY:
            out = []
            for _ in range(count):
                v, off = self.value(off, _ARRAY, key)
                out.append(v)
            return out, off
        raise GGUFError(f"{self.path!r}: metadata key {key!r} is an array of unknown value type {itype}")


# check_finite's sample: every value of a tensor of at most _SMALL bytes, else _SPAN bytes' blocks at three places
_SMALL, _SPAN = 1 << 16, 1 << 12


def _finite_sample(t: TensorInfo) -> np.ndarray:
    """Some of `t`'s values as float32 (see GGUFModel.check_finite)."""
    qk, bs = block_info(t.qtype)
    raw = t.raw()
    n = t.nbytes // bs
    if t.nbytes > _SMALL:
        k = max(1, _SPAN // bs)
        raw = np.concatenate([raw[b * bs:(b + k) * bs] for b in (0, (n - k) // 2, n - k)])
        n = 3 * k
    return dequantize(raw, t.qtype, (n * qk,))


class GGUFModel:
    """A memory-mapped GGUF file.

    `metadata` maps keys to Python values (str, int, float, bool, or lists of them);
    `tensors` maps GGUF tensor names to `TensorInfo`.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        try:
            # a FIFO or a device is refused before any read: a FIFO with no writer would block here for ever
            with open_regular(self.path, "model file") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(4)
                if head == GGUF_MAGIC:
                    self._mm = np.memmap(f, mode="r")  # the file checked, not whatever the name points to now
        except OSError as e:
            raise GGUFError(f"cannot open model file {self.path!r}: {e.strerror}") from e
        except NotRegularFileError as e:
            raise GGUFError(f"cannot open model file {self.path!r}: it is {e.kind}, not a regular file") from None
        if head != GGUF_MAGIC:
            raise NotGGUFError(f"{self.path!r} is not a GGUF file: it starts with {head!r}, not b'GGUF'")
        self.file_size = size
        self._parse(memoryview(self._mm), size)

    def _parse(self, buf: memoryview, size: int) -> None:
        path = self.path
        p = _HeaderParser(path, buf, size, "<")
        version, _ = p.scalar(4, "I")
        if version & 0xFFFF == 0:
            raise GGUFError(f"{path!r} is a big-endian GGUF (version field {version:#x}); only little-endian "
                            f"files are supported")
        if version not in (2, 3):
            raise GGUFError(f"{path!r}: GGUF version {version} is not supported (only 2 and 3)")
        self.version = int(version)
        n_tensors, off = p.scalar(8, "Q")
        n_kv, off = p.scalar(off, "Q")
        # (absurd counts need no check of their own: every entry reads at least 12 bytes, so the loops
        # below run off the end of the file, with a TruncatedGGUFError, after at most size / 12 rounds)
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            p.where = f"metadata entry #{i}"
            key, off = p.string(off)
            p.where = f"metadata key {key!r}"
            vtype, off = p.scalar(off, "I")
            value, off = p.value(off, vtype, key)
            if key in self.metadata:
                raise GGUFError(f"{path!r}: metadata key {key!r} appears twice")
            self.metadata[key] = value

        align = self.metadata.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise GGUFError(f"{path!r}: general.alignment must be a power of two, not {align!r}")
        self.alignment = int(align)

        infos = []
        for i in range(n_tensors):
            p.where = f"tensor info #{i}"
            name, off = p.string(off)
            p.where = f"the info of tensor {name!r}"
            n_dims, off = p.scalar(off, "I")
            if n_dims > _MAX_DIMS:
                raise GGUFError(f"{path!r}: tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
            p.need(off, 8 * n_dims + 12)
            ne = struct.unpack_from(f"{p.e}{n_dims}Q", buf, off)
            off += 8 * n_dims
            qtype, off = p.scalar(off, "I")
            rel, off = p.scalar(off, "Q")
            infos.append((name, int(qtype), tuple(int(x) for x in ne), int(rel)))

        data_start = off + (-off) % self.alignment
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, qtype, ne, rel in infos:
            if name in self.tensors:
                raise GGUFError(f"{path!r}: tensor {name!r} appears twice")
            try:
                qk, bs = block_info(qtype)
            except UnsupportedTensorTypeError:
                raise UnsupportedTensorTypeError(
                    f"{path!r}: tensor {name!r} has unknown ggml type id {qtype} ({type_name(qtype)})") from None
            row = ne[0] if ne else 1
            if row % qk:
                raise GGUFError(f"{path!r}: tensor {name!r} of type {type_name(qtype)} has rows of {row} "
                                f"elements, not a whole number of {qk}-element blocks")
            if rel % self.alignment:
                raise GGUFError(f"{path!r}: tensor {name!r} has data offset {rel}, not a multiple of the "
                                f"alignment {self.alignment}")
            n_el = 1
            for x in ne:
                n_el *= x
            nbytes = n_el // qk * bs
            start = data_start + rel
            end = start + nbytes
            if end > size:
                raise TruncatedGGUFError(
                    f"{path!r} is truncated: tensor {name!r} needs bytes up to {end}, but the file has {size}")
            shape = tuple(reversed(ne))
            raw = self._mm[start:end]
            if qtype == 0:
                data = raw.view(np.float32).reshape(shape)
            elif qtype == 1:
                data = raw.view(np.float16).reshape(shape)
            elif qk > 1 and shape:
                data = raw.reshape(*shape[:-1], shape[-1] // qk * bs)
            else:
                data = raw
            self.tensors[name] = TensorInfo(name=name, qtype=qtype, ne=ne, nbytes=nbytes, offset=start, data=data)

    # metadata -------------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return str(self.meta("general.architecture"))

    def meta(self, key: str, default: Any = _REQUIRED) -> Any:
        if key in self.metadata:
            return self.metadata[key]
        if default is _REQUIRED:
            raise MissingMetadataError(f"{self.path!r}: metadata key {key!r} is missing")
        return default

    # tensors --------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str, ne: tuple[int, ...] | None = None) -> TensorInfo:
        """The tensor `name`, checked to have ggml shape `ne` and a supported type."""
        t = self.tensors.get(name)
        if t is None:
            raise MissingTensorError(f"{self.path!r}: tensor {name!r} is missing")
        if ne is not None and tuple(t.ne) != tuple(ne):
            # a {D, 1} vector may be stored as {D}
            if tuple(x for x in t.ne if x != 1) != tuple(x for x in ne if x != 1):
                raise TensorShapeError(
                    f"{self.path!r}: tensor {name!r} has shape {list(t.ne)}, expected {list(ne)}"
                )
        if t.qtype not in SUPPORTED_TYPES:
            raise UnsupportedTensorTypeError(
                f"{self.path!r}: tensor {name!r} has type {t.type_name}, which hybridinfer cannot read "
                f"(supported: {', '.join(type_name(q) for q in sorted(SUPPORTED_TYPES))})"
            )
        return t

    def dequant(self, name: str, ne: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as float32 in numpy order (shape reversed from `ne`)."""
        t = self.tensor(name, ne)
        return dequantize(t.raw(), t.qtype, t.shape)

    def check_finite(self) -> None:
        """NonFiniteWeightsError naming the first tensor, in file order, with NaN or infinity among a sample of its
        values: all of a small tensor (norms, biases), else the blocks of a few KiB at its start, middle and end
        (a block's scales are in every value of it, so a damaged scale shows): at most 64 KiB a tensor, read in file
        order, whatever the model's size. A check for a damaged file (a data region overwritten with 0xFF), not a
        proof that every weight is sound."""
        for t in sorted(self.tensors.values(), key=lambda t: t.offset):
            if t.qtype not in SUPPORTED_TYPES or not t.nbytes:
                continue  # an unsupported type is reported when the model asks for the tensor
            vals = _finite_sample(t)
            bad = vals[~np.isfinite(vals)]
            if bad.size:
                raise NonFiniteWeightsError(
                    f"{self.path!r}: tensor {t.name!r} ({t.type_name}) holds {bad[0]} among its weights; the file is "
                    f"damaged")

    def fingerprint(self) -> str:
        """A hash of the metadata and tensor layout (names, types, shapes, offsets), not the data."""
        h = hashlib.sha256()
        for k in sorted(self.metadata):
            if k.startswith("tokenizer.ggml."):
                v = self.metadata[k]
                h.update(f"{k}:{len(v) if isinstance(v, list) else v}".encode())
            else:
                h.update(f"{k}:{self.metadata[k]!r}".encode())
        for t in self.tensors.values():
            h.update(f"{t.name}:{t.qtype}:{t.ne}:{t.offset}".encode())
        return h.hexdigest()[:32]

    def close(self) -> None:
        """Drop this object's map; tensor views already handed out keep the file mapped."""
        self._mm = None

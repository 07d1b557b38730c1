"""Test helper: copy a GGUF with edits (drop tensors, change metadata, replace tensors), to build the
malformed cases the loader must reject."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def _copy_field(w: GGUFWriter, key: str, field) -> None:
    t = field.types[0]
    v = field.contents()
    if t == GGUFValueType.ARRAY:
        w.add_array(key, v)
    elif t == GGUFValueType.STRING:
        w.add_string(key, v)
    else:
        w.add_key_value(key, v, t)


def rewrite(src: str, dst: str, *, arch: str | None = None, drop: set[str] = frozenset(),
            meta: dict | None = None, replace: dict[str, np.ndarray] | None = None) -> None:
    """Write `dst` = `src` with `general.architecture` set to `arch` (other keys keep their prefix),
    tensors in `drop` removed, metadata keys in `meta` overwritten (value None deletes), and tensors in
    `replace` swapped for F32 arrays (numpy order) or
    (array, ggml type) pairs."""
    r = GGUFReader(src)
    src_arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch or src_arch)
    meta = dict(meta or {})
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in meta:
            v = meta.pop(key)
            if v is not None:
                _set(w, key, v)
            continue
        _copy_field(w, key, f)
    for key, v in meta.items():
        if v is not None:
            _set(w, key, v)
    replace = replace or {}
    for t in r.tensors:
        if t.name in drop:
            continue
        if t.name in replace:
            new = replace[t.name]
            if isinstance(new, tuple):  # (stored array, ggml type): e.g. BF16 bits as uint16
                w.add_tensor(t.name, np.ascontiguousarray(new[0]), raw_dtype=new[1])
            else:
                w.add_tensor(t.name, np.ascontiguousarray(new, dtype=np.float32))
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _set(w: GGUFWriter, key: str, v) -> None:
    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    else:
        w.add_array(key, list(v))

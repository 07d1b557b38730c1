"""What a snapshot of one model's DecoderState must look like, to check a file before it is restored.

A snapshot file's checksums prove only that it was written whole, not that its arrays fit this model's state: a
file with another shape, dtype or logits length (a bug, a hand-edited or hostile file) would otherwise fail every
restore or feed the sampler a short logits vector. The layout is taken from a state the backend made (its arrays are
those models/state_kinds.py declares); without one, only what the layer types imply is checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import SnapshotError
from ...models.state_kinds import ARRAYS, layer_arrays, layers_keeping

F32, I32 = np.dtype("<f4"), np.dtype("<i4")
ROW_DTYPES = (F32, np.dtype("<f2"), np.dtype("|u1"))  # a per-token array's storage in some cache type




@dataclass(frozen=True)
class StateLayout:
    """The shapes and dtypes of a DecoderState's arrays (recurrent: the whole array; per token: one row) by (array
    name, layer), and the logits length."""

    layer_types: tuple[str, ...]
    shapes: tuple[tuple[str, int, tuple[int, ...], str], ...]  # (array name, layer, shape, dtype str)
    n_vocab: int | None = None

    @classmethod
    def of_state(cls, state, n_vocab: int | None = None) -> StateLayout:
        shapes = tuple((name, i, tuple(a.shape[1 if s.per_token else 0 :]), a.dtype.newbyteorder("<").str)
                       for name, s in ARRAYS.items() for i, a in enumerate(state.arrays[name]) if a is not None)
        return cls(tuple(state.layer_types), shapes, None if n_vocab is None else int(n_vocab))


def _check(what: str, a: np.ndarray, dtype, shape: tuple | None, ndim: int) -> None:
    if a.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise SnapshotError(f"{what} has dtype {a.dtype}, the state needs {dtype}")
    if (shape is not None and a.shape != shape) or a.ndim != ndim:
        raise SnapshotError(f"{what} has shape {a.shape}, the state needs "
                            f"{shape if shape is not None else f'{ndim} dimensions'}")


def check_snapshot(snap, layer_types: tuple[str, ...], layout: StateLayout | None) -> None:
    """Raise SnapshotError unless every array of `snap` has the dtype and shape the state needs (with no layout:
    the layers the layer types imply, the number of dimensions, one row shape for the per-token arrays of a kind)."""
    n_seg = snap.pos - snap.kv_from
    if snap.kv_from < 0 or n_seg < 1:
        raise SnapshotError(f"segment [{snap.kv_from}, {snap.pos}) is empty or negative")
    for name, s in ARRAYS.items():
        d, want = snap.parts[name], layers_keeping(layer_types, name)
        if set(d) != want:
            raise SnapshotError(f"{s.label} arrays for layers {sorted(d)}, the state has them for {sorted(want)}")
    _check("tokens", snap.tokens, I32, (n_seg,), 1)
    shapes = {(name, i): (shape, np.dtype(dt)) for name, i, shape, dt in layout.shapes} if layout else {}
    rows: dict[str, set] = {}
    for i, s in layer_arrays(layer_types):
        a, what = snap.parts[s.name][i], f"{s.label} of layer {i}"
        want, dt = shapes.get((s.name, i), (None, F32 if not s.per_token else ROW_DTYPES))
        if not s.per_token:
            _check(what, a, dt, want, s.ndim)
            continue
        _check(what, a, dt, None if want is None else (n_seg, *want), s.ndim)
        if a.shape[0] != n_seg:
            raise SnapshotError(f"{what} has {a.shape[0]} rows for a {n_seg}-token segment")
        rows.setdefault(s.label, set()).add((a.shape[1:], a.dtype.str))
    for label, r in rows.items():
        if len(r) > 1:
            raise SnapshotError(f"{label} rows of several shapes or types {sorted(r)}")
    if snap.logits is not None:
        n = layout.n_vocab if layout is not None else None
        _check("logits", snap.logits, F32, None if n is None else (n,), 1)

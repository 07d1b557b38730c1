"""What a snapshot of one model's DecoderState must look like, to check a file before it is restored.

A snapshot file's checksums prove only that it was written whole, not that its arrays fit this model's state: a
file with another shape, dtype or logits length (a bug, a hand-edited or hostile file) would otherwise fail every
restore or feed the sampler a short logits vector. The layout is taken from a state the backend made (state.py is
the one source of the shapes); without one, only what the layer types imply is checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import SnapshotError

F32, I32 = np.dtype("<f4"), np.dtype("<i4")


@dataclass(frozen=True)
class StateLayout:
    """Per-layer shapes of a DecoderState (GDN: conv, S; attention: one K/V row) and the logits length."""

    layer_types: tuple[str, ...]
    conv: tuple[tuple[int, tuple[int, ...]], ...]  # (layer, shape), GDN layers only
    ssm: tuple[tuple[int, tuple[int, ...]], ...]
    kv_row: tuple[tuple[int, tuple[int, ...]], ...]  # (layer, (H_kv, hd)), attention layers only
    n_vocab: int | None = None

    @classmethod
    def of_state(cls, state, n_vocab: int | None = None) -> StateLayout:
        def shapes(arrs, cut=0):
            return tuple((i, tuple(a.shape[cut:])) for i, a in enumerate(arrs) if a is not None)

        return cls(tuple(state.layer_types), shapes(state.conv), shapes(state.ssm), shapes(state.k, 1),
                   None if n_vocab is None else int(n_vocab))


def _check(what: str, a: np.ndarray, dtype: np.dtype, shape: tuple | None, ndim: int) -> None:
    if a.dtype != dtype:
        raise SnapshotError(f"{what} has dtype {a.dtype}, the state needs {dtype}")
    if (shape is not None and a.shape != shape) or a.ndim != ndim:
        raise SnapshotError(f"{what} has shape {a.shape}, the state needs "
                            f"{shape if shape is not None else f'{ndim} dimensions'}")


def check_snapshot(snap, layer_types: tuple[str, ...], layout: StateLayout | None) -> None:
    """Raise SnapshotError unless every array of `snap` has the dtype and shape the state needs (with no layout:
    the layers the layer types imply, the number of dimensions, one K/V row shape throughout)."""
    n_seg = snap.pos - snap.kv_from
    if snap.kv_from < 0 or n_seg < 1:
        raise SnapshotError(f"segment [{snap.kv_from}, {snap.pos}) is empty or negative")
    gdn = {i for i, t in enumerate(layer_types) if t == "gdn"}
    attn = set(range(len(layer_types))) - gdn
    for name, d, want in (("conv", snap.conv, gdn), ("S", snap.ssm, gdn), ("K", snap.k, attn), ("V", snap.v, attn)):
        if set(d) != want:
            raise SnapshotError(f"{name} arrays for layers {sorted(d)}, the state has them for {sorted(want)}")
    _check("tokens", snap.tokens, I32, (n_seg,), 1)
    conv = dict(layout.conv) if layout else {}
    ssm = dict(layout.ssm) if layout else {}
    row = dict(layout.kv_row) if layout else {}
    for i in sorted(gdn):
        _check(f"conv of layer {i}", snap.conv[i], F32, conv.get(i), 2)
        _check(f"S of layer {i}", snap.ssm[i], F32, ssm.get(i), 3)
    rows = set()
    for i in sorted(attn):
        want = (n_seg, *row[i]) if i in row else None
        for name, a in (("K", snap.k[i]), ("V", snap.v[i])):
            _check(f"{name} of layer {i}", a, F32, want, 3)
            if a.shape[0] != n_seg:
                raise SnapshotError(f"{name} of layer {i} has {a.shape[0]} rows for a {n_seg}-token segment")
            rows.add(a.shape[1:])
    if len(rows) > 1:
        raise SnapshotError(f"K/V rows of several shapes {sorted(rows)}")
    if snap.logits is not None:
        n = layout.n_vocab if layout is not None else None
        _check("logits", snap.logits, F32, None if n is None else (n,), 1)

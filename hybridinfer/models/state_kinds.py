"""What each mixer kind keeps per sequence, declared once.

A model's `args.layer_types` names each layer's mixer kind. Everything that holds, counts, copies or moves a
sequence's state works from the declarations here and never from a kind's name: DecoderState's arrays
(backends/state.py), the scheduler's byte budget (`state_bytes`), the prefix cache's snapshots, checks and file
arrays (engine/prefix), the GPU's copy of the state, its mid-prompt snapshots and its hand-off to the host
(backends/gpu), the CPU's work buffers (one method per op, backends/cpu) and the GPU work count (`flops`).

Each kind keeps arrays of two sorts (float32, except the K/V rows, which take the cache type the model's args name:
`args.cache_type_k` / `cache_type_v`, llama.cpp's `-ctk` / `-ctv`; see `StateArray.storage`):
- recurrent (per_token False): one array of `shape(args)` that every token rewrites (GDN's conv window and S
  matrix). A snapshot copies it whole; a restore writes the snapshot's; it starts at zero.
- per token (per_token True): one row of `shape(args)` per position (attention's K and V). Rows before `pos` are
  valid and never change once written, so a snapshot holds only the rows of its segment [kv_from, pos), a restore
  writes its chain's segments, and the GPU hands only a pass's new rows to the host.

Adding a mixer kind: one `MixerKind` in KINDS (its arrays and FLOPs), its branch in the architecture module and
its op in each backend's ops class (with that op's work buffers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import ParameterError
from ..format.quant_types import CACHE_ONLY, cache_row, cache_type


@dataclass(frozen=True)
class StateArray:
    """One array a mixer kind keeps per layer and sequence. `name` is DecoderState's attribute (`state.conv[i]`)
    and the array kind in a snapshot file; `label` names it in messages."""

    name: str
    label: str
    per_token: bool
    shape: Callable[[Any], tuple[int, ...]]  # recurrent: the whole array's shape; per token: one row's (in values)
    ndim: int  # dimensions of the array a snapshot holds (per token: rows + the row's dimensions)
    cache: str | None = None  # "k" / "v": the rows take args.cache_type_<cache>; None: float32

    def storage(self, args) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape (recurrent: whole; per token: a row) the array is kept in: float32 values, float16
        values for an f16 cache, or a quantized cache's blocks as bytes (the last dimension's values in blocks of
        the type, llama.cpp's block layout: a row of hd values takes hd / block * block bytes)."""
        s = tuple(int(x) for x in self.shape(args))
        if self.cache is None:
            return np.dtype(np.float32), s
        dt, n = cache_row(cache_type(getattr(args, f"cache_type_{self.cache}", "f32")).id, s[-1])
        return dt, (*s[:-1], n)

    def full_shape(self, args, n_rows: int) -> tuple[int, ...]:
        """The array one sequence holds (in its storage): per token, n_rows rows of the row shape."""
        s = self.storage(args)[1]
        return (int(n_rows), *s) if self.per_token else s

    def nbytes(self, args, n_tokens: int) -> int:
        dt, _ = self.storage(args)
        return dt.itemsize * math.prod(self.full_shape(args, n_tokens))


@dataclass(frozen=True)
class MixerKind:
    """A mixer kind: its name in args.layer_types, its letter in `hybridinfer info`'s layer pattern, the graph op
    (models/graph.py) that reads and writes its state, that state's arrays, and its FLOPs for T tokens after
    position pos0 (what the GPU work count adds up)."""

    name: str
    letter: str
    op: str
    arrays: tuple[StateArray, ...]
    flops: Callable[[Any, int, int], float]

    def nbytes(self, args, n_tokens: int) -> int:
        """Bytes one layer of this kind keeps for a sequence of n_tokens tokens."""
        return sum(s.nbytes(args, n_tokens) for s in self.arrays)


def attention_flops(n_head: int, head_dim: int, pos0: int, T: int) -> float:
    """Causal softmax(Q K^T) V for queries at positions pos0 .. pos0+T-1, each over the keys 0 .. its own position:
    per head, 2 hd for Q.K and 2 hd for P.V per (query, visible key) pair."""
    pairs = T * pos0 + T * (T + 1) // 2
    return 4.0 * n_head * head_dim * pairs


def gdn_flops(args, T: int) -> float:
    """The gated delta rule per token and value head over S [d_k, d_v]: decay (1), S^T k (2), the rank-1 update (2)
    and S^T q (2): 7 d_k d_v; the causal conv: 2 K per channel."""
    per_tok = 7 * args.ssm_n_v_heads * args.ssm_d_k * args.ssm_d_v + 2 * args.ssm_conv_kernel * args.ssm_conv_channels
    return float(T) * per_tok


def _kv_row(a) -> tuple[int, ...]:
    return (a.n_head_kv, a.head_dim)


GDN = MixerKind(
    name="gdn", letter="G", op="gdn",
    # conv: the last K-1 pre-conv projections u, oldest first (zeros before the first token); S: GGUF head order
    arrays=(StateArray("conv", "conv", False, lambda a: (a.ssm_conv_kernel - 1, a.ssm_conv_channels), 2),
            StateArray("ssm", "S", False, lambda a: (a.ssm_n_v_heads, a.ssm_d_k, a.ssm_d_v), 3)),
    flops=lambda a, pos0, T: gdn_flops(a, T))
ATTENTION = MixerKind(
    name="attention", letter="A", op="attention",
    # K after k_norm and RoPE, V raw
    arrays=(StateArray("k", "K", True, _kv_row, 3, cache="k"), StateArray("v", "V", True, _kv_row, 3, cache="v")),
    flops=lambda a, pos0, T: attention_flops(a.n_head, a.head_dim, pos0, T))

# Not a trunk layer: the MTP block's rows a sequence keeps where the model has the block and drafts with it (the
# trunk never walks it; the drafter, engine/spec_mtp.py, writes it). Its rows are aligned with the trunk's positions:
# row t is the block's pass over (h_{t-1}, token t), h the trunk's final-norm output, so a state at position p holds
# exactly the rows < p a snapshot at p keeps (row 0 stays unset: no h precedes token 0). h: the last such h,
# h_{p-1} (the next row's input, which a restored prefix does not compute again), and after it the count of the
# block's rows (positions 1..n) that are the block's over every position from the start (0: none, the rows start
# again after a restore).
MTP_ROWS = MixerKind(
    name="mtp", letter="M", op="mtp",
    arrays=(StateArray("mtp_k", "MTP K", True, _kv_row, 3, cache="k"),
            StateArray("mtp_v", "MTP V", True, _kv_row, 3, cache="v"),
            StateArray("mtp_h", "MTP h", False, lambda a: (a.n_embd + 1,), 1)),
    flops=lambda a, pos0, T: attention_flops(a.n_head, a.head_dim, pos0, T))

KINDS: dict[str, MixerKind] = {k.name: k for k in (ATTENTION, GDN, MTP_ROWS)}
# every array of every kind by name (names are unique across kinds), in the order a snapshot file lists a layer's
ARRAYS: dict[str, StateArray] = {s.name: s for k in KINDS.values() for s in k.arrays}
assert len(ARRAYS) == sum(len(k.arrays) for k in KINDS.values()), "state array names must be unique"


def kind_of(name: str) -> MixerKind:
    k = KINDS.get(name)
    if k is None:
        raise ValueError(f"mixer kind {name!r} is not declared (declared: {', '.join(KINDS)})")
    return k


def layer_arrays(layer_types) -> Iterator[tuple[int, StateArray]]:
    """(layer, array) for every array the layers keep, layer by layer, each layer's arrays in declared order."""
    for i, t in enumerate(layer_types):
        for s in kind_of(t).arrays:
            yield i, s


def layers_keeping(layer_types, name: str) -> set[int]:
    """The layers that keep array `name`."""
    return {i for i, s in layer_arrays(layer_types) if s.name == name}


def has_recurrent(layer_types) -> bool:
    """Whether some layer keeps a recurrent array (then a mid-prompt snapshot needs that array at its position;
    per-token rows are read from the finished pass)."""
    return any(not s.per_token for _, s in layer_arrays(layer_types))


def sequence_layer_types(args, mtp_rows: bool = True) -> tuple[str, ...]:
    """The kinds a sequence's DecoderState holds, one per layer: the trunk's, then (mtp_rows, where the model has an
    MTP block) the block's rows (MTP_ROWS)."""
    return (*args.layer_types, *((MTP_ROWS.name,) if mtp_rows and getattr(args, "has_mtp", False) else ()))


def state_bytes(args, n_tokens: int) -> int:
    """Bytes of one sequence's state holding n_tokens tokens (in the args' cache types): every layer's arrays, and
    the MTP block's rows where the model has one (a drafter may keep them)."""
    return sum(kind_of(t).nbytes(args, n_tokens) for t in sequence_layer_types(args))


def role_cache_type(role: str, name):
    """The cache type `name` for the K or V rows (role "k" / "v"); a ParameterError naming cache_type_<role> and the
    value otherwise."""
    try:
        return cache_type(name)
    except ValueError as e:
        raise ParameterError(f"cache_type_{role}: {e}") from None


def with_cache_types(args, k: str = "f32", v: str = "f32", rotate: bool = True):
    """`args` with K/V rows kept in cache types k and v (llama.cpp's names) and, with `rotate`, quantized ones
    rotated as llama.cpp rotates them (kv_rotation); a ParameterError naming a type that is not a cache type, or one
    whose block does not divide the rows it would hold."""
    names: dict = {"cache_rotate": bool(rotate)}
    for role, name in (("k", k), ("v", v)):
        t = role_cache_type(role, name)
        for s in ARRAYS.values():
            if s.cache == role and s.shape(args)[-1] % t.block:
                raise ParameterError(f"cache_type_{role} {t.kernel_name}: rows of {s.shape(args)[-1]} values do "
                                     f"not divide into its blocks of {t.block}")
            if s.cache == role and t.id in CACHE_ONLY and s.shape(args)[-1] % 64:
                raise ParameterError(f"cache_type_{role} {t.kernel_name}: its codes need rows rotated in chunks of "
                                     f"64 values; heads of {s.shape(args)[-1]} are not")
        names[f"cache_type_{role}"] = t.kernel_name
    return replace(args, **names)


def kv_rotation(args) -> tuple[int, int]:
    """The Walsh-Hadamard rotation sizes of the K and V rows (0: none), llama.cpp's rule (llama_kv_cache's attn_rot_k /
    attn_rot_v, on unless LLAMA_ATTN_ROT_DISABLE): a quantized type (not f32 or f16) on heads of a multiple of 64
    values; K (and the query with it) in chunks of the largest power of two from 64 dividing the head, V in chunks of
    64. cache_rotate=False turns it off, except for this engine's lm3 / lm4, whose codes assume rotated rows. A
    rotation is orthogonal, so the attention it leaves is the same maths; the quantization error is spread over the
    chunk instead of sitting on the few large values."""
    hd, out = int(args.head_dim), []
    for role, t in zip("kv", cache_types(args), strict=True):
        n, qt = 0, cache_type(t)
        # the Lloyd-Max types' codes are those of a Gaussian: rotated whatever cache_rotate says
        if qt.block > 1 and hd % 64 == 0 and (getattr(args, "cache_rotate", True) or qt.id in CACHE_ONLY):
            n = 64
            while role == "k" and hd % (2 * n) == 0:
                n *= 2
        out.append(n)
    return out[0], out[1]


def cache_types(args) -> tuple[str, str]:
    """The (K, V) cache type names of `args`."""
    return getattr(args, "cache_type_k", "f32"), getattr(args, "cache_type_v", "f32")


def cache_path(args) -> str:
    """The K/V types' part of a backend's numeric path ("" for F32 K/V): snapshots made with other types are another
    path's, a miss in the prefix cache, never restored into this one."""
    k, v = cache_types(args)
    rk, rv = kv_rotation(args)
    return "" if (k, v) == ("f32", "f32") else f"/kv:{k},{v}" + (f",rot{rk},{rv}" if rk or rv else "")

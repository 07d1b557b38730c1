"""Launchers of native/cuda_sm20/gemm.cu: Y = X W^T with W in GGUF form (dequantized in the kernel).

A weight on the card is a `DeviceWeight`: the raw GGUF bytes of a [N, K] matrix or an [E, N, K] stack of
expert matrices, one row of `row_nbytes` after another. `gemm` multiplies all tokens by one matrix;
`gemm_grouped` multiplies, for each expert e, the token rows listed in idx[offs[e]:offs[e+1]].
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import KernelArgumentError
from ...format import quant
from ...format.quant_types import TYPES
from . import kclass, loader
from .cards import CardLimits
from .ptxas_table import USAGE

FAMILY = "gemm"
# (tokens, weight rows) of a block's output tile compiled into gemm.cu for each kernel class (kernel suffix
# _b<BM>_n<BN>): the 63-register class builds the lean body, whose tiles hold at most 4 x 8 outputs a thread
TILES_BY_CLASS = {
    kclass.R255: ((16, 128), (32, 128), (64, 128), (128, 128), (16, 256), (32, 256), (64, 256)),
    kclass.R63: ((16, 128), (32, 128), (64, 128), (16, 256), (32, 256), (32, 64), (64, 64)),
}
TILES = TILES_BY_CLASS[kclass.R255]
# the types gemm.cu has kernels for, by their name in the kernels' (format/quant_types.py is the table)
GEMM_TYPES = {q: t.kernel_name for q, t in TYPES.items() if t.gpu_gemm}
# base-pointer alignment the kernels' vector loads need, by type
_ALIGN = {q: t.gpu_align for q, t in TYPES.items()}
_NULL = np.uintp(0)


class DeviceWeight:
    """GGUF weight bytes on the card.

    qtype: ggml type id; shape: (N, K) or (E, N, K) in numpy order (K, the row, holds whole blocks);
    data: pycuda GPUArray of uint8 holding prod(shape[:-1]) * row_nbytes bytes (any shape, C order).
    """

    def __init__(self, qtype: int, shape: tuple, data):
        self.qtype = int(qtype)
        self.shape = tuple(int(s) for s in shape)
        if len(self.shape) not in (2, 3):
            raise KernelArgumentError(f"DeviceWeight: shape {self.shape} is neither (N, K) nor (E, N, K)")
        self.row_nbytes = quant.row_nbytes(self.qtype, self.shape[-1])
        need = math.prod(self.shape[:-1]) * self.row_nbytes
        if data.dtype != np.uint8 or data.size != need or not data.flags.c_contiguous:
            raise KernelArgumentError(
                f"DeviceWeight {quant.type_name(self.qtype)} {self.shape}: data must be {need} contiguous uint8 "
                f"bytes, got {data.dtype} {data.shape}")
        self.data = data.reshape(need) if data.shape != (need,) else data

    @classmethod
    def upload(cls, raw: np.ndarray, qtype: int, shape: tuple) -> DeviceWeight:
        """Copy host bytes (e.g. a GGUF tensor's raw view) to the card."""
        from pycuda import gpuarray

        return cls(qtype, shape, gpuarray.to_gpu(np.ascontiguousarray(np.asarray(raw).view(np.uint8).reshape(-1))))

    @property
    def n_expert(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 1

    def __repr__(self) -> str:
        return f"DeviceWeight({quant.type_name(self.qtype)}, {self.shape})"


def _aligned(ptr, n: int, what: str):
    if int(ptr) % n:
        raise KernelArgumentError(f"{what}: device pointer {int(ptr):#x} is not {n}-byte aligned")
    return np.uintp(int(ptr))


def _check_weight(w: DeviceWeight, ndim: int, table: dict) -> str:
    if not isinstance(w, DeviceWeight):
        raise KernelArgumentError(f"weight: expected a DeviceWeight, got {type(w).__name__}")
    if len(w.shape) != ndim:
        raise KernelArgumentError(f"weight {w}: expected {ndim} dimensions")
    if w.qtype not in table:
        names = ", ".join(quant.type_name(q) for q in table)
        raise KernelArgumentError(f"weight {w}: type {quant.type_name(w.qtype)} has no kernel (have {names})")
    if w.shape[-1] % 32:
        raise KernelArgumentError(f"weight {w}: K = {w.shape[-1]} is not a multiple of 32")
    return table[w.qtype]


# each class's tiles in order of preference where the token runs fill them (bm tokens a group: rows_per_group
# >= 0.6 bm) and they give every multiprocessor a block. r255: measured on an H100 and an H200
# (bench/gpu_gemm_probe.py: 947 tokens x 8192 x 2048 Q4_K at 128 x 128 ~31 TFLOP/s; 256 experts x 512 x 2048,
# ~30 tokens each, at 32 x 256 ~12 TFLOP/s, at 16 x 128 ~7). r63: the larger lean tiles first, as far as they
# are spill-free for the weight type.
_PREFERENCE = {
    kclass.R255: ((128, 128), (64, 128), (32, 256), (32, 128)),
    kclass.R63: ((64, 128), (64, 64), (32, 256), (32, 128), (32, 64)),
}
_FALLBACK = {kclass.R255: (16, 128), kclass.R63: (16, 128)}
# tiles whose body splits over K (gemm.cu): every tile of r255; of r63 the 64-wide ones only, whose split costs no
# register (the split's chunk range and slab row made the 128- and 256-wide lean bodies spill)
SPLIT_TILES = {kclass.R255: TILES_BY_CLASS[kclass.R255], kclass.R63: ((32, 64), (64, 64))}
MAX_SPLIT = 4
MIN_PART_CHUNKS = 8  # k chunks of 32 a part at least, so a part's slab write and sum stay small beside its reads


def tile_usage(cls: str, qtype: int, tile: tuple[int, int]) -> tuple[int, int, int] | None:
    """(registers, spill bytes, shared memory) of a tile's kernel in class `cls` (ptxas_table), None if absent."""
    return USAGE[cls].get(f"gemm_{GEMM_TYPES[qtype]}_b{tile[0]}_n{tile[1]}")


def tile_fits(limits: CardLimits, qtype: int, tile: tuple[int, int]) -> bool:
    """The tile is compiled for the limits' class, does not spill there and fits a block's shared memory."""
    cls = kclass.kernel_class(limits)
    u = tile_usage(cls, qtype, tile) if tuple(tile) in TILES_BY_CLASS[cls] else None
    return u is not None and u[1] == 0 and u[2] <= limits.smem_per_block


def choose_tile(limits: CardLimits, T: int, N: int, K: int, qtype: int,
                rows_per_group: float | None = None) -> tuple[int, int]:
    """(BM, BN) output tile for Y[T, N] = X[T, K] W^T under `limits` (a card's, or a --card-profile's), weight type
    `qtype`, with rows_per_group tokens a group on average (MoE experts; T for a plain GEMM).

    Only tiles compiled for the limits' kernel class that are spill-free there and fit its shared memory per
    block are taken; among those the first of the class's preference that its token runs fill and that gives
    every multiprocessor (limits.sm_count; 0: unknown, taken as enough) a block. Where none does, the class's
    fallback, or else the spill-free tile with the fewest rows, or else (no spill-free tile for the type) the
    one that spills least."""
    if qtype not in GEMM_TYPES:
        raise KernelArgumentError(f"choose_tile: weight type {quant.type_name(qtype)} has no GEMM kernel")
    if T < 0 or N < 1 or K < 1:
        raise KernelArgumentError(f"choose_tile: bad extents T={T} N={N} K={K}")
    cls = kclass.kernel_class(limits)
    rpg = T if rows_per_group is None else rows_per_group
    sms = limits.sm_count

    def enough(bm: int, bn: int) -> bool:
        return not sms or loader.grid_for(N, bn) * loader.grid_for(T, bm) >= 0.9 * sms

    ok = [t for t in TILES_BY_CLASS[cls] if tile_fits(limits, qtype, t)]
    for t in _PREFERENCE[cls]:
        if t in ok and rpg >= (t[0] if t[0] == 128 else 0.6 * t[0]) and enough(*t):
            return t
    if _FALLBACK[cls] in ok:
        return _FALLBACK[cls]
    if ok:
        return min(ok, key=lambda t: (t[0] * t[1], t))
    return min(TILES_BY_CLASS[cls], key=lambda t: (tile_usage(cls, qtype, t) or (0, 1 << 30, 0))[1])


def split_count(limits: CardLimits, T: int, N: int, K: int, tile: tuple[int, int], room: int | None = None) -> int:
    """Parts to split the k chunks of Y[T, N] = X[T, K] W^T into, on `tile` under `limits`: 1 unless the product
    has too few tiles to give every multiprocessor (limits.sm_count; 0: unknown, no split) two blocks, whose
    lean bodies hide their loads behind each other (a Fermi card's 14 SMs rarely lack them; an H200's 132 do for a
    ViT's narrow products). Then as many as bring it to two blocks a multiprocessor, at most MAX_SPLIT, each of
    MIN_PART_CHUNKS chunks at least, and (room: the floats of the scratch the caller has) no more slabs of T x N
    than fit it."""
    cls = kclass.kernel_class(limits)
    if tuple(tile) not in SPLIT_TILES[cls] or not limits.sm_count or T < 1:
        return 1
    blocks = loader.grid_for(T, tile[0]) * loader.grid_for(N, tile[1])
    s = min(MAX_SPLIT, -(-2 * limits.sm_count // blocks), (K // 32) // MIN_PART_CHUNKS)
    if room is not None:
        s = min(s, room // (T * N))
    return max(1, s)


def pick_tile(rows_per_group: float, n_rows: int, n_cols: int, sm_count: int | None = None, qtype: int = quant.Q4_K,
              K: int = 256) -> tuple[int, int]:
    """choose_tile under the running card's (or its --card-profile's) limits."""
    lim = loader.limits()
    if sm_count is not None:
        from dataclasses import replace

        lim = replace(lim, sm_count=int(sm_count))
    return choose_tile(lim, n_rows, n_cols, K, qtype, rows_per_group)


def _launch(name: str, tile: tuple[int, int], x_ptr, w: DeviceWeight, y_ptr, offs_ptr, idx_ptr, n_group: int,
            m: int, n_tiles_t: int, stream, ksplit: int = 1):
    N, K = w.shape[-2], w.shape[-1]
    tiles = TILES_BY_CLASS[loader.kernel_class()]
    if tuple(tile) not in tiles:
        raise KernelArgumentError(f"gemm: tile {tile} not compiled for this card's class (have {tiles})")
    if max(m, N, K) >= 2**31 or w.row_nbytes >= 2**31:
        raise KernelArgumentError(f"gemm: extents M={m} N={N} K={K} exceed int32")
    bm, bn = tile
    wptr = _aligned(w.data.gpudata, _ALIGN.get(w.qtype, 2), "weight")
    grid = (min(loader.grid_for(N, bn), loader.MAX_GRID), max(1, min(n_tiles_t, loader.MAX_GRID)), ksplit)
    args = [x_ptr, wptr, y_ptr, offs_ptr, idx_ptr, np.int32(n_group), np.int32(m), np.int32(N), np.int32(K),
            np.int32(w.row_nbytes), np.int32(ksplit)]
    loader.launch(FAMILY, f"gemm_{name}_b{bm}_n{bn}", grid, (256,), args, stream=stream)


def _out(out, shape: tuple, what: str):
    if out is None:
        from pycuda import gpuarray

        return gpuarray.empty(shape, np.float32)
    loader.arg(out, np.float32, shape, what)
    return out


def gemm(x, w: DeviceWeight, out=None, tile: tuple[int, int] | None = None, stream=None, part=None,
         ksplit: int | None = None):
    """out[T, N] = x[T, K] @ W[N, K]^T.

    x: float32 (T, K) C-contiguous, 16-byte aligned; w: DeviceWeight of shape (N, K), type F32, F16, Q4_0,
    Q8_0, Q4_K, Q5_K or Q6_K; out: float32 (T, N) (allocated when None; must not overlap x).
    tile: (tokens, rows) of a block's output tile, one of TILES_BY_CLASS[class] (choose_tile's when None).
    part: a float32 scratch on the card (any shape, 16-byte aligned, overlapping neither x nor out) that lets the
    product split over K (split_count's parts, or `ksplit` when given: the partial sums go to part, ksplit slabs
    of T x N, and are added into out in order); None: no split. Returns out.
    """
    name = _check_weight(w, 2, GEMM_TYPES)
    N, K = w.shape
    T = int(x.shape[0]) if len(x.shape) == 2 else -1
    xp = _aligned(loader.arg(x, np.float32, (T, K), "gemm x"), 16, "gemm x")
    out = _out(out, (T, N), "gemm out")
    yp = _aligned(out.gpudata, 16, "gemm out")
    if T == 0:
        return out
    tile = tile or pick_tile(T, T, N, qtype=w.qtype, K=K)
    if ksplit is not None and part is None:
        raise KernelArgumentError(f"gemm: ksplit={ksplit} without a scratch `part` for its partial sums")
    s = 1 if part is None else int(ksplit or split_count(loader.limits(), T, N, K, tile, int(part.size)))
    if s == 1:
        _launch(name, tile, xp, w, yp, _NULL, _NULL, 1, T, loader.grid_for(T, tile[0]), stream)
        return out
    if tuple(tile) not in SPLIT_TILES[loader.kernel_class()] or not 1 < s <= K // 32:
        raise KernelArgumentError(f"gemm: tile {tile} with K={K} cannot split into {s} parts on this card's class")
    if part.dtype != np.float32 or part.size < s * T * N or s * T * N >= 2**31:
        raise KernelArgumentError(f"gemm: scratch {part.dtype} of {part.size} values for {s} parts of {T} x {N}")
    pp = _aligned(part.gpudata, 16, "gemm part")
    _launch(name, tile, xp, w, pp, _NULL, _NULL, 1, T, loader.grid_for(T, tile[0]), stream, ksplit=s)
    n = T * N
    loader.launch(FAMILY, "ksplit_sum", (min(loader.grid_for(n, 256), loader.MAX_GRID),), (256,),
                  [yp, pp, np.int32(s), np.int32(n)], stream=stream)
    return out


def gemm_grouped(x, w: DeviceWeight, offs, idx=None, out=None, tile: tuple[int, int] | None = None, stream=None):
    """Expert-grouped GEMM: out[r, :] = x[idx[r], :] @ W[e]^T for offs[e] <= r < offs[e+1].

    x: float32 (T, K) (T = M when idx is None: rows already in grouped order); w: DeviceWeight (E, N, K);
    offs: int32 (E+1,) on the card, non-decreasing from 0 with offs[E] == M (not checked: it stays on the
    card); idx: int32 (M,) row indices into x, or None; out: float32 (M, N), rows beyond offs[E] untouched.
    Experts with no rows cost one idle block each. Returns out.
    """
    name = _check_weight(w, 3, GEMM_TYPES)
    E, N, K = w.shape
    T = int(x.shape[0]) if len(x.shape) == 2 else -1
    xp = _aligned(loader.arg(x, np.float32, (T, K), "gemm_grouped x"), 16, "gemm_grouped x")
    op = loader.arg(offs, np.int32, (E + 1,), "gemm_grouped offs")
    if idx is None:
        M, ip = T, _NULL
    else:
        M = int(idx.shape[0]) if len(idx.shape) == 1 else -1
        ip = loader.arg(idx, np.int32, (M,), "gemm_grouped idx")
    out = _out(out, (M, N), "gemm_grouped out")
    yp = _aligned(out.gpudata, 16, "gemm_grouped out")
    if M == 0:
        return out
    tile = tile or pick_tile(M / E, M, N, qtype=w.qtype, K=K)
    # expert e owns ceil(n_e / bm) tiles: at most M / bm + E in all; blocks past the last tile exit
    _launch(name, tile, xp, w, yp, op, ip, E, M, loader.grid_for(M, tile[0]) + E, stream)
    return out

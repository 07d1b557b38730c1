"""Launchers for native/cuda_sm20/moe.cu: router (softmax, top-k, renormalise), stable counting sort of
the (token, slot) pairs by expert, gather of grouped inputs, and the deterministic combine (with the
gated shared expert).

All buffers are pycuda GPUArrays, C-contiguous; shapes and dtypes are checked by loader.arg() before
each launch. P = T*k pairs; pair p = t*k + s is slot s of token t.
"""

from __future__ import annotations

import numpy as np

from ...errors import KernelArgumentError
from . import loader

FAMILY = "moe"
MAX_E = 1024  # MOE_MAX_E
MAX_K = 16  # MOE_MAX_K
ROUTE_THREADS = 256
TILE = 256  # MOE_TILE
THREADS = 256
_NULL = np.intp(0)


def route(logits, k: int, ids, weights, stream=None) -> None:
    """Softmax over all E experts, top-k (ties: lower expert index), renormalised weights
    (denominator clamped to 2^-14, as llama.cpp): reference_ops.moe_route.

    logits (T, E) float32; ids (T, k) int32 output; weights (T, k) float32 output. E <= 1024, k <= 16.
    """
    T, E = logits.shape
    if not 1 <= k <= min(MAX_K, E) or E > MAX_E:
        raise KernelArgumentError(f"moe route: k={k}, E={E} (need 1 <= k <= {MAX_K}, k <= E <= {MAX_E})")
    args = [loader.arg(logits, np.float32, (T, E), "logits"), loader.arg(ids, np.int32, (T, k), "ids"),
            loader.arg(weights, np.float32, (T, k), "weights"), np.int32(T), np.int32(E), np.int32(k)]
    loader.launch(FAMILY, "moe_route", (min(T, loader.MAX_GRID),), (ROUTE_THREADS,), args, stream=stream)


def group_scratch_shape(n_pairs: int, n_expert: int) -> tuple[int, int]:
    """Shape of group()'s int32 scratch: per-tile histograms (n_tiles, E)."""
    return (loader.grid_for(n_pairs, TILE), n_expert)


def group(ids, weights, n_expert: int, counts, offsets, perm_tok, perm_w, row_of_pair, scratch=None,
          stream=None) -> None:
    """Stable counting sort of the pairs by expert (rows of one expert in token order).

    ids (T, k) int32 in [0, E); weights (T, k) float32;
    counts (E,) int32: pairs per expert; offsets (E+1,) int32: exclusive scan, offsets[E] = T*k;
    perm_tok (T*k,) int32: token of each grouped row; perm_w (T*k,) float32: its slot weight;
    row_of_pair (T, k) int32: grouped row of each (token, slot);
    scratch (n_tiles, E) int32 (group_scratch_shape), allocated when None.
    """
    T, k = ids.shape
    E, P = n_expert, T * k
    if not 1 <= E <= MAX_E:
        raise KernelArgumentError(f"moe group: E={E} outside 1..{MAX_E}")
    n_tiles = loader.grid_for(P, TILE)
    if n_tiles > loader.MAX_GRID:
        raise KernelArgumentError(f"moe group: {P} pairs need {n_tiles} tiles (> {loader.MAX_GRID})")
    if scratch is None:
        from pycuda import gpuarray

        scratch = gpuarray.empty((n_tiles, E), np.int32)
    p_ids = loader.arg(ids, np.int32, (T, k), "ids")
    p_w = loader.arg(weights, np.float32, (T, k), "weights")
    p_cnt = loader.arg(counts, np.int32, (E,), "counts")
    p_off = loader.arg(offsets, np.int32, (E + 1,), "offsets")
    p_tok = loader.arg(perm_tok, np.int32, (P,), "perm_tok")
    p_pw = loader.arg(perm_w, np.float32, (P,), "perm_w")
    p_row = loader.arg(row_of_pair, np.int32, (T, k), "row_of_pair")
    p_hist = loader.arg(scratch, np.int32, (n_tiles, E), "scratch")
    loader.launch(FAMILY, "moe_tile_rank", (n_tiles,), (TILE,), [p_ids, p_row, p_hist, np.int32(P), np.int32(E)],
                  stream=stream)
    block = max(32, 1 << (E - 1).bit_length())
    loader.launch(FAMILY, "moe_offsets", (1,), (block,), [p_hist, p_cnt, p_off, np.int32(n_tiles), np.int32(E)],
                  stream=stream)
    loader.launch(FAMILY, "moe_scatter", (n_tiles,), (TILE,),
                  [p_ids, p_w, p_off, p_hist, p_row, p_tok, p_pw, p_row, np.int32(P), np.int32(E), np.int32(k)],
                  stream=stream)


def gather_rows(x, perm_tok, xg, stream=None) -> None:
    """xg[row] = x[perm_tok[row]]. x (T, D) float32; perm_tok (P,) int32; xg (P, D) float32."""
    T, D = x.shape
    P = perm_tok.shape[0]
    args = [loader.arg(x, np.float32, (T, D), "x"), loader.arg(perm_tok, np.int32, (P,), "perm_tok"),
            loader.arg(xg, np.float32, (P, D), "xg"), np.int32(P), np.int32(D)]
    loader.launch(FAMILY, "moe_gather_rows", (loader.grid_for(D, THREADS), min(P, loader.MAX_GRID)), (THREADS,),
                  args, stream=stream)


def combine(y, row_of_pair, weights, out, shared_out=None, shared_gate_logit=None, stream=None) -> None:
    """out[t] = sum_s weights[t, s] * y[row_of_pair[t, s]] in slot order (weights None: plain sum, for
    outputs already scaled by perm_w), + sigmoid(shared_gate_logit[t]) * shared_out[t] when given.

    y (P, D) float32 grouped expert outputs; row_of_pair (T, k) int32; weights (T, k) float32 or None;
    out (T, D) float32; shared_out (T, D) float32 or None; shared_gate_logit (T,) float32 or None.
    """
    T, k = row_of_pair.shape
    D = out.shape[1] if len(out.shape) == 2 else -1
    if (shared_out is None) != (shared_gate_logit is None):
        raise KernelArgumentError("moe combine: shared_out and shared_gate_logit go together")
    args = [
        loader.arg(y, np.float32, (T * k, D), "y"),
        loader.arg(row_of_pair, np.int32, (T, k), "row_of_pair"),
        _NULL if weights is None else loader.arg(weights, np.float32, (T, k), "weights"),
        _NULL if shared_out is None else loader.arg(shared_out, np.float32, (T, D), "shared_out"),
        _NULL if shared_gate_logit is None else loader.arg(shared_gate_logit, np.float32, (T,), "shared_gate_logit"),
        loader.arg(out, np.float32, (T, D), "out"),
        np.int32(T), np.int32(D), np.int32(k),
    ]
    loader.launch(FAMILY, "moe_combine", (loader.grid_for(D, THREADS), min(T, loader.MAX_GRID)), (THREADS,), args,
                  stream=stream)


def shared_add(out, shared_out, gate_logit, stream=None) -> None:
    """out += sigmoid(gate_logit)[:, None] * shared_out. out, shared_out (T, D) float32; gate_logit (T,)."""
    T, D = out.shape
    args = [loader.arg(out, np.float32, (T, D), "out"), loader.arg(shared_out, np.float32, (T, D), "shared_out"),
            loader.arg(gate_logit, np.float32, (T,), "gate_logit"), np.int32(T), np.int32(D)]
    loader.launch(FAMILY, "moe_shared_add", (loader.grid_for(D, THREADS), min(T, loader.MAX_GRID)), (THREADS,),
                  args, stream=stream)

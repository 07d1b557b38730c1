"""SimdLib's Gated DeltaNet calls (a part of simd.py's SimdLib): the layer after its projections for T tokens of one
sequence (gdn_layer), and for one token of each of B sequences (gdn_rows, decode_batch), in C on the pool,
bit-identical to the numba oracle tests/oracles/numba_gdn.py's `gdn_layer`."""

from __future__ import annotations

import numpy as np

from .simd_native import _F32, _array, _check_rc, _exact, _ptr, _rows_fast


def gdn_scratch_size(conv_channels: int, n_v_heads: int, d_v: int, T: int = 1) -> int:
    """float32 elements of gdn_layer's scratch: one delta per value head and the conv outputs of T
    tokens. Any T >= 1 works; the layer runs in chunks of as many tokens as the scratch holds, and
    chunks of T >= 16 or so keep S[j] in cache during prefill."""
    return T * conv_channels + n_v_heads * d_v


class GDNCalls:
    """Mixed into SimdLib (which provides _ffi, _lib and _c)."""

    def _gdn_args(self, u, z, b, a, conv_w, ssm_a, dt_bias, norm_w, S0: np.ndarray, n_k_heads, y, scratch,
                  scratch_need) -> tuple:
        """The shape checks both calls share: (T, C, K, Hv, dk, dv, Hk, u/z/b/a/y row strides, pointers of conv_w,
        ssm_a, dt_bias, norm_w). S0: one sequence's S, for the head shapes."""
        S0 = _array("S", S0, (_F32,))
        if S0.ndim != 3 or 0 in S0.shape:
            raise ValueError(f"S must have shape (H_v, d_k, d_v), got {S0.shape}")
        Hv, dk, dv = S0.shape
        if type(n_k_heads) is not int and (isinstance(n_k_heads, bool) or not isinstance(n_k_heads, np.integer)):
            raise ValueError(f"n_k_heads must be a positive int, got {n_k_heads!r}")
        Hk = int(n_k_heads)
        if Hk < 1 or Hv % Hk:
            raise ValueError(f"n_k_heads must be a positive int dividing H_v = {Hv}, got {n_k_heads!r}")
        conv_w = _array("conv_w", conv_w, (_F32,))
        if conv_w.ndim != 2 or conv_w.shape[1] < 1:
            raise ValueError(f"conv_w must have shape (C, K), got {conv_w.shape}")
        C, K = conv_w.shape
        if C != 2 * Hk * dk + Hv * dv:
            raise ValueError(f"conv_w has {C} channels, expected 2*n_k_heads*d_k + H_v*d_v = "
                             f"{2 * Hk * dk + Hv * dv} (S {S0.shape}, n_k_heads {Hk})")
        if getattr(u, "ndim", None) != 2:
            _array("u", u, (_F32,))
            raise ValueError(f"u must have shape (T, {C}), got {u.shape}")
        T, us = _rows_fast("u", u, _F32, C)
        rows = [us]
        for name, arr, width, writable in (("z", z, Hv * dv, False), ("b", b, Hv, False), ("a", a, Hv, False),
                                           ("y", y, Hv * dv, True)):
            if getattr(arr, "ndim", None) != 2:
                _array(name, arr, (_F32,))
                raise ValueError(f"{name} must have shape ({T}, {width}), got {arr.shape}")
            rows.append(_rows_fast(name, arr, _F32, width, T, writable)[1])
        ptrs = [self._gdn_array(name, arr, shape, False)
                for name, arr, shape in (("conv_w", conv_w, (C, K)), ("ssm_a", ssm_a, (Hv,)),
                                         ("dt_bias", dt_bias, (Hv,)), ("norm_w", norm_w, (dv,)))]
        if not (type(scratch) is np.ndarray and scratch.dtype is _F32 and scratch.ndim == 1
                and scratch.flags.c_contiguous and scratch.flags.writeable):
            _array("scratch", scratch, (_F32,))
            raise ValueError(f"scratch must be a writable contiguous 1-D array, got shape {scratch.shape}")
        need = scratch_need(T, Hv * dv + C)
        if scratch.shape[0] < need:
            raise ValueError(f"scratch has {scratch.shape[0]} floats, needs at least {need}")
        return T, C, K, Hv, dk, dv, Hk, rows, ptrs

    def _gdn_array(self, name: str, arr, shape: tuple, writable: bool):
        if not (type(arr) is np.ndarray and arr.dtype is _F32 and arr.shape == shape and arr.flags.c_contiguous
                and (not writable or arr.flags.writeable)):
            arr = _exact(name, arr, shape, writable)
        return self._ffi.from_buffer("float[]", arr)

    def gdn_layer(self, u: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray, conv_w: np.ndarray,
                  ssm_a: np.ndarray, dt_bias: np.ndarray, norm_w: np.ndarray, conv: np.ndarray, S: np.ndarray,
                  n_k_heads: int, head_map_mod: bool, eps: float, y: np.ndarray, scratch: np.ndarray,
                  conv_in: np.ndarray | None = None, S_in: np.ndarray | None = None) -> None:
        """The Gated DeltaNet layer after its projections for T tokens, state (conv, S) in place: the C twin
        of the numba oracle's `gdn_layer` (same arguments, bit-identical results), its value heads split across the
        pool. u (T, C); z (T, H_v*d_v); b, a (T, H_v); y (T, H_v*d_v) (these may be views of wider rows,
        each row contiguous); conv_w (C, K), ssm_a, dt_bias (H_v,), norm_w (d_v,), conv (K-1, C),
        S (H_v, d_k, d_v), scratch (>= H_v*d_v + C,) C-contiguous; all float32, with
        C = 2*n_k_heads*d_k + H_v*d_v. A scratch of `gdn_scratch_size(C, H_v, d_v, Tc)` runs the
        tokens in chunks of Tc. conv_in, S_in (both or neither): the state before the first token, read and never
        written; the state after the T tokens goes to conv and S alone (the same bits as in place)."""
        T, C, K, Hv, dk, dv, Hk, rows, ptrs = self._gdn_args(u, z, b, a, conv_w, ssm_a, dt_bias, norm_w, S,
                                                             n_k_heads, y, scratch, lambda T, per: per)
        ptrs += [self._gdn_array("conv", conv, (K - 1, C), True), self._gdn_array("S", S, (Hv, dk, dv), True)]
        ffi = self._ffi
        if (conv_in is None) != (S_in is None):
            raise ValueError("gdn_layer takes conv_in and S_in together, or neither")
        src = [ffi.NULL, ffi.NULL] if S_in is None else [
            self._gdn_array("conv_in", conv_in, (K - 1, C), False), self._gdn_array("S_in", S_in, (Hv, dk, dv), False)]
        if S_in is not None and (np.may_share_memory(S_in, S) or np.may_share_memory(conv_in, conv)) and not (
                S_in is S and conv_in is conv):
            raise ValueError("gdn_layer's conv_in / S_in overlap conv / S without being them")
        rc = self._lib.hi_gdn_layer(self._c, _ptr(ffi, "float *", u), rows[0], _ptr(ffi, "float *", z), rows[1],
                                    _ptr(ffi, "float *", b), rows[2], _ptr(ffi, "float *", a), rows[3], *ptrs, T, C, K,
                                    Hv, dk, dv, Hk, 1 if head_map_mod else 0, float(eps), _ptr(ffi, "float *", y),
                                    rows[4], ffi.from_buffer("float[]", scratch), scratch.shape[0], *src)
        if rc:
            _check_rc(rc, "gdn_layer")

    def gdn_rows(self, u: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray, conv_w: np.ndarray,
                 ssm_a: np.ndarray, dt_bias: np.ndarray, norm_w: np.ndarray, convs, Ss, n_k_heads: int,
                 head_map_mod: bool, eps: float, y: np.ndarray, scratch: np.ndarray) -> None:
        """gdn_layer for one token of each of B sequences in one call: row j of u, z, b, a, y is sequence j's token,
        convs[j] (K-1, C) and Ss[j] (H_v, d_k, d_v) its states; scratch of at least B * (H_v*d_v + C) floats.
        Bit-identical to B gdn_layer calls of one token each."""
        convs, Ss = list(convs), list(Ss)
        if not Ss or len(convs) != len(Ss):
            raise ValueError(f"gdn_rows takes one conv and one S per sequence, got {len(convs)} and {len(Ss)}")
        T, C, K, Hv, dk, dv, Hk, rows, ptrs = self._gdn_args(u, z, b, a, conv_w, ssm_a, dt_bias, norm_w, Ss[0],
                                                             n_k_heads, y, scratch, lambda T, per: T * per)
        if T != len(Ss):
            raise ValueError(f"u has {T} rows for {len(Ss)} sequences")
        cp = [self._gdn_array(f"convs[{j}]", c, (K - 1, C), True) for j, c in enumerate(convs)]
        sp = [self._gdn_array(f"Ss[{j}]", s, (Hv, dk, dv), True) for j, s in enumerate(Ss)]
        ffi = self._ffi
        rc = self._lib.hi_gdn_rows(self._c, T, _ptr(ffi, "float *", u), rows[0], _ptr(ffi, "float *", z), rows[1],
                                   _ptr(ffi, "float *", b), rows[2], _ptr(ffi, "float *", a), rows[3], *ptrs, cp, sp,
                                   C, K, Hv, dk, dv, Hk, 1 if head_map_mod else 0, float(eps), _ptr(ffi, "float *", y),
                                   rows[4], ffi.from_buffer("float[]", scratch), scratch.shape[0])
        if rc:
            _check_rc(rc, "gdn_rows")

"""SimdLib's MoE decode calls (a part of simd.py's SimdLib): all k routed experts' products, and the shared
expert's beside them, in one pool task each."""

from __future__ import annotations

import numpy as np

from ...format.quant import type_name
from .simd_native import (
    _F32,
    _U8,
    GGML_NONE,
    _array,
    _check_rc,
    _ids,
    _one_matrix,
    _one_row,
    _op,
    _ptr,
    _qtype,
    _rows,
    _weights,
    act_kind,
    act_row_bytes,
    weight_row_bytes,
)


class MoECalls:
    """Mixed into SimdLib (which provides _ffi, _lib and _c)."""

    def moe_gate_up(self, w_gate: np.ndarray, gate_qtype, w_up: np.ndarray, up_qtype, rows: int, cols: int,
                    xq: np.ndarray, experts, gate_out: np.ndarray, up_out: np.ndarray,
                    ggml_op: int = GGML_NONE, shared=None) -> None:
        """MoE decode, gate and up fused in one call: for i < k, e = experts[i],
        gate_out[i] = W_gate[e] . x and up_out[i] = W_up[e] . x. W_gate, W_up are stacked expert tensors
        (ggml {cols, rows, E}: the raw bytes of all E experts, expert e's rows contiguous); xq is the one
        quantized input row (act_row_bytes(gate_qtype, cols),); gate_out, up_out (k, rows) float32.
        shared: (w_sg, sg_qtype, w_su, su_qtype, s_rows, s_gate_out, s_up_out), the shared expert's gate and
        up products of the same xq (s_rows x cols each; outs (s_rows,) float32) in the same pool task."""
        gq, uq = _qtype(gate_qtype), _qtype(up_qtype)
        if act_kind(gq) != act_kind(uq):
            raise ValueError(f"gate type {type_name(gq)} and up type {type_name(uq)} take different activation "
                             f"formats ({act_kind(gq)} vs {act_kind(uq)}); use two matmul calls")
        rows, cols = int(rows), int(cols)
        if rows < 1 or cols < 1:
            raise ValueError(f"rows and cols must be positive, got {rows} x {cols}")
        wg, ne_g = _weights("w_gate", w_gate, gq, weight_row_bytes(gq, cols), rows)
        wu, ne_u = _weights("w_up", w_up, uq, weight_row_bytes(uq, cols), rows)
        if ne_g != ne_u:
            raise ValueError(f"w_gate holds {ne_g} experts but w_up holds {ne_u}")
        ids = _ids("experts", experts, ne_g)
        k = ids.size
        xq = _array("xq", xq, (_U8,))
        ab = act_row_bytes(gq, cols)
        if xq.ndim == 2 and xq.shape[0] == 1:
            xq = xq[0]
        if xq.ndim != 1:
            raise ValueError(f"xq must be one quantized row of shape ({ab},), got {xq.shape}")
        _rows("xq", xq, ab)
        gate_out = _array("gate_out", gate_out, (_F32,))
        up_out = _array("up_out", up_out, (_F32,))
        for name, o in (("gate_out", gate_out), ("up_out", up_out)):
            if o.ndim != 2:
                raise ValueError(f"{name} must have shape ({k}, {rows}), got {o.shape}")
        _, gs = _rows("gate_out", gate_out, rows, k, writable=True)
        _, us = _rows("up_out", up_out, rows, k, writable=True)
        ffi = self._ffi
        sh = [0, ffi.NULL, 0, ffi.NULL, 0, ffi.NULL, ffi.NULL]
        if shared is not None:
            w_sg, sgq, w_su, suq, s_rows, s_g, s_u = shared
            sgq, suq, s_rows = _qtype(sgq), _qtype(suq), int(s_rows)
            if act_kind(sgq) != act_kind(gq) or act_kind(suq) != act_kind(gq):
                raise ValueError(f"shared types {type_name(sgq)}, {type_name(suq)} do not take {type_name(gq)}'s "
                                 "activation format")
            outs = [_one_row(f"shared {n}", o, _F32, s_rows, writable=True)
                    for n, o in (("gate_out", s_g), ("up_out", s_u))]
            sh = [sgq, _ptr(ffi, "uint8_t *", _one_matrix("shared w_gate", w_sg, sgq, cols, s_rows)), suq,
                  _ptr(ffi, "uint8_t *", _one_matrix("shared w_up", w_su, suq, cols, s_rows)), s_rows,
                  *(_ptr(ffi, "float *", o) for o in outs)]
        rc = self._lib.hi_moe_gate_up(self._c, gq, _ptr(ffi, "uint8_t *", wg), uq, _ptr(ffi, "uint8_t *", wu), ne_g,
                                      rows, cols, _ptr(ffi, "uint8_t *", xq), _ptr(ffi, "int32_t *", ids), k,
                                      _ptr(ffi, "float *", gate_out), gs, _ptr(ffi, "float *", up_out), us,
                                      _op(ggml_op), *sh)
        _check_rc(rc, "moe_gate_up")

    def moe_down(self, w: np.ndarray, qtype, rows: int, cols: int, xq: np.ndarray, experts,
                 out: np.ndarray, ggml_op: int = GGML_NONE, shared=None) -> None:
        """MoE decode, down projections of all k experts in one call: out[i] = W[experts[i]] . x[i], with
        xq (k, act_row_bytes(qtype, cols)) each expert's own quantized input and out (k, rows) float32.
        shared: (w_s, s_qtype, s_cols, s_xq, s_out), the shared expert's s_out = W_s . s_x (rows x s_cols;
        s_xq one row in xq's activation format, s_out (rows,) float32) in the same pool task."""
        q = _qtype(qtype)
        rows, cols = int(rows), int(cols)
        if rows < 1 or cols < 1:
            raise ValueError(f"rows and cols must be positive, got {rows} x {cols}")
        w, ne = _weights("w", w, q, weight_row_bytes(q, cols), rows)
        ids = _ids("experts", experts, ne)
        k = ids.size
        xq = _array("xq", xq, (_U8,))
        ab = act_row_bytes(q, cols)
        if xq.ndim != 2:
            raise ValueError(f"xq must have shape ({k}, {ab}), got {xq.shape}")
        _, xs = _rows("xq", xq, ab, k)
        out = _array("out", out, (_F32,))
        if out.ndim != 2:
            raise ValueError(f"out must have shape ({k}, {rows}), got {out.shape}")
        _, os_ = _rows("out", out, rows, k, writable=True)
        ffi = self._ffi
        sh = [0, ffi.NULL, 0, ffi.NULL, ffi.NULL]
        if shared is not None:
            w_s, sq, s_cols, s_xq, s_out = shared
            sq, s_cols = _qtype(sq), int(s_cols)
            if act_kind(sq) != act_kind(q):
                raise ValueError(f"shared type {type_name(sq)} does not take {type_name(q)}'s activation format")
            s_xq = _one_row("shared xq", s_xq, _U8, act_row_bytes(sq, s_cols))
            s_out = _one_row("shared out", s_out, _F32, rows, writable=True)
            sh = [sq, _ptr(ffi, "uint8_t *", _one_matrix("shared w", w_s, sq, s_cols, rows)), s_cols,
                  _ptr(ffi, "uint8_t *", s_xq), _ptr(ffi, "float *", s_out)]
        rc = self._lib.hi_moe_down(self._c, q, _ptr(ffi, "uint8_t *", w), ne, rows, cols, _ptr(ffi, "uint8_t *", xq),
                                   xs, _ptr(ffi, "int32_t *", ids), k, _ptr(ffi, "float *", out), os_, _op(ggml_op),
                                   *sh)
        _check_rc(rc, "moe_down")

    def moe_grouped(self, weights, rows: int, cols: int, xq: np.ndarray, experts, starts, outs,
                    ggml_op: int = GGML_NONE) -> None:
        """MoE over several tokens, grouped by expert: the routed (token, slot) pairs' quantized input rows
        xq (npairs, act_row_bytes) sorted by expert, group g (expert experts[g]) holding rows starts[g] ..
        starts[g+1]-1 (starts[0] = 0, starts[-1] = npairs, increasing); for each (w, qtype) in `weights` (one or two
        stacked expert tensors of `rows` x `cols` matrices, e.g. gate and up, taking one activation format) and its
        out (npairs, rows) float32 in `outs`: out[p] = W[experts[g]] . x[p] for p in group g. Pool tasks of up to
        130 jobs (two per group with gate and up), each selected expert's rows read once for all its pairs; with
        GGML_DECODE_ROWS each row as that token alone would get it."""
        weights, outs = list(weights), list(outs)
        if not 1 <= len(weights) <= 2 or len(outs) != len(weights):
            raise ValueError(f"moe_grouped takes one or two (w, qtype) and as many outs, got {len(weights)} and "
                             f"{len(outs)}")
        rows, cols = int(rows), int(cols)
        if rows < 1 or cols < 1:
            raise ValueError(f"rows and cols must be positive, got {rows} x {cols}")
        qts, wps, ne = [], [], None
        for j, (w, qt) in enumerate(weights):
            q = _qtype(qt)
            if qts and act_kind(q) != act_kind(qts[0]):
                raise ValueError(f"weights take different activation formats ({act_kind(qts[0])} and {act_kind(q)})")
            w, n = _weights(f"weights[{j}]", w, q, weight_row_bytes(q, cols), rows)
            if ne is not None and n != ne:
                raise ValueError(f"weights[{j}] holds {n} experts, weights[0] {ne}")
            ne = n
            qts.append(q)
            wps.append(w)
        xq = _array("xq", xq, (_U8,))
        if xq.ndim != 2:
            raise ValueError(f"xq must have shape (npairs, {act_row_bytes(qts[0], cols)}), got {xq.shape}")
        npairs, xs = _rows("xq", xq, act_row_bytes(qts[0], cols))
        ex = np.ascontiguousarray(experts, dtype=np.int32)
        st = np.ascontiguousarray(starts, dtype=np.int64)
        if ex.ndim != 1 or st.shape != (ex.size + 1,) or ex.size == 0:
            raise ValueError(f"experts (G,) and starts (G + 1,) do not fit: {ex.shape} and {st.shape}")
        if st[0] != 0 or st[-1] != npairs or (np.diff(st) <= 0).any():
            raise ValueError(f"starts must rise from 0 to npairs={npairs} with no empty group, got {st.tolist()}")
        if ((ex < 0) | (ex >= ne)).any():
            raise ValueError(f"experts holds an id outside [0, {ne})")
        os_ = None
        for j, o in enumerate(outs):
            o = _array(f"outs[{j}]", o, (_F32,))
            if o.ndim != 2:
                raise ValueError(f"outs[{j}] must have shape ({npairs}, {rows}), got {o.shape}")
            _, s = _rows(f"outs[{j}]", o, rows, npairs, writable=True)
            if os_ is not None and s != os_:
                raise ValueError("outs must have the same row stride")
            os_ = s
        ffi = self._ffi
        rc = self._lib.hi_moe_grouped(
            self._c, len(qts), qts, [_ptr(ffi, "uint8_t *", w) for w in wps], ne, rows, cols,
            _ptr(ffi, "uint8_t *", xq), xs, npairs, ex.size, _ptr(ffi, "int32_t *", ex), _ptr(ffi, "int64_t *", st),
            [_ptr(ffi, "float *", o) for o in outs], os_, _op(ggml_op), ffi.NULL, 0, ffi.NULL, 0)
        if rc:
            _check_rc(rc, "moe_grouped")

    def moe_rows_scratch(self, n_pairs: int, n_expert: int, qtype, n_embd: int) -> int:
        """Bytes of the scratch moe_rows needs for n_pairs (token, expert) pairs of inputs for weight type qtype."""
        n = self._lib.hi_moe_rows_scratch(int(n_pairs), int(n_expert), act_row_bytes(_qtype(qtype), int(n_embd)),
                                          int(n_embd))
        if n < 0:
            raise ValueError(f"moe_rows_scratch: bad sizes ({n_pairs} pairs, {n_expert} experts, {n_embd} columns)")
        return int(n)

    def moe_rows(self, gate, up, down, n_ff: int, n_embd: int, xq: np.ndarray, idx: np.ndarray, eg: np.ndarray,
                 eu: np.ndarray, hq: np.ndarray, ys: np.ndarray, scratch: np.ndarray,
                 ggml_op: int = GGML_NONE, shared=None) -> None:
        """The routed experts of T tokens in one call: for pair p = t*k + j and e = idx[t, j],
        ys[p] = W_down[e] . q(swiglu(W_gate[e] . x_t, W_up[e] . x_t)), the pairs grouped by expert so each selected
        expert is read once (moe_rows.c). gate, up, down: (raw stacked expert tensor, qtype), gate and up n_ff x
        n_embd per expert, down n_embd x n_ff; xq (T, act_row_bytes(gate type, n_embd)) the tokens' quantized rows;
        idx (T, k) int32; eg, eu (T*k, n_ff) float32 and hq (T*k, act_row_bytes(down type, n_ff)) uint8 work rows;
        ys (T*k, n_embd) float32; scratch uint8 of moe_rows_scratch bytes. ggml_op as in moe_grouped.
        shared: None, or (w_sg, w_su, w_sd, s_out), a shared expert of the routed experts' types and shapes (one
        expert's matrices) computed in the same pool runs into s_out (T, n_embd) float32, each row as its own
        products give it; eg, eu and hq then hold T*k + T rows (the shared expert's last) and the scratch is
        moe_rows_scratch(T*k + T, ...)."""
        (wg, gq), (wu, uq), (wd, dq) = ((w, _qtype(q)) for w, q in (gate, up, down))
        n_ff, n_embd = int(n_ff), int(n_embd)
        if n_ff < 1 or n_embd < 1:
            raise ValueError(f"n_ff and n_embd must be positive, got {n_ff} and {n_embd}")
        if act_kind(gq) != act_kind(uq):
            raise ValueError(f"gate type {type_name(gq)} and up type {type_name(uq)} take different activation "
                             f"formats ({act_kind(gq)} vs {act_kind(uq)})")
        wg, ne = _weights("gate", wg, gq, weight_row_bytes(gq, n_embd), n_ff)
        wu, ne_u = _weights("up", wu, uq, weight_row_bytes(uq, n_embd), n_ff)
        wd, ne_d = _weights("down", wd, dq, weight_row_bytes(dq, n_ff), n_embd)
        if not ne == ne_u == ne_d:
            raise ValueError(f"gate, up and down hold {ne}, {ne_u} and {ne_d} experts")
        idx = _array("idx", idx, (np.dtype(np.int32),))
        if idx.ndim != 2 or not idx.flags.c_contiguous or 0 in idx.shape:
            raise ValueError(f"idx must be a C-contiguous (T, k) int32 array, got shape {idx.shape}")
        T, k = idx.shape
        n = T * k
        if idx.min() < 0 or idx.max() >= ne:
            raise ValueError(f"idx holds an expert id outside [0, {ne})")
        ffi = self._ffi
        sh = [ffi.NULL] * 4
        if shared is not None:
            (sg, sgq), (su, suq), (sd, sdq), s_out = shared
            if (_qtype(sgq), _qtype(suq), _qtype(sdq)) != (gq, uq, dq):
                raise ValueError(f"the shared expert's types {type_name(_qtype(sgq))}, {type_name(_qtype(suq))}, "
                                 f"{type_name(_qtype(sdq))} are not the routed experts' {type_name(gq)}, "
                                 f"{type_name(uq)}, {type_name(dq)}")
            sws = [_one_matrix(f"shared {nm}", w, q, c, r)
                   for nm, w, q, c, r in (("gate", sg, gq, n_embd, n_ff), ("up", su, uq, n_embd, n_ff),
                                          ("down", sd, dq, n_ff, n_embd))]
            s_out = _array("s_out", s_out, (_F32,))
            if _rows("s_out", s_out, n_embd, T, writable=True)[1] != n_embd:
                raise ValueError(f"s_out must have rows {n_embd} floats apart, as the pairs' outputs")
            sh = [_ptr(ffi, "uint8_t *", w) for w in sws] + [_ptr(ffi, "float *", s_out)]
        nr = n + (T if shared is not None else 0)  # work rows: the pairs', then the shared expert's
        xq = _array("xq", xq, (_U8,))
        _, xs = _rows("xq", xq, act_row_bytes(gq, n_embd), T)
        _, es = _rows("eg", _array("eg", eg, (_F32,)), n_ff, nr, writable=True)
        if _rows("eu", _array("eu", eu, (_F32,)), n_ff, nr, writable=True)[1] != es:
            raise ValueError("eg and eu must have the same row stride")
        _, hs = _rows("hq", _array("hq", hq, (_U8,)), act_row_bytes(dq, n_ff), nr, writable=True)
        _, ysr = _rows("ys", _array("ys", ys, (_F32,)), n_embd, n, writable=True)
        scratch = _array("scratch", scratch, (_U8,))
        need = self.moe_rows_scratch(nr, ne, gq, n_embd)
        if scratch.ndim != 1 or not scratch.flags.c_contiguous or scratch.nbytes < need:
            raise ValueError(f"scratch must be a contiguous uint8 array of at least {need} bytes, got {scratch.shape}")
        rc = self._lib.hi_moe_rows(
            self._c, gq, _ptr(ffi, "uint8_t *", wg), uq, _ptr(ffi, "uint8_t *", wu), dq, _ptr(ffi, "uint8_t *", wd),
            ne, n_ff, n_embd, _ptr(ffi, "uint8_t *", xq), xs, T, _ptr(ffi, "int32_t *", idx), k,
            _ptr(ffi, "float *", eg), _ptr(ffi, "float *", eu), es, _ptr(ffi, "uint8_t *", hq), hs,
            _ptr(ffi, "float *", ys), ysr, _ptr(ffi, "uint8_t *", scratch), scratch.nbytes, _op(ggml_op), *sh,
            n_embd)
        _check_rc(rc, "moe_rows")

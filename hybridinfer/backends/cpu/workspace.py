"""The CPU backend's work buffers: one Workspace per chunk-size class and context size, made once and reused, so
the decode loop allocates no arrays (backend.py makes and keeps them)."""

from __future__ import annotations

import numpy as np

from ...models.state_kinds import kind_of
from .simd_gdn import gdn_scratch_size


class Workspace:
    """Every activation buffer of one forward pass over up to T tokens with a cache of n_ctx rows; each mixer op's
    own (`op_<op>`, models/state_kinds.py names the op of each layer's kind) for the ops the layers use."""

    def __init__(self, model, T: int, n_ctx: int, rows: bool = False, verify: bool = False):
        a, simd = model.args, model.simd
        f = _zeros
        D = a.n_embd
        self.T, self.n_ctx = T, n_ctx
        self.shared = model.shared_scratch  # buffers every workspace of the model shares
        # decode (T = 1, `rows`: one token of each of T sequences, or `verify`: T tokens of one sequence, a
        # speculative verify step): native calls bound to these buffers once
        self.bind = T == 1 or rows or verify
        # a verify step of several sequences (CPUModel.workspace's split): each attention call is recorded at its own
        # sequence's position (replay.at_pos), not at one position for the whole step
        self.own_pos = False
        self.calls: dict[tuple, object] = {}
        self.rec: list | None = None  # decode: the step being recorded (every operation, in order)
        self.replays: dict = {}  # decode: recorded steps by id(state) (BatchReplay: by the states' ids)
        self.tok = np.zeros(T if rows or verify else 1, np.int32)  # decode: the step's tokens
        # verify: per GDN layer, its inputs' copies (kept for a rollback, cpu/verify.py), weights and scalars
        self.gdn_keep: dict | None = {} if verify else None
        self.h, self.x, self.mix, self.ffn = f(T, D), f(T, D), f(T, D), f(T, D)
        mats = model.mats
        widest = max(m.rows for m in mats if m is not model.out)
        self.out_a, self.out_b, self.out_c = f(T, widest), f(T, widest), f(T, widest)
        self.outs = [self.out_a, self.out_b, self.out_c]  # the outputs of one input's products (CPUOps.linears)
        self.xq: dict[str, np.ndarray] = {}
        for m in mats:
            kind, nb = simd.act_kind(m.qtype), simd.act_row_bytes(m.qtype, max(m.cols, D))
            if kind not in self.xq or self.xq[kind].shape[1] < nb:
                self.xq[kind] = np.zeros((max(T, getattr(a, "n_expert_used", 1) * T + T), nb), np.uint8)
        self.logits = f(T, model.out.rows)
        for op in dict.fromkeys(kind_of(t).op for t in a.layer_types):  # the buffers of the mixers' ops
            getattr(self, f"op_{op}")(a, simd, T, n_ctx, rows)
        if a.is_moe:
            k = a.n_expert_used
            self.router = f(T, a.n_expert)
            self.route_idx, self.route_w = np.zeros((T, k), np.int32), f(T, k)
            # a shared expert as wide as the routed ones: its rows follow theirs (CPUOps.moe_impl), one for decode,
            # T for moe_rows
            self.eg, self.eu, self.ed = f(T * k + T, a.n_ff_exp), f(T * k + T, a.n_ff_exp), f(T * k, D)
            if T > 1:  # moe_rows: its gathered inputs, outputs in expert order and grouping
                need = max(simd.moe_rows_scratch(T * k + T, a.n_expert, L["ffn_gate_exps"].qtype, D)
                           for L in model.layers if "ffn_gate_exps" in L)
                self.moe_scratch = np.zeros(need, np.uint8)

    def op_attention(self, a, simd, T: int, n_ctx: int, rows: bool) -> None:
        hd = a.head_dim
        self.q, self.gate = _zeros(T, a.n_head, hd), _zeros(T, a.n_head * hd)
        self.attn = _zeros(T, a.n_head * hd)
        # one scratch per cache size for every workspace (one call runs at a time), with room for the query heads
        # that share a K/V head to go together
        G = a.n_head // a.n_head_kv
        key = ("attn", n_ctx, hd, G)
        if key not in self.shared:
            self.shared[key] = _zeros(simd.attention_scratch_size(n_ctx, hd, G))
        self.attn_scratch = self.shared[key]

    def op_gdn(self, a, simd, T: int, n_ctx: int, rows: bool) -> None:
        self.outs.append(_zeros(T, a.ssm_n_v_heads))  # the 4th of GDN's products (alpha)
        self.gdn_y = _zeros(T, a.ssm_n_v_heads * a.ssm_d_v)
        per = a.ssm_n_v_heads * a.ssm_d_v + a.ssm_conv_channels  # gdn_rows: one token of each sequence
        self.gdn_scratch = _zeros(max(gdn_scratch_size(a.ssm_conv_channels, a.ssm_n_v_heads, a.ssm_d_v, min(T, 16)),
                                      T * per if rows else 0))


def _zeros(*shape) -> np.ndarray:
    return np.zeros(shape, np.float32)



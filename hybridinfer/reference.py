"""The numpy reference forward pass: the oracle every backend is tested against.

Weights are dequantized exactly (float32) and cached; activations are float32 with float64 norms and
softmax. One `forward(tokens, state)` serves prefill (many tokens) and decode (one token): both read and
write the same `DecoderState`.
"""

from __future__ import annotations

import numpy as np

from . import actquant
from . import reference_ops as op
from .backends import Backend
from .gguf_model import GGUFModel
from .quant import dequantize, dequantize_rows
from .state import DecoderState, check_tokens

F16 = 1  # ggml type id


class Weights:
    """Dequantized tensors by GGUF name, cached; stacked expert tensors are sliced per expert.

    act_quant: multiply as llama.cpp does, quantizing activations to Q8_0/Q8_1 for 32-block weight
    types (see actquant.py) and to fp16 for F16 weights; other types use exact float32 weights.
    """

    def __init__(self, gm: GGUFModel, cache: bool = True, act_quant: bool = False):
        self.gm, self.cache, self.act_quant = gm, cache, act_quant
        self._c: dict[tuple, np.ndarray] = {}

    def mm(self, name: str, x: np.ndarray, expert: int | None = None) -> np.ndarray:
        """x (T, in) @ W.T for the tensor `name` (or expert `expert` of a stacked tensor)."""
        if self.act_quant:
            t = self.gm.tensor(name)
            if actquant.supports(t.qtype):
                raw = t.raw()
                if expert is not None:
                    per = t.nbytes // t.ne[2]
                    raw = raw[expert * per : (expert + 1) * per]
                return actquant.qmatmul(x, raw, t.qtype, t.ne[1], t.ne[0])
            if t.qtype == F16:
                x = x.astype(np.float16).astype(np.float32)
        w = self(name) if expert is None else self.expert(name, expert)
        return x @ w.T

    def __call__(self, name: str) -> np.ndarray:
        key = (name,)
        if key not in self._c:
            w = self.gm.dequant(name)
            if not self.cache:
                return w
            self._c[key] = w
        return self._c[key]

    def has(self, name: str) -> bool:
        return self.gm.has(name)

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D tensor (numpy order), dequantizing only those rows."""
        if (name,) in self._c:
            return self._c[(name,)][ids]
        t = self.gm.tensor(name)
        return dequantize_rows(t.raw(), t.qtype, t.ne[0], ids, np.empty((len(ids), t.ne[0]), np.float32))

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert e of a stacked tensor {in, out, E}: a (out, in) float32 matrix."""
        key = (name, e)
        if key not in self._c:
            t = self.gm.tensor(name)
            n_in, n_out, n_e = t.ne
            per = t.nbytes // n_e
            w = dequantize(t.raw()[e * per : (e + 1) * per], t.qtype, (n_out, n_in))
            if not self.cache:
                return w
            self._c[key] = w
        return self._c[key]


class Layer:
    """Tensors of block i by their GGUF names: `layer.attn_q` is `blk.i.attn_q.weight`,
    `layer.ssm_a` is `blk.i.ssm_a`, `layer.ssm_dt_bias` is `blk.i.ssm_dt.bias`."""

    def __init__(self, w: Weights, i: int):
        self._w, self._p = w, f"blk.{i}."

    def name(self, attr: str) -> str:
        p = self._p
        if attr.endswith("_bias"):
            return p + attr[: -len("_bias")] + ".bias"
        if self._w.has(p + attr + ".weight"):
            return p + attr + ".weight"
        return p + attr

    def __getattr__(self, attr: str) -> np.ndarray:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return self._w(self.name(attr))

    def has(self, attr: str) -> bool:
        return self._w.has(self.name(attr))

    def mm(self, attr: str, x: np.ndarray, expert: int | None = None) -> np.ndarray:
        return self._w.mm(self.name(attr), x, expert)

    def swiglu(self, x: np.ndarray, suffix: str = "", expert: int | None = None) -> np.ndarray:
        """W_down (SiLU(W_gate x) * W_up x) with the block's ffn_{gate,up,down}{suffix} tensors."""
        h = op.silu(self.mm("ffn_gate" + suffix, x, expert)) * self.mm("ffn_up" + suffix, x, expert)
        return self.mm("ffn_down" + suffix, h, expert)


class ReferenceModel(Backend):
    """backend="reference": the exact numpy oracle (float activations unless act_quant); slow by design."""

    def __init__(self, gm: GGUFModel, args, cache_weights: bool = True, act_quant: bool = False,
                 kv_f16: bool = False):
        """act_quant and kv_f16 reproduce llama.cpp's rounding (Q8 activations, F16 K/V cache) for
        comparisons with it; the defaults are the exact float32 reference."""
        self.gm, self.args, self.kv_f16, self.act_quant = gm, args, kv_f16, act_quant
        self.norm = op.rms_norm_ggml if act_quant else op.rms_norm
        self.w = Weights(gm, cache=cache_weights, act_quant=act_quant)
        self.layers = [Layer(self.w, i) for i in range(args.n_layer)]
        self.freq_factors = self.w("rope_freqs.weight") if getattr(args, "has_rope_freqs", False) else None

    @property
    def numeric_path(self) -> str:
        return "reference" + (":act_quant" if self.act_quant else "") + (":kv_f16" if self.kv_f16 else "")

    def preload(self, progress: bool = False) -> None:
        """Dequantize every tensor now (with a progress bar) instead of on first use."""
        names = [n for n in self.gm.tensors if not n.endswith("_exps.weight")]
        if progress:
            from tqdm import tqdm

            names = tqdm(names, desc="loading", unit="tensor", leave=False)
        for n in names:
            self.w(n)

    def new_state(self, n_ctx: int) -> DecoderState:
        return DecoderState.new(self.args, n_ctx)

    def forward(self, tokens, state: DecoderState, all_logits: bool = True) -> np.ndarray:
        """Consume `tokens` from `state` (advancing it); logits (T, n_vocab), or (1, n_vocab) for the
        last token when all_logits is False."""
        ids = check_tokens(tokens, self.args.n_vocab)
        T = len(ids)
        state.check_room(T)
        a = self.args
        h = self.w.rows("token_embd.weight", ids)
        for i, kind in enumerate(a.layer_types):
            L = self.layers[i]
            x = self.norm(h, L.attn_norm, a.rms_eps)
            if kind == "gdn":
                h = h + self.gdn(L, i, x, state)
            else:
                h = h + self.attention(L, i, x, state)
            post = L.post_attention_norm if a.arch != "llama" else L.ffn_norm
            x = self.norm(h, post, a.rms_eps)
            h = h + (self.moe(L, x) if a.is_moe else L.swiglu(x))
        state.tokens[state.pos : state.pos + T] = ids
        state.pos += T
        if not all_logits:
            h = h[-1:]
        x = self.norm(h, self.w("output_norm.weight"), a.rms_eps)
        return self.w.mm("token_embd.weight" if a.tied_output else "output.weight", x).astype(np.float32)

    # mixers ---------------------------------------------------------------------------------------
    def attention(self, L: Layer, i: int, x: np.ndarray, st: DecoderState) -> np.ndarray:
        a, T, p0 = self.args, x.shape[0], st.pos
        hd = a.head_dim
        if a.attn_gate:  # per head: [query(hd), gate(hd)]
            qg = L.mm("attn_q", x).reshape(T, a.n_head, 2, hd)
            q, gate = qg[:, :, 0], qg[:, :, 1].reshape(T, a.n_head * hd)
        else:
            q, gate = L.mm("attn_q", x).reshape(T, a.n_head, hd), None
        k = L.mm("attn_k", x).reshape(T, a.n_head_kv, hd)
        v = L.mm("attn_v", x).reshape(T, a.n_head_kv, hd)
        if a.qk_norm:
            q = op.rms_norm(q, L.attn_q_norm, a.rms_eps)
            k = op.rms_norm(k, L.attn_k_norm, a.rms_eps)
        pos = np.arange(p0, p0 + T)
        q = op.rope(q, pos, a.n_rot, a.rope_theta, a.rope_neox, self.freq_factors)
        k = op.rope(k, pos, a.n_rot, a.rope_theta, a.rope_neox, self.freq_factors)
        if self.kv_f16:
            k, v = k.astype(np.float16), v.astype(np.float16)
        st.k[i][p0 : p0 + T] = k
        st.v[i][p0 : p0 + T] = v
        o = op.causal_attention(q, st.k[i][: p0 + T], st.v[i][: p0 + T], p0).reshape(T, a.n_head * hd)
        if gate is not None:
            o = o * op.sigmoid(gate)
        return L.mm("attn_output", o)

    def gdn(self, L: Layer, i: int, x: np.ndarray, st: DecoderState) -> np.ndarray:
        a, T = self.args, x.shape[0]
        Hk, Hv, dk, dv = a.ssm_n_k_heads, a.ssm_n_v_heads, a.ssm_d_k, a.ssm_d_v
        u = L.mm("attn_qkv", x)  # (T, C)
        z = L.mm("attn_gate", x).reshape(T, Hv, dv)
        b = L.mm("ssm_beta", x)  # (T, H_v)
        al = L.mm("ssm_alpha", x)
        c, st.conv[i][...] = op.causal_conv(u, st.conv[i], L.ssm_conv1d)
        c = op.silu(c)
        q = c[:, : Hk * dk].reshape(T, Hk, dk)
        k = c[:, Hk * dk : 2 * Hk * dk].reshape(T, Hk, dk)
        v = c[:, 2 * Hk * dk :].reshape(T, Hv, dv)
        q = op.l2_norm(q, a.rms_eps) / np.float32(np.sqrt(dk))
        k = op.l2_norm(k, a.rms_eps)
        kmap = np.arange(Hv) % Hk if a.gdn_head_map == "mod" else np.arange(Hv) // (Hv // Hk)
        g = L.ssm_a[None, :] * op.softplus(al + L.ssm_dt_bias[None, :])
        beta = op.sigmoid(b)
        o = op.delta_rule(q[:, kmap], k[:, kmap], v, g, beta, st.ssm[i])
        y = op.rms_norm(o, L.ssm_norm, a.rms_eps) * op.silu(z)
        return L.mm("ssm_out", y.reshape(T, Hv * dv))

    def moe(self, L: Layer, x: np.ndarray) -> np.ndarray:
        a = self.args
        idx, wts = op.moe_route(L.mm("ffn_gate_inp", x), a.n_expert_used)
        out = np.zeros_like(x)
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            y = L.swiglu(x[rows], "_exps", expert=int(e))
            out[rows] += wts[rows, slot][:, None] * y
        if a.n_ff_shexp:
            s = L.swiglu(x, "_shexp")
            gate = op.sigmoid(x @ L.ffn_gate_inp_shexp.reshape(-1))
            out += gate[:, None] * s
        return out

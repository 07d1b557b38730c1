"""The numpy reference forward pass: the oracle every backend is tested against.

Weights are dequantized exactly (float32) and cached; activations are float32 with float64 norms and
softmax. One `forward(tokens, state)` serves prefill (many tokens) and decode (one token): both read and
write the same `DecoderState`.
"""

from __future__ import annotations

import numpy as np

from ..errors import MTPUnavailableError
from ..format.gguf_model import GGUFModel
from ..format.quant import dequantize, dequantize_rows
from ..format.quant_types import act_of
from ..models import graph, mrope
from ..models.graph import BlockTensors, block_names
from ..models.state_kinds import cache_path, cache_types, kv_rotation, sequence_layer_types
from . import Backend, actquant
from . import reference_ops as op
from .state import DecoderState, check_tokens, keep_rows


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
            if act_of(t.qtype) == "f16":  # the input rounded to fp16, as llama.cpp's F16 products take it
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


class Layer(BlockTensors):
    """Tensors of block i by their short names (models/graph.BlockTensors): `layer["attn_q"]` is `blk.i.attn_q.weight`
    dequantized, `layer["ssm_dt.bias"]` is `blk.i.ssm_dt.bias`; `mm` multiplies by one."""

    def __init__(self, w: Weights, i: int):
        super().__init__(i, block_names(w.gm.tensors, i), w)
        self._w = w

    def mm(self, short: str, x: np.ndarray, expert: int | None = None) -> np.ndarray:
        return self._w.mm(self.name(short), x, expert)


class ReferenceModel(Backend):
    """backend="reference": the exact numpy oracle (float activations unless act_quant); slow by design."""

    def __init__(self, gm: GGUFModel, args, cache_weights: bool = True, act_quant: bool = False):
        """act_quant reproduces llama.cpp's rounding of Q8 activations for comparisons with it; the default is the
        exact float32 reference. The K/V rows are kept in args' cache types (gguf.quants' blocks), and a query is
        rounded as llama.cpp's flash attention rounds it for them (reference_ops.kv_query)."""
        self.gm, self.args, self.act_quant = gm, args, act_quant
        self.norm = op.rms_norm_ggml if act_quant else op.rms_norm
        self.w = Weights(gm, cache=cache_weights, act_quant=act_quant)
        self.layers = [Layer(self.w, i) for i in range(args.n_layer)]
        self.blocks = graph.branches(args)
        self.embed, self.head = graph.arch_of(args).EMBED, graph.head(args)
        self.freq_factors = self.w("rope_freqs.weight") if getattr(args, "has_rope_freqs", False) else None
        self.keep_hidden, self.hidden_kept = False, {}  # Backend.hidden_rows
        self.mtp_block = graph.mtp(args)
        self.mtp_layer = None if self.mtp_block is None else Layer(self.w, self.mtp_block.block)

    @property
    def numeric_path(self) -> str:
        return "reference" + (":act_quant" if self.act_quant else "") + cache_path(self.args)

    def preload(self, progress: bool = False) -> None:
        """Dequantize every tensor now (with a progress bar) instead of on first use."""
        names = [n for n in self.gm.tensors if not n.endswith("_exps.weight")]
        if progress:
            from tqdm import tqdm

            names = tqdm(names, desc="loading", unit="tensor", leave=False)
        for n in names:
            self.w(n)

    def new_state(self, n_ctx: int) -> DecoderState:
        return DecoderState.new(self.args, n_ctx, sequence_layer_types(self.args, self.mtp_rows))

    def forward(self, tokens, state: DecoderState, all_logits: bool = True) -> np.ndarray:
        """Consume `tokens` from `state` (advancing it); logits (T, n_vocab), or (1, n_vocab) for the
        last token when all_logits is False. Walks the architecture's description (models/graph.py)."""
        x = self._walk(tokens, state, all_logits)
        if self.keep_hidden:
            keep_rows(self.hidden_kept, state, state.pos - x.shape[0], x)
        return self.w.mm(self.head[1], x).astype(np.float32)

    def hidden_rows(self, state):
        return self.hidden_kept.get(id(state))

    def hidden(self, tokens, state: DecoderState) -> np.ndarray:
        """The final norm's output of each token (what the head reads), (T, n_embd) float32; advances the state."""
        return np.asarray(self._walk(tokens, state, True), dtype=np.float32)

    def new_mtp_state(self, n_ctx: int) -> DecoderState:
        self._need_mtp()
        return DecoderState.new(graph.mtp_state_args(self.args), n_ctx)

    def _need_mtp(self):
        if self.mtp_block is None:
            raise MTPUnavailableError(f"{self.gm.path!r} has no multi-token-prediction block")
        return self.mtp_block

    def mtp(self, h, tokens, state: DecoderState, head: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        """The MTP block over T rows (models/graph.MTP): row r reads the trunk's final-norm output h[r] and the
        embedding of tokens[r] (the token after h's), attends over the block's own K/V in `state` (new_mtp_state;
        advanced by T); (logits (T, n_vocab) of the token after tokens[r], its hidden output (T, n_embd))."""
        blk, a = self._need_mtp(), self.args
        ids = check_tokens(tokens, a.n_vocab)
        T = len(ids)
        state.check_room(T)
        L = self.mtp_layer
        e = self.w.rows(self.embed, ids)
        h = np.asarray(h, np.float32).reshape(T, a.n_embd)
        x = np.concatenate([self.norm(e, L[blk.enorm], a.rms_eps), self.norm(h, L[blk.hnorm], a.rms_eps)], axis=1)
        x = L.mm(blk.eh_proj, x)
        ops = RefOps(self, L, 0, state)
        for br in blk.branches:
            x = x + br.fn(ops, a, self.norm(x, L[br.norm], a.rms_eps))
        y = self.norm(x, self.w(blk.norm), a.rms_eps).astype(np.float32)
        state.tokens[state.pos : state.pos + T] = ids
        state.pos += T
        return (self.w.mm(blk.out, y).astype(np.float32) if head else None), y

    def _walk(self, tokens, state: DecoderState, all_logits: bool) -> np.ndarray:
        ids = check_tokens(tokens, self.args.n_vocab)
        T = len(ids)
        state.check_room(T)
        a = self.args
        h = self.w.rows(self.embed, ids)
        for r0, r1, rows in mrope.image_rows(state.images, state.pos, T):
            h[r0:r1] = rows
        for i, block in enumerate(self.blocks):
            ops = self.graph_ops(i, state)
            for br in block:
                h = h + br.fn(ops, a, self.norm(h, self.layers[i][br.norm], a.rms_eps))
        state.tokens[state.pos : state.pos + T] = ids
        state.pos += T
        if not all_logits:
            h = h[-1:]
        return self.norm(h, self.w(self.head[0]), a.rms_eps)


    def graph_ops(self, i: int, state: DecoderState, T: int | None = None) -> RefOps:
        """The op vocabulary over block i (what forward walks; tests call single ops through it)."""
        return RefOps(self, self.layers[i], i, state)


class RefOps:
    """The op vocabulary (models/graph.py) in plain numpy over one block of a ReferenceModel: the maths every
    backend's ops are tested against."""

    def __init__(self, model: ReferenceModel, L: Layer, i: int, st: DecoderState):
        self.m, self.a, self.L, self.i, self.st = model, model.args, L, i, st

    from_host = to_host = staticmethod(np.asarray)  # op tests (tests/backend_ops.py): arrays are numpy already

    def linears(self, x: np.ndarray, *names: str) -> list[np.ndarray]:
        return [self.L.mm(n, x) for n in names]

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return self.L.mm(name, x)

    def split_gate(self, qg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a, T = self.a, qg.shape[0]
        qg = qg.reshape(T, a.n_head, 2, a.head_dim)
        return qg[:, :, 0], qg[:, :, 1].reshape(T, a.n_head * a.head_dim)

    def head_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return op.rms_norm(x.reshape(x.shape[0], -1, self.a.head_dim), self.L[name], self.a.rms_eps)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        a, st, i = self.a, self.st, self.i
        T, p0, hd = q.shape[0], st.pos, a.head_dim
        q, k, v = (t.reshape(T, -1, hd) for t in (q, k, v))
        ff = self.m.freq_factors
        shift, pos4 = mrope.positions(st.images, p0, T)
        pos = np.arange(p0, p0 + T) + shift if pos4 is None else pos4
        streams = mrope.imrope_streams(getattr(a, "rope_sections", ()), a.n_rot // 2)
        q = op.rope(q, pos, a.n_rot, a.rope_theta, a.rope_neox, ff, streams)
        k = op.rope(k, pos, a.n_rot, a.rope_theta, a.rope_neox, ff, streams)
        kt, vt = cache_types(a)
        rk, rv = kv_rotation(a)  # quantized rows rotated before they are kept, the output rotated back
        q, k, v = op.hadamard(q, rk), op.hadamard(k, rk), op.hadamard(v, rv)
        st.k[i][p0 : p0 + T] = op.kv_encode(k, kt)
        st.v[i][p0 : p0 + T] = op.kv_encode(v, vt)
        k_all, v_all = op.kv_decode(st.k[i][: p0 + T], kt, hd), op.kv_decode(st.v[i][: p0 + T], vt, hd)
        o = op.causal_attention(op.kv_query(q, kt), k_all, v_all, p0)
        return op.hadamard(o, rv).reshape(T, a.n_head * hd)

    def sigmoid_gate(self, o: np.ndarray, gate: np.ndarray) -> np.ndarray:
        return o * op.sigmoid(gate)

    def swiglu(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        return op.silu(g) * u

    def gdn(self, u, z, beta, alpha, *, conv: str, a: str, dt_bias: str, norm: str) -> np.ndarray:
        A, L, st, i, T = self.a, self.L, self.st, self.i, u.shape[0]
        Hk, Hv, dk, dv = A.ssm_n_k_heads, A.ssm_n_v_heads, A.ssm_d_k, A.ssm_d_v
        z = z.reshape(T, Hv, dv)
        c, st.conv[i][...] = op.causal_conv(u, st.conv[i], L[conv])
        c = op.silu(c)
        q = c[:, : Hk * dk].reshape(T, Hk, dk)
        k = c[:, Hk * dk : 2 * Hk * dk].reshape(T, Hk, dk)
        v = c[:, 2 * Hk * dk :].reshape(T, Hv, dv)
        q = op.l2_norm(q, A.rms_eps) / np.float32(np.sqrt(dk))
        k = op.l2_norm(k, A.rms_eps)
        kmap = np.arange(Hv) % Hk if A.gdn_head_map == "mod" else np.arange(Hv) // (Hv // Hk)
        g = L[a][None, :] * op.softplus(alpha + L[dt_bias][None, :])
        o = op.delta_rule(q[:, kmap], k[:, kmap], v, g, op.sigmoid(beta), st.ssm[i])
        y = op.rms_norm(o, L[norm], A.rms_eps) * op.silu(z)
        return y.reshape(T, Hv * dv)

    def _swiglu(self, names: tuple[str, str, str], x: np.ndarray, expert: int | None = None) -> np.ndarray:
        L = self.L
        h = op.silu(L.mm(names[0], x, expert)) * L.mm(names[1], x, expert)
        return L.mm(names[2], h, expert)

    def moe(self, x, *, router: str, experts: tuple[str, str, str], shared: tuple[str, str, str] | None,
            shared_gate: str | None) -> np.ndarray:
        L = self.L
        idx, wts = op.moe_route(L.mm(router, x), self.a.n_expert_used)
        out = np.zeros_like(x)
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            y = self._swiglu(experts, x[rows], expert=int(e))
            out[rows] += wts[rows, slot][:, None] * y
        if shared is not None:
            s = self._swiglu(shared, x)
            gate = op.sigmoid(x @ L[shared_gate].reshape(-1))
            out += gate[:, None] * s
        return out

"""The op vocabulary (models/graph.py) on the CPU backend: CPUOps, one method per op, over a Workspace's buffers.

CPUModel walks an architecture's description with one CPUOps per pass; each op issues the backend's native calls
through CPUModel.call / mm / mm_many, so that while a decode step is recorded (replay.py) every call lands in the
recording in order, and the replayed step is the description's ops with no Python between them. Call-site keys name the
block and the op, so a decode workspace binds each call once.
"""

from __future__ import annotations

import functools

import numpy as np

from ...models import mrope
from ..state import check_tokens
from .simd import GGML_DECODE_ROWS

# the float shape of every product and attention: each row as llama.cpp's one-token step computes it, so no row
# depends on how many rows share the call (chunk-size, restore-point and batch invariance on every ISA unit)
SHAPE = GGML_DECODE_ROWS


@functools.lru_cache(maxsize=8)
def _streams(sections: tuple, n_pairs: int) -> np.ndarray:
    return mrope.imrope_streams(sections, n_pairs)


class Segments(tuple):
    """The sequences of one pass over several prompts' chunks (CPUModel.forward_many) or verify rows
    (CPUModel.forward_rows): (state, first row, end row) each, in row order. Products run over all rows; attention
    and GDN per sequence over its rows."""

    @classmethod
    def of(cls, chunks, n_vocab: int, what: str) -> tuple[list[np.ndarray], Segments]:
        """The checked ids of each (ids, state) chunk and their Segments, rows one chunk after another (one chunk
        per distinct state, each fitting its state)."""
        if len({id(st) for _, st in chunks}) != len(chunks):
            raise ValueError(f"{what} takes one chunk per distinct state")
        parts = [check_tokens(ids, n_vocab) for ids, _ in chunks]
        rows, a0 = [], 0
        for ids, (_, st) in zip(parts, chunks, strict=True):
            st.check_room(len(ids))
            rows.append((st, a0, a0 + len(ids)))
            a0 += len(ids)
        return parts, cls(rows)

    @property
    def rows(self) -> int:
        return self[-1][2] if self else 0


class CPUOps:
    """One pass of CPUModel over `ws` for `st` (a DecoderState, a list of them: one token of each, or Segments:
    several prompts' chunks). The walker
    points it at a block and branch with at(); `out` is the branch's output buffer, `spare` another (T, n_embd)
    buffer free inside the branch."""

    def __init__(self, model, ws, st):
        self.m, self.a, self.ws, self.st = model, model.args, ws, st
        self.i, self.j, self.L, self.out, self.spare = 0, 0, None, None, None

    def at(self, i: int, j: int, out: np.ndarray, spare: np.ndarray, layer=None) -> CPUOps:
        """Block i's branch j (its tensors `layer`, default the trunk's block i: the MTP block passes its own, with
        i its state's layer)."""
        self.i, self.j, self.out, self.spare = i, j, out, spare
        self.L = self.m.layers[i] if layer is None else layer
        return self

    @staticmethod
    def from_host(x: np.ndarray) -> np.ndarray:
        return np.array(x, np.float32)

    @staticmethod
    def to_host(y: np.ndarray) -> np.ndarray:
        return np.array(y)

    def _t(self, name: str):
        """Block tensor `name` (Mat or float32 vector), by its short name."""
        return self.L[name]

    def _call(self, key: tuple, method: str, *args, **kw) -> None:
        self.m.call(self.ws, key, method, *args, **kw)

    # products ---------------------------------------------------------------------------------------------
    def linears(self, x: np.ndarray, *names: str) -> list[np.ndarray]:
        """One quantization per activation format, one pooled call; outputs in the workspace's product buffers,
        each in the first free one wide enough."""
        mats = [self._t(n) for n in names]
        outs: list[np.ndarray] = []
        for m in mats:
            outs.append(next(b for b in self.ws.outs if b.shape[1] >= m.rows and not any(b is o for o in outs)))
        return self.m.mm_many(mats, x, outs, self.ws)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        m = self._t(name)
        if m.rows != self.a.n_embd:
            raise ValueError(f"CPU ops: a lone product returns to the residual width {self.a.n_embd}; {m.name} "
                             f"has {m.rows} rows (use linears)")
        return self.m.mm(m, x, self.out, self.ws)

    def swiglu(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        self._call(("swiglu", self.i, self.j), "swiglu", g, u, g)
        return g

    # attention --------------------------------------------------------------------------------------------
    def split_gate(self, qg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        T = qg.shape[0]
        q, gate = self.ws.q[:T], self.ws.gate[:T]
        self._call(("qgate", self.i), "split_qgate", qg, q, gate)
        return q, gate

    def head_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        x = x.reshape(x.shape[0], -1, self.a.head_dim)  # a view: normed in place
        self._call(("hnorm", self.i, name), "rms_norm", x, None, self._t(name), self.a.rms_eps, x)
        return x

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """The new k, v rows into the cache, q and those K rows roped there, attention: one call at the position
        (one token of each sequence: every (sequence, head) in one call)."""
        a, ws, st, i = self.a, self.ws, self.st, self.i
        T, hd = q.shape[0], a.head_dim
        if not (q.ndim == 3 and np.may_share_memory(q, ws.q)):  # queries as the projection left them: packed
            q, qg = ws.q[:T], q.reshape(T, -1)
            self._call(("qgate", i), "split_qgate", qg, q, None)
        k, v = k.reshape(T, -1, hd), v.reshape(T, -1, hd)
        o = ws.attn[:T]
        ff, kt, vt, rk, rv = self.m.freq_factors, *self.m.kv_types, *self.m.kv_rot
        if isinstance(st, Segments):  # (bound per sequence where the workspace binds: a verify step's, replayed)
            for j, (s, r0, r1) in enumerate(st):
                shift, table = self._rope_at(s, r1 - r0)
                self._call(("attn", i, j), "attn_step", q[r0:r1], k[r0:r1], v[r0:r1], s.k[i], s.v[i], s.pos,
                           o[r0:r1], ws.attn_scratch, a.n_rot, a.rope_theta, a.rope_neox, ff, SHAPE, kt, vt, rk, rv,
                           shift, table, st=s, arrays=(s.k[i], s.v[i]))
        elif isinstance(st, list):
            shifts = [mrope.shift_at(s.images, s.pos) for s in st]
            self._call(("attn", i), "attn_rows", q, k, v, [s.k[i] for s in st], [s.v[i] for s in st],
                       [s.pos for s in st], 0, o, ws.attn_scratch, a.n_rot, a.rope_theta, a.rope_neox, ff, kt, vt, rk,
                       rv, shifts if any(shifts) else None, fresh=True)
        else:
            shift, table = self._rope_at(st, T)
            if table is not None:  # rows of an image: a prompt chunk, never a recorded decode step
                self.m.simd.attn_step(q, k, v, st.k[i], st.v[i], st.pos, o, ws.attn_scratch, a.n_rot, a.rope_theta,
                                      a.rope_neox, ff, SHAPE, kt, vt, rk, rv, 0, table)
            else:  # the shift is bound into a decode step's call: one binding per shift
                self._call(("attn", i, shift), "attn_step", q, k, v, st.k[i], st.v[i], st.pos, o, ws.attn_scratch,
                           a.n_rot, a.rope_theta, a.rope_neox, ff, SHAPE, kt, vt, rk, rv, shift, None, st=st,
                           arrays=(st.k[i], st.v[i]))
        return o

    def _rope_at(self, st, T: int):
        """(shift, native mrope table or None) of st's rows st.pos..st.pos+T (models/mrope.positions)."""
        shift, pos4 = mrope.positions(st.images, st.pos, T)
        if pos4 is None:
            return shift, None
        return 0, mrope.mrope_table(_streams(tuple(getattr(self.a, "rope_sections", ())), self.a.n_rot // 2), pos4)

    def sigmoid_gate(self, o: np.ndarray, gate: np.ndarray) -> np.ndarray:
        self._call(("gate", self.i), "sigmoid_gate", o, gate)
        return o

    # Gated DeltaNet ---------------------------------------------------------------------------------------
    def gdn(self, u, z, beta, alpha, *, conv: str, a: str, dt_bias: str, norm: str) -> np.ndarray:
        """In C on the library's thread pool (heads in parallel), bit-identical to the numba oracle gdn_layer; numba's
        own parallel version fought the C pool for the cores."""
        A, ws, st, i = self.a, self.ws, self.st, self.i
        y = ws.gdn_y[: u.shape[0]]
        w = (self._t(conv), self._t(a), self._t(dt_bias), self._t(norm))
        tail = (A.ssm_n_k_heads, A.gdn_head_map == "mod", A.rms_eps, y, ws.gdn_scratch)
        if isinstance(st, Segments):
            for j, (s, r0, r1) in enumerate(st):
                args = (u[r0:r1], z[r0:r1], beta[r0:r1], alpha[r0:r1], *w, s.conv[i], s.ssm[i], *tail[:3])
                if ws.gdn_keep is not None:  # a verify step over a workspace of its own: kept as recorded steps
                    self._keep_inputs((j, i), args[:4], (*w, *tail[:3]))
                    self._verify_gdn((i, j), j, args, y[r0:r1])
                    continue
                self._call(("gdn", i, j), "gdn_layer", *args, y[r0:r1], ws.gdn_scratch,
                           arrays=(s.conv[i], s.ssm[i]))
        elif isinstance(st, list):
            self._call(("gdn", i), "gdn_rows", u, z, beta, alpha, *w, [s.conv[i] for s in st],
                       [s.ssm[i] for s in st], *tail, arrays=tuple(x for s in st for x in (s.conv[i], s.ssm[i])))
        else:
            if ws.gdn_keep is not None:  # a verify step: its inputs kept, to roll the state back (cpu/verify.py)
                self._keep_inputs(i, (u, z, beta, alpha), (*w, *tail[:3]))
                self._verify_gdn((i,), 0, (u, z, beta, alpha, *w, st.conv[i], st.ssm[i], *tail[:3]), y)
                return y
            self._call(("gdn", i), "gdn_layer", u, z, beta, alpha, *w, st.conv[i], st.ssm[i], *tail,
                       arrays=(st.conv[i], st.ssm[i]))
        return y

    def _verify_gdn(self, at: tuple, j: int, args: tuple, y) -> None:
        """A verify step's GDN call (args: gdn_layer's up to eps, the state's conv and S among them) out of place: the
        state read and left as it was, the state after the rows written to the model's buffers for sequence j
        (CPUModel.verify_out), which the step's RowsUndo copies in or not (cpu/verify.py)."""
        conv, S = args[8], args[9]
        co, so = self.m.verify_out(j, self.i, conv, S)
        self._call(("gdn", *at), "gdn_layer", *args[:8], co, so, *args[10:], y, self.ws.gdn_scratch, conv, S,
                   arrays=(conv, S, co, so))

    def _keep_inputs(self, i, xs: tuple, rest: tuple) -> None:
        """Copy a GDN call's row inputs into buffers of the workspace's own, as a native step of the recorded pass
        (so a replay copies them too, without a return to Python between its calls): ws.gdn_keep[i] = (copies,
        weights and scalars); i the layer, or (sequence, layer) in a verify step of several sequences."""
        ws = self.ws
        if i not in ws.gdn_keep:
            ws.gdn_keep[i] = (tuple(np.empty_like(x) for x in xs), rest)
        self._call(("keep", i), "copy_many", list(ws.gdn_keep[i][0]), list(xs))

    # MoE --------------------------------------------------------------------------------------------------
    def moe(self, x, *, router: str, experts: tuple[str, str, str], shared: tuple[str, str, str] | None,
            shared_gate: str | None) -> np.ndarray:
        return self.m._moe(self, x, self._t(router), tuple(self._t(n) for n in experts),
                           None if shared is None else tuple(self._t(n) for n in shared),
                           None if shared_gate is None else self._t(shared_gate))

    def moe_impl(self, x, R, E3, S3, sgate) -> np.ndarray:
        """CPUModel._moe's body (the model's method is the hook benchmarks wrap): decode (one token) runs its k
        experts, and a shared expert of their kind as row k, in two calls; several rows group the routed pairs by
        expert (moe_rows). The experts come from the file's stacked tensors, or under a RAM budget from the layer's
        expert cache (cpu/expert_store.py: its slot buffers and the experts' slots instead of their ids), whose
        reads start once the routing is known and are waited for after the shared expert's product."""
        m, a, ws, i = self.m, self.a, self.ws, self.i
        T, k = x.shape[0], a.n_expert_used
        router = m.mm(R, x, ws.router, ws)
        idx, w = ws.route_idx[:T], ws.route_w[:T]
        self._call(("route", i), "moe_route", router, k, idx, w)
        cache = None if m.experts is None else m.experts.caches.get(id(E3[0]))  # None: resident experts
        if cache is not None:
            m._op(ws, cache.begin, idx)
            E3 = cache.mats
        ys = ws.ed[: T * k]
        G, U, Dn = E3
        shared = None  # the shared expert's output when the routed experts' calls produced it
        rides = S3 is not None and cache is None and (self._rides(E3, S3) if T > 1 else self._fuses(E3, S3))
        if S3 is not None and not rides:
            shared = self._shared(x, S3)
        if T == 1:
            # the shared expert rides in the routed experts' calls where its products take their activation
            # formats and its width is theirs
            fused = shared is None and S3 is not None
            n = k + 1 if fused else k
            xq = m.quantize(G, x, ws)
            eg, eu = ws.eg[:n], ws.eu[:n]
            sh_gu = sh_d = None
            if fused:
                Sg, Su, Sd = S3
                sh_gu = (Sg.raw, Sg.qtype, Su.raw, Su.qtype, Sg.rows, eg[k], eu[k])
            ids = idx[0]
            if cache is not None:
                m._op(ws, cache.one, idx[0])
                ids = cache.slot_ids
            self._call(("gate_up", id(G)), "moe_gate_up", G.raw, G.qtype, U.raw, U.qtype, G.rows, G.cols, xq[0],
                       ids, eg[:k], eu[:k], SHAPE, sh_gu)
            self._call(("swiglu", id(G)), "swiglu", eg, eu, eg)
            hq = m.quantize(Dn, eg, ws)
            if fused:
                shared = self.spare[:1]
                sh_d = (Sd.raw, Sd.qtype, Sd.cols, hq[k], shared[0])
            self._call(("down", id(Dn)), "moe_down", Dn.raw, Dn.qtype, Dn.rows, Dn.cols, hq[:k], ids, ys,
                       SHAPE, sh_d)
        else:  # several sequences' decode tokens, or a prompt's tokens: the routed pairs grouped by expert
            if rides:
                shared = self.spare[:T]
            self._moe_rows(E3, x, idx, ys, cache, S3 if rides else None, shared)
        out = self.out[:T]
        if S3 is None:
            self._call(("combine", i), "moe_combine", ys, w, out)
            return out
        self._call(("combine", i), "moe_combine", ys, w, out, shared, x, sgate)
        return out

    def _fuses(self, E3, S3) -> bool:
        """whether one token's shared expert can ride in the routed experts' calls"""
        G, U, Dn = E3
        act = self.m.simd.act_kind
        return S3[0].rows == G.rows and len({act(t.qtype) for t in (G, U, S3[0], S3[1])}) == 1 and act(
            S3[2].qtype) == act(Dn.qtype)

    @staticmethod
    def _rides(E3, S3) -> bool:
        """whether several rows' shared expert can ride in moe_rows' pool runs: its matrices of the routed
        experts' types and shapes (its compute-bound rows then run beside the routed experts' memory-bound ones)"""
        return all(s.qtype == e.qtype and s.rows == e.rows and s.cols == e.cols for s, e in zip(S3, E3, strict=True))

    def _shared(self, x, S3) -> np.ndarray:
        """The shared expert's output in the spare buffer (its own products)."""
        m, ws = self.m, self.ws
        Sg, Su, Sd = S3
        g, u = m.mm_many([Sg, Su], x, [ws.out_a, ws.out_b], ws)
        self._call(("swiglu", id(Sg)), "swiglu", g, u, g)
        return m.mm(Sd, g, self.spare, ws)

    def _moe_rows(self, E3, x: np.ndarray, idx: np.ndarray, ys: np.ndarray, cache=None, S3=None,
                  s_out=None) -> None:
        """ys[t * k + j] = expert idx[t, j]'s output for token t, in one native call (moe_rows): the T x k pairs
        grouped by expert, so each selected expert is read once for all the tokens routed to it, each pair in its
        one-token float shape (SHAPE: the same bits whichever tokens share the call); with S3, the shared expert's
        rows into s_out in the same call, as its own products give them. From an expert cache: one call per run of
        rows whose experts it holds at once (ExpertCache.rows)."""
        m, ws = self.m, self.ws
        G, U, Dn = E3
        n = idx.size + (x.shape[0] if S3 is not None else 0)  # work rows: the pairs', then the shared expert's
        xq = m.quantize(G, x, ws)
        hq = ws.xq[m.simd.act_kind(Dn.qtype)][:n, : m.simd.act_row_bytes(Dn.qtype, Dn.cols)]
        if cache is not None:
            m._op(ws, cache.rows, m.simd, G.rows, G.cols, xq, idx, ws.eg[:n], ws.eu[:n], hq, ys, ws.moe_scratch,
                  SHAPE)
            return
        shared = None if S3 is None else (*((t.raw, t.qtype) for t in S3), s_out)
        self._call(("moe_rows", self.i), "moe_rows", (G.raw, G.qtype), (U.raw, U.qtype), (Dn.raw, Dn.qtype), G.rows,
                   G.cols, xq, idx, ws.eg[:n], ws.eu[:n], hq, ys, ws.moe_scratch, SHAPE, shared)


"""The op vocabulary (models/graph.py) on the card: GPUOps, one method per op, over GPUModel's Buffers.

GPUModel (and gpu/multi.py) walk an architecture's description layer-major: for each layer, for each chunk of
rows, the branches' ops are queued on the model's stream with the layer's streamed weights. Where the walker runs
several prompts' rows together, the stateful ops (attention, gdn) take their per-prompt segments from `at()`.
"""

from __future__ import annotations

import numpy as np

from ...format.quant_types import F32
from ...models.state_kinds import kind_of
from . import k_attention as ka
from . import k_elementwise as ke
from . import k_gdn as kg
from . import k_gemm as kgm
from . import k_moe as km

SIDE_RATIO = 32  # products this many times narrower than their group's widest go on the side stream


class Half:
    """Queries or gates still interleaved per head as [query(hd), gate(hd)] (split_gate): rows (T*H, 2*hd) of
    the projection and the column offset of this half. The kernels that read them take the pitch (the q norm
    writes the queries out dense, the gate multiply reads the gates in place), so no copy is made."""

    def __init__(self, rows, off: int, n: int):
        self.rows, self.off, self.n = rows, off, n
        self.shape = (n, rows.shape[0] // n, rows.shape[1] // 2)

    def dense(self, out, stream=None):
        """This half copied out dense into out (T, H, hd)."""
        import pycuda.driver as drv

        hd = self.shape[2]
        cp = drv.Memcpy2D()
        cp.set_src_device(int(self.rows.gpudata) + 4 * self.off)
        cp.src_pitch = 4 * self.rows.shape[1]
        cp.set_dst_device(int(out.gpudata))
        cp.dst_pitch = 4 * hd
        cp.width_in_bytes, cp.height = 4 * hd, self.rows.shape[0]
        cp(stream) if stream is not None else cp(aligned=True)
        return out


class GPUOps:
    """Ops of one GPUModel pass; the walker points it at a layer (`at`) and a branch (`branch`)."""

    def __init__(self, model):
        self.m, self.a, self.b, self.s = model, model.args, model.buf, model.stream
        self.L, self.i, self.out, self.spare = None, 0, None, None
        self.pos, self.attn_segs, self.gdn_segs, self.snap_host = None, [], [], []
        self.sections = None
        self.h = None  # the hidden rows the branch's output is added to (the walker's), for ops that add it later
        self.rows = None  # (first, end) of those rows in the pass

    def settle(self, r0: int | None = None, r1: int | None = None) -> None:
        """Queue the deferred adds into hidden rows [r0, r1) (None: every row): the walker calls it before a branch
        reads a chunk's rows and after the last layer. None here."""

    def at(self, L, pos, attn_segs: list, gdn_segs: list, snap_host=(), sections=None) -> GPUOps:
        """Layer L's tensors by short name (models/graph.BlockTensors: its streamed matrices and its vectors); pos:
        the rows' positions on the card; attn_segs: (row0, row1, pos0, cache base) per sequence among the rows;
        gdn_segs: (row0, row1, offset in its prompt, snapshot positions, before, after) per sequence (before/after
        load and save its state on the card, or None). sections: the model's rope sections when pos holds (rows, 4)
        multimodal positions (a pass with an image's rows: models/mrope.py), else None."""
        self.L, self.i, self.pos, self.attn_segs, self.gdn_segs = L, L.i, pos, attn_segs, gdn_segs
        self.sections = sections
        self.snap_host = snap_host
        return self

    def branch(self, j: int) -> GPUOps:
        """Branch outputs alternate between two buffers: the one not being written is free inside the branch."""
        b = self.b
        self.out, self.spare = (b.mix, b.ffn) if j % 2 == 0 else (b.ffn, b.mix)
        return self

    @staticmethod
    def from_host(x: np.ndarray):
        from pycuda import gpuarray

        return gpuarray.to_gpu(np.ascontiguousarray(x, np.float32))

    def to_host(self, y) -> np.ndarray:
        if isinstance(y, Half):
            from pycuda import gpuarray

            y = y.dense(gpuarray.empty(y.shape, np.float32))
        return y.get()

    def _count(self, pos0: int, T: int) -> None:
        """The mixer's FLOPs over T rows from position pos0, as its kind declares them, in the pass's work count."""
        kind = self.a.layer_types[self.i]
        self.m.work.add(kind, self.i, kind_of(kind).flops(self.a, pos0, T))

    # products ---------------------------------------------------------------------------------------------
    def linears(self, x, *names: str) -> list:
        """The products of x, each into its Buffers output; the narrow ones (GDN's beta and alpha) on the side
        stream beside the wide ones, which leave most of the card idle."""
        m, L, n = self.m, self.L, x.shape[0]
        outs = [self.b.out(nm, n) for nm in names]
        widest = max(o.shape[1] for o in outs)
        side = [o.shape[1] * SIDE_RATIO < widest for o in outs]
        res: list = [None] * len(names)
        if any(side):
            sd = m._fork()
            for j, nm in enumerate(names):
                if side[j]:
                    res[j] = m._gemm(self.i, x, L[nm], out=outs[j], stream=sd)
        for j, nm in enumerate(names):
            if not side[j]:
                res[j] = m._gemm(self.i, x, L[nm], out=outs[j], stream=self.s)
        if any(side):
            m._join()
        return res

    def linear(self, x, name: str):
        n = x.shape[0]
        return self.m._gemm(self.i, x.reshape(n, -1), self.L[name], out=self.out[:n], stream=self.s)

    def swiglu(self, g, u):
        return ke.swiglu(g, u, out=g, stream=self.s)

    # attention --------------------------------------------------------------------------------------------
    def split_gate(self, qg) -> tuple[Half, Half]:
        n, hd = qg.shape[0], self.a.head_dim
        rows = qg.reshape(n * (qg.shape[1] // (2 * hd)), 2 * hd)
        return Half(rows, 0, n), Half(rows, hd, n)

    def head_norm(self, x, name: str):
        a, hd = self.a, self.a.head_dim
        if isinstance(x, Half):  # the queries normed out of their interleaved rows, dropping the gate halves
            if x.off:
                raise ValueError("head_norm on GPU: only the query half of [query, gate] heads is read in place")
            q = self.b.q[: x.n]
            ke.rms_norm(x.rows, self.L[name], a.rms_eps, out=q.reshape(x.rows.shape[0], hd), stream=self.s)
            return q
        rows = x.reshape(x.shape[0] * (int(np.prod(x.shape[1:])) // hd), hd)
        ke.rms_norm(rows, self.L[name], a.rms_eps, out=rows, stream=self.s)
        return x

    def attention(self, q, k, v):
        a, b, s, i = self.a, self.b, self.s, self.i
        n, hd = q.shape[0], a.head_dim
        if isinstance(q, Half):
            q = q.dense(b.q[:n], self.s)
        q = q.reshape(n, a.n_head, hd)
        ke.rope_neox(q, self.pos, a.n_rot, a.rope_theta, stream=s, neox=a.rope_neox, sections=self.sections)
        k3, v3 = k.reshape(n, a.n_head_kv, hd), v.reshape(n, a.n_head_kv, hd)
        ke.rope_neox(k3, self.pos, a.n_rot, a.rope_theta, stream=s, neox=a.rope_neox, sections=self.sections)
        kt, vt, rk, rv = *self.m.kv_types, *self.m.kv_rot
        typed = (kt, vt) != (F32, F32)
        if typed:  # as the CPU: rotated (quantized types), the queries rounded as llama.cpp's flash attention does
            ka.fwht(q, rk, stream=s)
            ka.fwht(k3, rk, stream=s)
            ka.fwht(v3, rv, stream=s)
            ka.q_round(q, kt, stream=s)
        o = b.o[:n]
        for r0, r1, p0, base in self.attn_segs:
            kc, vc = b.kv("k", i), b.kv("v", i)
            kc, vc = (kc, vc) if base == 0 else (kc[base:], vc[base:])
            if typed:
                ka.kv_store(k3[r0:r1], v3[r0:r1], kc, vc, p0, kt, vt, stream=s)
                ka.attention_prefill_kv(q[r0:r1], kc, vc, o[r0:r1], p0, kt, vt, stream=s, part=b.attn_part)
            else:
                ka.kv_append(k3[r0:r1], v3[r0:r1], kc, vc, p0, stream=s)
                ka.attention_prefill(q[r0:r1], kc, vc, o[r0:r1], p0, stream=s, part=b.attn_part)
            self._count(p0, r1 - r0)
        ka.fwht(o, rv, stream=s)
        return o.reshape(n, a.n_head * hd)

    def sigmoid_gate(self, o, gate):
        if isinstance(gate, Half):  # the gates read in place from the interleaved projection
            hd = self.a.head_dim
            ke.sigmoid_mul(o.reshape(gate.rows.shape[0], hd), gate.rows, g_off=gate.off, stream=self.s)
        else:
            ke.sigmoid_mul(o, gate, stream=self.s)
        return o

    # Gated DeltaNet ---------------------------------------------------------------------------------------
    def gdn(self, u, z, beta, alpha, *, conv: str, a: str, dt_bias: str, norm: str):
        A, b, s, i, L = self.a, self.b, self.s, self.i, self.L
        n = u.shape[0]
        y = b.y[:n]
        for r0, r1, q0, sn, before, after in self.gdn_segs:
            if before is not None:
                before()
            rows = r1 - r0
            self._count(0, rows)  # the same work at every position
            mine = [j for j, p in enumerate(sn) if q0 < p <= q0 + rows]  # positions relative to q0 in snap_pos
            sp = sc = sS = None
            if mine:
                j0, j1 = mine[0], mine[-1] + 1
                sp, sc, sS = b.snap_pos[j0:j1], b.snap["conv"][j0:j1], b.snap["ssm"][j0:j1]
            kg.gdn_prefill(u[r0:r1], z[r0:r1], alpha[r0:r1], beta[r0:r1], L[conv], L[a], L[dt_bias],
                           L[norm], b.state["conv", i], b.state["ssm", i], y[r0:r1], A.ssm_n_k_heads, A.ssm_d_k,
                           A.rms_eps, A.gdn_head_map, sp, sc, sS, c=b.c[r0:r1], stream=s)
            for r, j in enumerate(mine):  # synchronous, but only when the prefix cache asks for snapshots
                sc[r].get(ary=self.snap_host[j].conv[i], stream=s)
                sS[r].get(ary=self.snap_host[j].ssm[i], stream=s)
            if after is not None:
                after()
        return y

    # MoE --------------------------------------------------------------------------------------------------
    def moe(self, x, *, router: str, experts: tuple[str, str, str], shared: tuple[str, str, str] | None,
            shared_gate: str | None):
        m, a, b, s, L, n = self.m, self.a, self.b, self.s, self.L, x.shape[0]
        k, E = a.n_expert_used, a.n_expert
        sh = gl = None
        if shared is not None:  # the gated shared expert, beside the routed experts
            side = m._fork()
            sg = m._gemm(L.i, x, L[shared[0]], out=b.sg[:n], stream=side)
            su = m._gemm(L.i, x, L[shared[1]], out=b.su[:n], stream=side)
            ke.swiglu(sg, su, out=sg, stream=side)
            sh = m._gemm(L.i, sg, L[shared[2]], out=self.spare[:n], stream=side)
            gl = ke.dot_rows(x, L[shared_gate], out=b.sgate[:n], stream=side).reshape(n)
        logits = m._gemm(L.i, x, L[router], out=b.router[:n], stream=s)
        ids, wts = b.ids[:n], b.wts[:n]
        km.route(logits, k, ids, wts, stream=s)
        P = n * k
        km.group(ids, wts, E, b.counts, b.offs, b.perm_tok[:P], b.perm_w[:P], b.row_of_pair[:n],
                 scratch=b.scratch[: km.group_scratch_shape(P, E)[0]], stream=s)
        # per-expert token counts for expert pinning: copied to pinned memory now, summed after the pass
        m.drv.memcpy_dtoh_async(m.counts_host[L.i, m._chunk_no], b.counts.gpudata, s)
        ed = self._experts(x, [L[nm] for nm in experts], P)
        return self._combine(ed, wts, self.out[:n], sh, gl)

    def _experts(self, x, W: list, P: int, offs=None):
        """The routed experts' grouped products over the P grouped rows (offs: the experts' row offsets, default
        every expert's): the rows of each pair's expert output, in b.ed."""
        b, s = self.b, self.s
        offs = b.offs if offs is None else offs
        eg = kgm.gemm_grouped(x, W[0], offs, idx=b.perm_tok[:P], out=b.eg[:P], stream=s)
        eu = kgm.gemm_grouped(x, W[1], offs, idx=b.perm_tok[:P], out=b.eu[:P], stream=s)
        ke.swiglu(eg, eu, out=eg, stream=s)
        return kgm.gemm_grouped(eg, W[2], offs, out=b.ed[:P], stream=s)

    def _combine(self, ed, wts, out, sh, gl):
        """out: each row's routed experts weighted in slot order, plus its gated shared expert (sh, gl; None:
        none)."""
        if sh is not None:
            self.m._join()
        km.combine(ed, self.b.row_of_pair[: out.shape[0]], wts, out, shared_out=sh, shared_gate_logit=gl,
                   stream=self.s)
        return out

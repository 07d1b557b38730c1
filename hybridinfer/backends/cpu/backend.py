"""The CPU backend: quantized matrix products, attention, RoPE, SwiGLU, the GDN layer and the small ops between
them (norms, routing, gates) in C (simd.py), each the twin of a numba op (ops*.py) that stays its plain-order
reference; sampling in numba. The products, attention, RoPE and SwiGLU follow llama.cpp's float operations for the
ISA level they run at. Every product and attention takes the float order of llama.cpp's one-token step
(GGML_DECODE_ROWS) whatever the number of tokens in the call, so greedy decoding agrees token for token with llama.cpp
fed one token at a time; llama.cpp's multi-token shapes (repacked and tiled K-quants, tinyBLAS) change with the token
count, and here a token's logits never depend on how a prompt is cut into chunks, where a restored snapshot resumes,
or which sequences share a decode step.

Weights stay in their GGUF bytes (memory-mapped); activations are quantized once per input and weight
kind, as llama.cpp does. One `forward(tokens, state)` serves decode (T = 1) and chunked prefill
(T > 1, a GEMM over the chunk; MoE tokens grouped by expert). Work buffers live in a `Workspace` made once
per chunk-size class and context size and reused, so the decode loop allocates no arrays. A decode step is
recorded at a sequence's first step and then runs as one native call (replay.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from ...errors import BackendNotAvailableError, UnsupportedTensorTypeError
from ...format.gguf_model import GGUFModel
from ...format.quant import dequantize_rows, type_name
from ...format.quant_types import cache_type
from ...models import graph, mrope
from ...models.graph import BlockTensors, block_names
from ...models.state_kinds import cache_path, cache_types, kv_rotation, sequence_layer_types
from .. import Backend
from ..state import DecoderState, check_tokens
from .graph_ops import SHAPE, CPUOps, Segments
from .mtp import MTPParts
from .replay import BatchReplay, DecodeReplay, at_pos
from .simd import KERNEL_TYPES, SimdLib
from .weights import choose_weights_mode, copy_mats, mem_available
from .workspace import Workspace

NO_FREQS = np.zeros(0, np.float32)  # rope without frequency factors

MAX_EXPERTS_USED = 64  # the native MoE calls' limit (hi_simd.c: HI_MAX_K)
COPY_POOLED = 4 << 20  # bytes from which copied() splits a copy over the pool (below, the wake-up costs more)


@dataclass(frozen=True)
class Mat:
    """A weight matrix (rows, cols) in its stored bytes (a uint8 view of the file). For a stacked expert
    tensor, `raw` holds all `n_expert` matrices back to back and `expert(e)` views one of them."""

    name: str
    raw: np.ndarray
    qtype: int
    rows: int
    cols: int
    n_expert: int = 1

    def expert(self, e: int) -> Mat:
        per = self.raw.size // self.n_expert
        return Mat(f"{self.name}[{e}]", self.raw[e * per : (e + 1) * per], self.qtype, self.rows, self.cols)


def _mat(gm: GGUFModel, name: str) -> Mat:
    t = gm.tensor(name)
    if t.qtype not in KERNEL_TYPES:
        raise UnsupportedTensorTypeError(
            f"{gm.path!r}: tensor {name!r} has type {t.type_name}, which the CPU backend has no kernel for "
            f"(kernels: {', '.join(type_name(q) for q in sorted(KERNEL_TYPES))}); use backend='reference'")
    ne = [int(x) for x in t.ne]
    return Mat(name, t.raw(), t.qtype, ne[1], ne[0], ne[2] if len(ne) == 3 else 1)


class Layer(BlockTensors):
    """Block i's tensors by short name (models/graph.BlockTensors): `L["attn_q"]` is `blk.i.attn_q.weight` (a Mat),
    `L["ssm_dt.bias"]` is `blk.i.ssm_dt.bias`; vectors (norms, ssm_a, the shared-expert gate) and ssm_conv1d are
    float32. `tensors` holds them by GGUF name."""

    def __init__(self, gm: GGUFModel, i: int):
        names = block_names(gm.tensors, i)
        self.tensors = {n: _tensor(gm, short, n) for short, n in names.items()}
        super().__init__(i, names, self.tensors.__getitem__)

    def mats(self) -> list[Mat]:
        return [v for v in self.tensors.values() if isinstance(v, Mat)]


def _tensor(gm: GGUFModel, short: str, name: str):
    t = gm.tensor(name)
    if short == "ssm_conv1d":
        return np.ascontiguousarray(gm.dequant(name), dtype=np.float32)  # (C, K)
    if len(t.ne) == 1 or (len(t.ne) == 2 and 1 in t.ne):
        return np.ascontiguousarray(gm.dequant(name).reshape(-1), dtype=np.float32)
    return _mat(gm, name)


class CPUModel(MTPParts, Backend):
    """backend="cpu": the whole engine on the host CPU."""

    def __init__(self, gm: GGUFModel, args, simd: SimdLib, weights: str = "mmap", numa=None, progress: bool = False,
                 experts=None):
        """weights: where the matrices are read from (cpu/weights.py): "mmap" (the file's mapping), "copy"
        (one huge-page copy made now) or "auto" (copy if they take at most half the available memory; the mapping
        when per-node copies are made, which are where decode reads). numa: None, or a hybridinfer.backends.numa.Plan
        whose mode "replicate" has one copy of the matrices made on each of its nodes and the pool's threads placed on
        them (cpu/replicas.py; `self.replicas` says what was done); other modes are process-wide, numa.apply's.
        progress: a bar on stderr while the copy is made. experts: None, or a RAM budget's expert_setup.ExpertOptions
        (`ram_plan` says what stays resident, `experts` is the store of the experts read from the file)."""
        self.gm, self.args, self.simd = gm, args, simd
        a = args
        if getattr(a, "is_moe", False) and a.n_expert_used > MAX_EXPERTS_USED:
            raise BackendNotAvailableError(
                f"{gm.path!r} routes each token to expert_used_count={a.n_expert_used} experts; the CPU backend's "
                f"kernels take at most {MAX_EXPERTS_USED} (use backend='reference')")
        self.blocks = graph.branches(a)  # the architecture's forward, walked by _forward
        out_norm, head = graph.head(a)
        self.tok_embd = gm.tensor(graph.arch_of(a).EMBED)
        self.out = _mat(gm, head)
        self.out_norm = np.ascontiguousarray(gm.dequant(out_norm), dtype=np.float32)
        self.layers = [Layer(gm, i) for i in range(a.n_layer)]
        self.mtp_block = graph.mtp(a)  # the MTP block (cpu/mtp.py), read from the file's mapping
        self.mtp_layer = None if self.mtp_block is None else Layer(gm, self.mtp_block.block)
        self.freq_factors = (np.ascontiguousarray(gm.dequant("rope_freqs.weight"), dtype=np.float32)
                             if getattr(a, "has_rope_freqs", False) else NO_FREQS)
        self.kv_types = tuple(cache_type(t).id for t in cache_types(a))  # ggml ids of the K and V cache types
        self.kv_rot = kv_rotation(a)  # their rotation sizes (0: none)
        held = {"out": self.out}
        blocks = self.layers + ([self.mtp_layer] if self.mtp_layer is not None else [])
        owners = [(held, "out")] + [(L.tensors, k) for L in blocks for k, v in L.tensors.items() if isinstance(v, Mat)]
        replicate = numa is not None and numa.mode == "replicate"
        self.ram_plan, self.experts = None, None
        if experts is not None:  # a RAM budget: the resident part copied, the other experts read when selected
            from .expert_setup import attach, unmap

            self.ram_plan, self.experts, owners = attach(self, gm, blocks, experts, owners, weights, replicate)
            weights = "copy"
        nbytes = sum(o[k].raw.nbytes for o, k in owners)
        self.weights = choose_weights_mode("mmap" if replicate and weights == "auto" else weights, nbytes,
                                           mem_available())
        # a copy is also repacked for the unit (SimdLib.repack: the SSSE3 unit's K-quants zipped)
        self.weights_bytes = (copy_mats(owners, simd.repack, progress) if self.weights == "copy"
                              else 0)  # memory held
        self.out = held["out"]
        if self.ram_plan is not None:  # the file's pages the load touched leave this process's memory
            unmap(gm)
        self.mats = [self.out] + [m for L in blocks for m in L.mats()]  # the MTP block's too (eh_proj: 2 n_embd in)
        self.replicas = None
        if replicate:
            from .replicas import replicate as make_replicas

            self.replicas = make_replicas(simd, [m.raw for m in self.mats], numa.replicas, numa.replica_cpus)
        self._ws: dict[tuple[int, int], Workspace] = {}
        self.shared_scratch: dict = {}
        self.undo_buffers: dict[int, list[np.ndarray]] = {}  # per state: cpu/verify.py
        self.verify_outs: dict[tuple[int, int], tuple] = {}  # per (sequence of a verify pass, GDN layer): verify_out
        self.verify_passes = 0
        self.again_steps: dict[int, dict] = {}  # per state: its rollbacks' GDN calls, bound (cpu/verify.py)
        self.keep_hidden, self.hidden_kept = False, {}  # MTPParts.hidden_rows

    @property
    def numeric_path(self) -> str:
        return f"cpu:{self.simd.isa}{cache_path(self.args)}"

    def new_state(self, n_ctx: int) -> DecoderState:
        return DecoderState.new(self.args, n_ctx, sequence_layer_types(self.args, self.mtp_rows))

    MAX_SPLITS = 8  # workspaces kept for verify steps of several sequences (one per split of their rows)

    def workspace(self, T: int, n_ctx: int, rows: bool = False, verify: bool = False,
                  split: tuple[int, ...] | None = None) -> Workspace:
        """The buffers of a pass over T tokens of one sequence (shared by prompt chunks up to a power of two), or
        with `rows` of one token of each of exactly T sequences (decode_batch: bound calls, recorded steps), or with
        `verify` of exactly T tokens of one sequence (a verify step: bound calls, recorded steps), or with `split` of
        a verify step of several sequences, split[j] rows each (bound calls at those rows, recorded steps; the
        MAX_SPLITS last used splits kept)."""
        if split is not None:
            key = (sum(split), n_ctx, ("verify", tuple(split)))
            ws = self._ws.pop(key, None)  # re-inserted: the dict's order is the splits' last use
            if ws is None:
                ws = Workspace(self, sum(split), n_ctx, verify=True)
                ws.own_pos = True
                old = [k for k in self._ws if type(k[2]) is tuple]
                for k in old[: max(0, len(old) - self.MAX_SPLITS + 1)]:
                    del self._ws[k]
            self._ws[key] = ws
            return ws
        cap = T if rows or verify or T == 1 else max(16, 1 << (T - 1).bit_length())
        key = (cap, n_ctx, "verify" if verify else rows)
        ws = self._ws.get(key)
        if ws is None:
            ws = self._ws[key] = Workspace(self, cap, n_ctx, rows, verify)
        return ws

    # matrix products ------------------------------------------------------------------------------
    def call(self, ws: Workspace, key: tuple, method: str, *args, st: DecoderState | None = None,
             arrays: tuple = (), fresh: bool = False) -> None:
        """A native call; in decode (fixed buffers: ws.bind) bound once per workspace and call site, and per
        state for ops on its arrays (`arrays`: a layer's cache or recurrent state; a new sequence's arrays
        rebind it). Ops in replay.POS_ARGS take the position of `st`. fresh: bound anew each time (its arguments
        hold this step's values: attn_rows' positions, whose recorded offset is 0)."""
        if not ws.bind:
            getattr(self.simd, method)(*args)
            return
        if fresh:
            b = self.simd.bind(method, *args)
            if ws.rec is not None:
                ws.rec.append(b)
            b(0) if b.pos_arg is not None else b()
            return
        hit = ws.calls.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], arrays, strict=True)):
            ws.calls[key] = hit = (arrays, self.simd.bind(method, *args))
        b = hit[1]
        if ws.rec is not None:
            ws.rec.append(at_pos(b, st) if ws.own_pos and b.pos_arg is not None else b)
        if b.pos_arg is None:
            b()
        else:
            b(st.pos)

    def quantize(self, m: Mat, x: np.ndarray, ws: Workspace) -> np.ndarray:
        if ws.bind:  # decode: the quantized buffer of this matrix's input and its bound call, found once
            hit = ws.calls.get(("q", id(m)))
            if hit is not None:
                self._op(ws, hit[0])
                return hit[1]
        xq = ws.xq[self.simd.act_kind(m.qtype)][: x.shape[0], : self.simd.act_row_bytes(m.qtype, m.cols)]
        if ws.bind:  # each matrix has one input buffer per layer
            ws.calls[("q", id(m))] = c = (self.simd.bind("quantize", x, m.qtype, xq), xq)
            self._op(ws, c[0])
        else:
            self.simd.quantize(x, m.qtype, xq)
        return xq

    def mm_many(self, mats: list[Mat], x: np.ndarray, outs: list[np.ndarray], ws: Workspace) -> list[np.ndarray]:
        """Products of one input with several matrices: one quantization per activation format, one pooled call
        for them all (the thread pool wakes once)."""
        T = x.shape[0]
        decode = ws.bind
        if decode:  # decode: the whole call site replayed from bound calls
            seen = ws.calls.get(("many-replay", id(mats[0]), len(mats)))
            if seen is not None:
                for f in seen[0]:
                    self._op(ws, f)
                return seen[1]
        res: list[np.ndarray] = [None] * len(mats)  # type: ignore[list-item]
        xq: dict[str, np.ndarray] = {}
        items, steps = [], []
        for j, m in enumerate(mats):  # the input quantized once per activation format
            kind = self.simd.act_kind(m.qtype)
            if kind not in xq:
                xq[kind] = self.quantize(m, x, ws)
                if decode:
                    steps.append(ws.calls[("q", id(m))][0])
            res[j] = outs[j][:T, : m.rows]
            items.append((m.raw, m.qtype, m.rows, res[j]))
        m0 = mats[0]
        self.call(ws, ("many", id(m0)), "matmul_many", xq, m0.cols, items, SHAPE)
        if decode:
            ws.calls[("many-replay", id(m0), len(mats))] = (steps + [ws.calls[("many", id(m0))][1]], res)
        return res

    def mm(self, m: Mat, x: np.ndarray, out: np.ndarray, ws: Workspace, xq: np.ndarray | None = None) -> np.ndarray:
        """out[:T, :rows] = x @ W.T with llama.cpp's activation rounding (pass xq to reuse a quantized x), each
        row in the float shape of llama.cpp's one-token product (SHAPE)."""
        if xq is None:
            xq = self.quantize(m, x, ws)
        o = out[: xq.shape[0], : m.rows]
        self.call(ws, ("mm", id(m)), "matmul", m.raw, m.qtype, m.rows, m.cols, xq, o, SHAPE)
        return o

    # forward --------------------------------------------------------------------------------------
    def recorded(self, ws, states, replay) -> np.ndarray:
        """_forward over ws.tok with every native call recorded, then kept by `replay` (DecodeReplay for one state,
        BatchReplay for several) so the next step of the same shape replays it as one call."""
        self.recordings += 1
        ws.rec = []
        try:
            out = self._forward(ws.tok, states, ws)
            replay.keep(ws.replays, self.simd, states, ws.rec, out)
        finally:
            ws.rec = None
        return out

    def replayed(self, ws, state: DecoderState) -> np.ndarray:
        """A one-sequence step over ws: its recorded replay, another sequence's taken over (DecodeReplay.rebind), or
        a new recording."""
        rp = ws.replays.get(id(state))
        if rp is None or not rp.valid_for(state):
            rp = DecodeReplay.rebound(ws.replays, state, id(state))
        return rp.run(state) if rp is not None else self.recorded(ws, state, DecodeReplay)

    def forward(self, tokens, state: DecoderState, all_logits: bool = True) -> np.ndarray:
        """Logits of the T tokens (all_logits) or of the last; advances the state. A decode step (T = 1)
        replays the operations recorded at the first step of this state over these buffers (replay.DecodeReplay):
        the token's embedding row, then the rest as one native call."""
        ids = check_tokens(tokens, self.args.n_vocab)
        T = len(ids)
        state.check_room(T)
        image_row = T == 1 and bool(state.images) and bool(mrope.image_rows(state.images, state.pos, 1))
        ws = self.workspace(2 if image_row else T, state.n_ctx)
        if T == 1 and not image_row:  # (an image's row takes its encoder row: never a recorded decode step)
            ws.tok[0] = ids[0]
            out = self.replayed(ws, state)
        else:
            out = self._forward(ids, state, ws, all_logits)
        if self.keep_hidden and (all_logits or T == 1):  # a prompt pass (neither) kept every row (prompt_rows)
            self.keep_rows(state, state.pos, ws.x[:T])
        state.tokens[state.pos : state.pos + T] = ids
        state.pos += T
        return out

    def decode_batch(self, tokens, states: list[DecoderState]) -> np.ndarray:
        """One decode token for each of B sequences in one pass over the weights: logits (B, n_vocab), row j
        bit-identical to forward([tokens[j]], states[j], all_logits=False) (batch-invariant). The products run over
        B rows in SHAPE (each row in the one-token float shape), the MoE's routed (sequence, expert)
        pairs grouped by expert so each selected expert is read once; GDN and attention per sequence. The step is
        recorded the first time these sequences run together and replayed while they go on together (BatchReplay)."""
        ids = check_tokens(tokens, self.args.n_vocab)
        B = len(ids)
        if B != len(states) or len({id(st) for st in states}) != B:
            raise ValueError(f"decode_batch takes one token per distinct state: {B} tokens, {len(states)} states")
        if B == 1:
            return self.forward(ids, states[0], all_logits=False)
        for st in states:
            st.check_room(1)
        ws = self.workspace(B, max(st.n_ctx for st in states), rows=True)
        ws.tok[:] = ids
        key = BatchReplay.key(states)
        rp = ws.replays.get(key)
        delta = rp.delta(states) if rp is not None else None
        if delta is None:  # another set of B sequences' recording, pointed at these (BatchReplay.rebind)
            rp = BatchReplay.rebound(ws.replays, states, key)
            delta = None if rp is None else 0
        if delta is not None:  # the same sequences as at the recorded step: one native call (and the embedding)
            out = rp.run(delta)
        else:
            out = self.recorded(ws, states, BatchReplay)
        for j, (t, st) in enumerate(zip(ids, states, strict=True)):
            if self.keep_hidden:
                self.keep_rows(st, st.pos, ws.x[j : j + 1])
            st.tokens[st.pos] = t
            st.pos += 1
        return out

    def hidden(self, tokens, state: DecoderState) -> np.ndarray:
        """The final norm's output (what the head reads) of each of the T tokens, (T, n_embd) float32, the
        caller's array; advances the state as forward does (the same walk, stopped before the head)."""
        ids = check_tokens(tokens, self.args.n_vocab)
        T = len(ids)
        state.check_room(T)
        out = np.array(self._forward(ids, state, self.workspace(max(T, 2), state.n_ctx), True, head=False), copy=True)
        state.tokens[state.pos : state.pos + T] = ids
        state.pos += T
        return out

    def forward_many(self, chunks) -> np.ndarray:
        """Several sequences' prompt chunks, each (ids, state), in one pass: their rows share every product (each
        weight, each selected expert read once for all), attention and GDN run per sequence over its own rows.
        Each row is computed in its one-token float shape (SHAPE), so chunk j's logits are bit-identical to
        forward(ids_j, state_j, all_logits=False). Returns (n, n_vocab), the caller's array."""
        if len(chunks) == 1:
            ids, st = chunks[0]
            return np.array(self.forward(ids, st, all_logits=False)[-1:], copy=True)
        parts, segs = Segments.of(chunks, self.args.n_vocab, "forward_many")
        ws = self.workspace(max(segs.rows, 2), max(st.n_ctx for st, _, _ in segs))
        out = np.array(self._forward(np.concatenate(parts), segs, ws, all_logits=False), copy=True)
        for j, (ids, (st, _, _)) in enumerate(zip(parts, segs, strict=True)):
            if self.keep_hidden:  # the rows of the chunks' ends
                self.keep_rows(st, st.pos + len(ids) - 1, ws.x[j : j + 1])
            st.tokens[st.pos : st.pos + len(ids)] = ids
            st.pos += len(ids)
        return out

    def forward_rows(self, chunks, undo: bool = False):
        """Speculative verify rows of several sequences in one pass, every row's logits (and with `undo` a RowsUndo
        each): cpu/verify.py."""
        from .verify import forward_rows

        return forward_rows(self, chunks, undo)

    def close(self) -> None:
        """Work buffers, recorded steps, weight copies, expert readers and the C thread pool go now (the mapped file
        goes with the last view of it)."""
        if self.experts is not None:
            self.experts.close()
        self._ws.clear()
        self.shared_scratch.clear()
        self.undo_buffers.clear()
        self.verify_outs.clear()
        self.again_steps.clear()
        self.layers, self.mats, self.replicas, self.out, self.tok_embd = [], [], None, None, None
        self.simd.close()

    def copied(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Copies of `arrays`, split over the pool once they are large: one thread of the 16-core Xeon copied 6.3 GB/s,
        so a step's logits of 16 sequences (16 MiB) took 2.5 ms of a 45 ms step."""
        if sum(a.nbytes for a in arrays) < COPY_POOLED:
            return super().copied(arrays)
        got = [np.empty(a.shape, a.dtype) for a in arrays]
        self.simd.copy_many(got, [np.ascontiguousarray(a) for a in arrays])
        return got

    def copy_into(self, dsts: list[np.ndarray], srcs: list[np.ndarray]) -> None:
        """dst[...] = src for each pair, split over the pool once they are large: a restore writes a sequence's
        whole recurrent state (18 MB on the 0.8B, 48 MiB on the 9B, 63 MB on the 35B-A3B) and its prefix's K/V rows
        on the scheduler's thread, while every running sequence waits for the step."""
        pairs = [(d, x) for d, x in zip(dsts, srcs, strict=True) if d.size]
        if sum(d.nbytes for d, _ in pairs) < COPY_POOLED or not all(
                d.flags.c_contiguous and d.dtype == x.dtype and d.shape == x.shape for d, x in pairs):
            return super().copy_into(dsts, srcs)  # numpy's copy casts and broadcasts where the pool's would not
        self.simd.copy_many([d for d, _ in pairs], [np.ascontiguousarray(x) for _, x in pairs])

    def verify_out(self, j: int, i: int, conv: np.ndarray, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where every verify pass writes layer i's GDN state of its sequence j after its rows (cpu/verify.py)."""
        got = self.verify_outs.get((j, i))
        if got is None or got[0].shape != conv.shape or got[1].shape != S.shape:
            got = self.verify_outs[(j, i)] = (np.empty_like(conv), np.empty_like(S))
        return got

    def release(self, state: DecoderState) -> None:
        """Drop the recorded steps and bound calls that hold this state's arrays (a finished sequence's memory
        goes with it, not when its replay would be pushed out)."""
        self.undo_buffers.pop(id(state), None)
        self.again_steps.pop(id(state), None)
        self.hidden_kept.pop(id(state), None)
        mine = {id(a) for a in DecodeReplay._arrays(state)}
        for ws in self._ws.values():
            for k in [k for k, p in ws.replays.items() if p.holds(mine)]:
                if not (type(ws.replays[k]) in (BatchReplay, DecodeReplay) and ws.replays[k].detach()):  # (rebind)
                    del ws.replays[k]
            for k in [k for k, v in ws.calls.items()
                      if type(v) is tuple and len(v) == 2 and type(v[0]) is tuple and any(id(a) in mine for a in v[0])]:
                del ws.calls[k]

    def _op(self, ws: Workspace, fn, *args) -> None:
        """fn(*args); while a decode step is recorded, also its place in the step (a Bound call as itself)."""
        if ws.rec is None:
            fn(*args)
            return
        f = partial(fn, *args) if args else fn
        ws.rec.append(f)
        f()

    def _forward(self, ids: np.ndarray, state, ws: Workspace, all_logits: bool = True, head: bool = True) -> np.ndarray:
        """T tokens of one sequence (`state` a DecoderState), or one token of each of T sequences (a list): the
        architecture's description (models/graph.py) walked branch by branch, its ops CPUOps'. head False: the
        final norm's output (a view of the workspace) instead of the logits."""
        T = len(ids)
        a = self.args
        h, x = ws.h[:T], ws.x[:T]
        t = self.tok_embd
        self._op(ws, dequantize_rows, t.raw(), t.qtype, t.ne[0], ids, h)
        if not ws.bind and not isinstance(state, list):  # a prompt's image rows take the encoder's (models/mrope.py)
            for st, a0, a1 in (state if isinstance(state, Segments) else [(state, 0, T)]):
                for r0, r1, rows in mrope.image_rows(st.images, st.pos, a1 - a0):
                    h[a0 + r0 : a0 + r1] = rows
        flat = [(i, j, br) for i, block in enumerate(self.blocks) for j, br in enumerate(block)]
        ops = CPUOps(self, ws, state)
        self.call(ws, ("norm", -1), "rms_norm", h, None, self._norm_of(flat[0]), a.rms_eps, x)
        # a prompt pass for the MTP drafter: every row goes on to the final norm (MTPParts.prompt_rows)
        keep = self.keep_hidden and not all_logits and T > 1 and not isinstance(state, list)
        for n, (i, j, br) in enumerate(flat):  # each residual add fused with the norm that follows it
            last = n + 1 == len(flat)
            if last and not all_logits and T > 1 and not isinstance(state, list) and not keep:
                # as llama.cpp's graph (inp_out_ids): past the last mixer only the output rows go on (one per
                # sequence; their own rows, in the same buffers, in order)
                if isinstance(state, Segments):
                    ends = [b - 1 for _, _, b in state]
                    h[: len(ends)], x[: len(ends)] = h[ends], x[ends]
                    h, x = h[: len(ends)], x[: len(ends)]
                    all_logits = True
                else:
                    h, x = h[T - 1 :], x[T - 1 :]
            # branch outputs alternate between two buffers: the one not being written is free inside the branch
            out, spare = (ws.mix, ws.ffn) if j % 2 == 0 else (ws.ffn, ws.mix)
            y = br.fn(ops.at(i, j, out, spare), a, x)
            if last:
                self.call(ws, ("norm", i, j), "rms_norm", h, y, None, a.rms_eps, None)
            else:
                self.call(ws, ("norm", i, j), "rms_norm", h, y, self._norm_of(flat[n + 1]), a.rms_eps, x)
        if keep:
            return self.prompt_rows(ws, h, state, head)
        hs = h if all_logits else h[-1:]
        xs = ws.x[: hs.shape[0]]
        self.call(ws, ("norm", len(self.layers)), "rms_norm", hs, None, self.out_norm, a.rms_eps, xs)
        return self.mm(self.out, xs, ws.logits, ws) if head else xs

    def graph_ops(self, i: int, state: DecoderState, T: int) -> CPUOps:
        """The op vocabulary over block i for T rows of arbitrary arrays (tests call single ops through it): a
        prompt workspace, whose calls are not bound to its buffers."""
        ws = self.workspace(max(T, 2), state.n_ctx)
        return CPUOps(self, ws, state).at(i, 0, ws.mix, ws.ffn)

    def _norm_of(self, where: tuple) -> np.ndarray:
        i, _, br = where
        return self.layers[i][br.norm]

    def _moe(self, ops: CPUOps, x: np.ndarray, router: Mat, experts: tuple, shared: tuple | None, shared_gate):
        """The moe op (CPUOps.moe_impl), here so that benchmarks can wrap it per model."""
        return ops.moe_impl(x, router, experts, shared, shared_gate)

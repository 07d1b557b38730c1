"""backend="gpu": prompt prefill on the card, one pass over the layers, then decode on the CPU backend.

forward(tokens) is one pass of the GPU walker (walker.py, which also runs several prompts in one pass for
multi.forward_many): layer-major, so each streamed weight crosses the bus once per call; inside a layer the tokens
go in chunks of `chunk` rows (the activation budget); attention chunks read the card's K/V cache, GDN chunks carry
conv and S. The state lives on the host (`DecoderState`); the card keeps a copy (K/V cache, conv, S) that is
uploaded when the host state is not the one this backend last wrote, and written back after each call. GDN kernels
also write S and conv at requested positions, so the prefix cache gets snapshots from the same single pass.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ...format.quant_types import cache_type
from ...models import graph
from ...models.graph import BlockTensors, block_names
from ...models.state_kinds import cache_types, kind_of, kv_rotation, layer_arrays
from ..state import DecoderState
from . import k_attention as ka
from . import k_gemm as kgm
from . import k_moe as km
from . import loader
from .cards import paced_bus
from .expert_card import own_weights
from .graph_ops import GPUOps
from .handoff import StateHandoff
from .multi import in_passes
from .placement import is_vector, plan_placement, weights_of
from .streamer import Streamer
from .walker import MAX_SNAPS, tokens_hash, walk
from .work import Work, gemm_flops

# tokens per kernel call inside a layer: MoE groups of ~30 rows per expert at 8 of 256 experts (a 947-token
# prompt in one call; 512 halved them and cost 30% of GPU time on the 35B-A3B, bench/gpu_kernel_profile.py)
DEFAULT_CHUNK = 1024


def _f32(gm, name):
    from pycuda import gpuarray

    v = np.ascontiguousarray(gm.dequant(name), dtype=np.float32)
    t = gm.tensor(name)
    return gpuarray.to_gpu(v.reshape(-1) if len(t.ne) > 1 and all(int(n) == 1 for n in t.ne[1:]) else v)


F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


@contextmanager
def load_bar(on: bool, placement, infos, where: str, skip=frozenset()):
    """A tqdm bar on stderr of the bytes the streamer uploads to the card (resident tensors, pinned experts) or copies
    into pinned host memory (streamed tensors but those in `skip`: read from the file each pass) at load: its
    callback, or None when `on` is False."""
    if not on:
        yield None
        return
    from tqdm import tqdm

    total = sum(infos[n].nbytes for n in placement.resident) + sum(
        len(es) * infos[n].slab for n, es in placement.pinned_experts.items()) + sum(
        infos[n].nbytes for names in placement.streamed.values() for n in names
        if n not in placement.resident and n not in skip)
    with tqdm(total=total, desc=f"loading weights ({where})", unit="B", unit_scale=True, leave=False) as bar:
        yield bar.update


class Buffers:
    """Activation buffers for `C` tokens per kernel call and the card's copy of one sequence's state, as `layout`
    lists them: the walker's rows (h, x, mix, ffn, pos), each op's own buffers (`op_<op>` for the mixer kinds' ops,
    then the FFN's), and the state the mixer kinds declare (models/state_kinds.py): `state[name, layer]` for every
    array a layer keeps (per-token arrays with n_ctx rows) and, for each recurrent array, MAX_SNAPS slots
    `snap[name]` that the kernels write mid-prompt snapshots into (at the rows `snap_pos` names).

    kv_stream: the per-token arrays (K/V) of every layer stay in the host state; the card keeps one `slot[name]` of
    n_ctx rows that each layer's rows pass through (walker.py: up before the layer, its new rows down after), so a
    pass holds one layer's K/V instead of all of them; n_rows (default n_ctx): the hidden rows, the most new tokens
    a pass takes (a longer prompt goes in several passes, each continuing the last). layers (default all): the
    layers whose state the card keeps (one card of a multi-card prefill keeps its own range's)."""

    def __init__(self, a, C: int, n_ctx: int, kv_stream: bool = False, n_rows: int | None = None, layers=None):
        from pycuda import gpuarray

        self.C, self.n_ctx, self.kv_stream = C, n_ctx, kv_stream
        self.n_rows = n_ctx if n_rows is None else n_rows
        self.state: dict[tuple[str, int], object] = {}
        self.slot: dict[str, object] = {}
        self.snap: dict[str, object] = {}
        for key, (shape, dt) in self.layout(a, C, n_ctx, kv_stream, n_rows, layers).items():
            arr = gpuarray.empty(shape, dt)
            if isinstance(key, tuple):
                getattr(self, key[0])[key[1]] = arr
            else:
                setattr(self, key, arr)

    def kv(self, name: str, i: int):
        """The card's rows of per-token array `name` (K or V) of layer i: its own, or the slot they stream through."""
        return self.slot[name] if self.kv_stream else self.state[name, i]

    @classmethod
    def layout(cls, a, C: int, n_ctx: int, kv_stream: bool = False, n_rows: int | None = None, layers=None) -> dict:
        """Every buffer: attribute name, or (dict attribute, key), -> (shape, dtype)."""
        D, R = a.n_embd, n_ctx if n_rows is None else n_rows
        out: dict = {"h": ((R, D), F32), "x": ((C, D), F32), "mix": ((C, D), F32), "ffn": ((C, D), F32),
                     "pos": ((R,), I32)}  # pos: absolute positions of the call's tokens, set once
        for op in dict.fromkeys(kind_of(t).op for t in a.layer_types):
            out.update(getattr(cls, f"op_{op}")(a, C))
        out.update(cls.op_moe(a, C) if a.is_moe else cls.op_ffn(a, C))
        for i, s in layer_arrays(a.layer_types):  # in the storage DecoderState keeps them in (K/V: their types)
            if layers is not None and i not in layers:
                continue
            key = ("slot", s.name) if kv_stream and s.per_token else ("state", (s.name, i))
            out[key] = (s.full_shape(a, n_ctx), s.storage(a)[0])
        recurrent = {s.name: s for _, s in layer_arrays(a.layer_types) if not s.per_token}
        for name, s in recurrent.items():
            out[("snap", name)] = ((MAX_SNAPS, *s.full_shape(a, 0)), F32)
        if recurrent:
            out["snap_pos"] = ((MAX_SNAPS,), I32)
        return out

    @staticmethod
    def op_attention(a, C: int) -> dict:
        hd, gated = a.head_dim, 2 if a.attn_gate else 1
        return {"qg": ((C, a.n_head * hd * gated), F32), "q": ((C, a.n_head, hd), F32),
                "k": ((C, a.n_head_kv, hd), F32), "v": ((C, a.n_head_kv, hd), F32), "o": ((C, a.n_head, hd), F32),
                "attn_part": ((ka.SPLIT_ROWS, hd + 2), F32)}  # the partials of a call split over the context

    @staticmethod
    def op_gdn(a, C: int) -> dict:
        Cc, Hv = a.ssm_conv_channels, a.ssm_n_v_heads
        return {"u": ((C, Cc), F32), "c": ((C, Cc), F32), "z": ((C, Hv * a.ssm_d_v), F32), "ga": ((C, Hv), F32),
                "gb": ((C, Hv), F32), "y": ((C, Hv, a.ssm_d_v), F32)}

    @staticmethod
    def op_moe(a, C: int) -> dict:
        k, E, F, D = a.n_expert_used, a.n_expert, a.n_ff_exp, a.n_embd
        out = {"router": ((C, E), F32), "ids": ((C, k), I32), "wts": ((C, k), F32), "counts": ((E,), I32),
               "offs": ((E + 1,), I32), "perm_tok": ((C * k,), I32), "perm_w": ((C * k,), F32),
               "row_of_pair": ((C, k), I32), "scratch": (tuple(km.group_scratch_shape(C * k, E)), I32),
               "eg": ((C * k, F), F32), "eu": ((C * k, F), F32), "ed": ((C * k, D), F32)}
        if a.n_ff_shexp:
            out.update({"sg": ((C, a.n_ff_shexp), F32), "su": ((C, a.n_ff_shexp), F32), "sgate": ((C, 1), F32)})
        return out

    @staticmethod
    def op_ffn(a, C: int) -> dict:
        return {"fg": ((C, a.n_ff), F32), "fu": ((C, a.n_ff), F32)}

    # the output buffer of each product the descriptions' `linears` make (GPUOps.linears), by tensor name
    OUTS = {"attn_q": "qg", "attn_k": "k", "attn_v": "v", "attn_qkv": "u", "attn_gate": "z", "ssm_beta": "gb",
            "ssm_alpha": "ga", "ffn_gate": "fg", "ffn_up": "fu"}

    def out(self, name: str, n: int):
        """(n, width) rows of the output buffer of product `name`."""
        return getattr(self, self.OUTS[name])[:n].reshape(n, -1)

    @classmethod
    def nbytes(cls, a, C: int, n_ctx: int, kv_stream: bool = False, n_rows: int | None = None) -> int:
        """Bytes Buffers(a, C, n_ctx, kv_stream, n_rows) allocates (for the placement's reserve), without a card."""
        return sum(int(np.prod(shape)) * dt.itemsize
                   for shape, dt in cls.layout(a, C, n_ctx, kv_stream, n_rows).values())


def pass_tokens_fitting(a, chunk: int, budget: int, weights, kv_stream: bool = False,
                        n_rows: int | None = None) -> int:
    """The most tokens a pass may hold (0: none) so that its Buffers (the K/V and hidden rows of every position, the
    chunk's activations) take half of what `budget` leaves beside the double staging of every layer streamed (the
    least the weights need): the other half keeps weights resident, so short prompts are not slowed by a long
    context; plan_placement fits whatever this leaves (each of its moves keeps the total within the budget)."""
    from .placement import HOST_ONLY, staged

    fixed = Buffers.nbytes(a, chunk, 0, kv_stream, n_rows)
    per = Buffers.nbytes(a, chunk, 1, kv_stream, n_rows) - fixed  # Buffers grow by whole rows of n_ctx
    layers: dict[int, int] = {}
    for w in weights:
        if w.name not in HOST_ONLY:
            layers[w.layer] = layers.get(w.layer, 0) + staged(w)
    room = budget - fixed - 2 * max(layers.values(), default=0)
    return max(0, room // 2 // per)


FIT_STEP = 256  # a pass length fitted to the budget is a multiple of this (as the engine's chosen n_ctx)


@dataclass(frozen=True)
class PassPlan:
    """How long a GPU pass may be. A pass whose cached and new rows fit n_res keeps every layer's K/V on the card;
    a longer one streams them (Buffers kv_stream: one layer's rows on the card at a time, up to n_ctx, the rest in
    the host state) and takes at most n_rows new tokens (a longer prompt goes in several passes)."""

    n_res: int
    n_rows: int
    n_ctx: int

    def reserve(self, a, chunk: int) -> int:
        """Card bytes its buffers take at most: the larger of the two layouts (GPUModel.use_layout frees one before
        making the other)."""
        return max(Buffers.nbytes(a, chunk, self.n_res) if self.n_res else 0,
                   Buffers.nbytes(a, chunk, self.n_ctx, True, self.n_rows) if self.n_res < self.n_ctx else 0)


def plan_pass(a, chunk: int, budget: int, weights, n_ctx: int, kv_stream: bool | None = None,
              fit: bool = False) -> PassPlan:
    """The PassPlan of passes up to n_ctx rows under `budget` bytes (what the vectors leave). n_res is what fits with
    the K/V on the card (pass_tokens_fitting), up to n_ctx, and a streamed pass takes as many new rows: both layouts
    then take about the same memory, and streaming holds a context about as many times longer as the model has
    attention layers. kv_stream None streams only passes longer than n_res, True every pass (n_res 0), False none.
    fit: n_ctx is only the most a pass may hold and becomes what fits where that is less (a multiple of FIT_STEP,
    at least one step: plan_placement then says why none fits)."""
    has_kv = any(s.per_token for _, s in layer_arrays(a.layer_types))
    res = pass_tokens_fitting(a, chunk, budget, weights)
    if kv_stream is False or not has_kv or (kv_stream is None and res >= n_ctx):
        if fit and res < n_ctx:
            n_ctx = min(n_ctx, max(FIT_STEP, res // FIT_STEP * FIT_STEP))
        return PassPlan(n_ctx, n_ctx, n_ctx)
    rows = min(n_ctx, max(res, chunk))
    if fit:
        n = pass_tokens_fitting(a, chunk, budget, weights, kv_stream=True, n_rows=rows)
        if n < n_ctx:
            n_ctx = max(rows, n // FIT_STEP * FIT_STEP)
    return PassPlan(0 if kv_stream else min(res, n_ctx), rows, n_ctx)


class GPUModel:
    """Prefill on the card under `vram_budget` bytes (None: the card's free memory less 512 MiB).

    card_profile: fermi | kepler | maxwell | pascal compiles the kernels and picks tiles as for that class of card
    (cards.PROFILES), on this card's multiprocessors, and paces the weight stream to that class's bus; None: for
    the card itself. bus_bw (bytes/s) paces the weight stream to that rate instead (gpu/pacing.py). The kernels
    are loaded (compiled once per card and class, then read from the disk cache) here; `compiled` lists what this
    load did. fit_n_ctx: n_ctx is only the most a pass may hold; it becomes what fits the budget where that is less.
    kv_stream: None streams the K/V of a pass through the card layer by layer only where the pass is too long to
    keep them there (plan_pass); True / False: every pass or none. layers: [first, end) alone (the head is layer
    n_layer), one card's range in a multi-card prefill (multi_gpu.py); None: every layer. disk: None, or a RAM
    budget's disk_stage.DiskSource: the routed experts the card does not pin are read from the file on every pass
    (disk_stage.py) instead of kept in page-locked host copies, but for the layers hold() names."""

    single_pass = True
    # where each pass hands every prompt row's final-norm output (hidden_to(state, first position, rows)): set for the
    # MTP drafter, which runs its block over them on the CPU (GPUPrefillCPUDecode); None: the card keeps them
    hidden_to = None
    # an expert split's card (expert_gpu.py): the routed expert ids (first, end) it owns in every MoE layer, and the
    # op vocabulary that computes its partial sums and exchanges them; None: every expert, GPUOps
    own: tuple[int, int] | None = None
    ops_type = GPUOps

    def __init__(self, gm, args, n_ctx: int, vram_budget: int | None = None, chunk: int = DEFAULT_CHUNK,
                 device: int = 0, expert_counts=None, bus_bw: float | None = None,
                 card_profile: str | None = None, fit_n_ctx: bool = False, kv_stream: bool | None = None,
                 layers: tuple[int, int] | None = None, progress: bool = False, disk=None):
        loader.init(device)  # BackendNotAvailableError without pycuda or a card
        with loader.model_context():
            self._build(gm, args, n_ctx, vram_budget, chunk, device, expert_counts, bus_bw, card_profile, fit_n_ctx,
                        kv_stream, layers, progress, disk)

    def _build(self, gm, args, n_ctx, vram_budget, chunk, device, expert_counts, bus_bw, card_profile, fit_n_ctx,
               kv_stream, layers, progress, disk) -> None:
        loader.configure(card_profile)
        self.card_profile = card_profile
        self.compiled = loader.compile_all()
        import pycuda.driver as drv

        self.gm, self.args, self.n_ctx, self.chunk = gm, args, n_ctx, int(chunk)
        a = args
        self.stream = drv.Stream()
        # small GEMMs that leave most of the card idle (the shared expert, GDN's alpha and beta) run on a side
        # stream beside the main stream's larger ones; the side stream forks after and joins before main work
        self.side = drv.Stream()
        vec_names = [n for n, t in gm.tensors.items() if is_vector(n, t)
                     and not (n.startswith("blk.") and int(n.split(".")[1]) >= a.n_layer)]
        self.vec = {n: _f32(gm, n) for n in vec_names}  # norms, ssm_a, dt bias, conv kernels: float32
        vec_bytes = sum(v.nbytes for v in self.vec.values())
        self.first, self.end = (0, a.n_layer + 1) if layers is None else (int(layers[0]), int(layers[1]))
        ws = [w for w in weights_of(gm, args, matrices_only=True) if self.first <= w.layer < self.end]
        self.infos = {w.name: w for w in (ws if self.own is None else own_weights(ws, self.own))}
        self.layer_names = [tuple(n for n, w in self.infos.items() if w.layer == i) for i in range(a.n_layer)]
        self.block_names = [block_names(gm.tensors, i) for i in range(a.n_layer)]
        _check_supported(gm, args, self.infos.values())
        free, total = drv.mem_get_info()
        self.vram_budget = int(vram_budget) if vram_budget is not None else int(free) - (512 << 20)
        self.plan = plan_pass(a, self.chunk, self.vram_budget - vec_bytes, self.infos.values(), n_ctx, kv_stream,
                              fit_n_ctx)
        self.n_res, self.n_rows, self.n_ctx = self.plan.n_res, self.plan.n_rows, self.plan.n_ctx
        n_ctx = self.n_ctx
        self.reserved = vec_bytes + self.plan.reserve(a, self.chunk)
        # tokens routed to each (layer, expert) over the prompts seen: replan() pins the most used experts
        self.expert_counts: dict[tuple[int, int], int] = dict(expert_counts or {})
        self.placement = plan_placement(self.infos.values(), self.vram_budget, self.reserved, self.expert_counts)
        self.bus_bw = paced_bus(card_profile, bus_bw)
        self.reader = disk.reader() if disk is not None else None  # the model file, for the experts read each pass
        self.held: tuple[int, ...] = ()
        disk = self._disk(self.placement)
        skip = {n for st in disk[1].values() for n in st.copies} if disk else set()
        with load_bar(progress, self.placement, self.infos, f"card {device}", skip) as bar:
            self.streamer = Streamer(gm, self.placement, self.infos, self.stream, progress=bar, bus_bw=self.bus_bw,
                                     disk=disk)
        # per layer: 2 N K summed over its expert tensors (FLOPs per routed token, from the routing's real counts)
        self._exp_nk = {i: sum(gemm_flops(1, gm.tensor(n).ne[1], gm.tensor(n).ne[0]) for n in names
                               if self.infos[n].n_expert) for i, names in enumerate(self.layer_names)}
        self.work = Work()
        self.kv_types = tuple(cache_type(t).id for t in cache_types(a))  # ggml ids of the K and V cache types
        self.kv_rot = kv_rotation(a)  # their rotation sizes (0: none)
        self.buf = self.handoff = None
        self.use_layout(self.n_res == 0)
        self.blocks = graph.branches(a)  # the architecture's forward, walked layer-major by _forward
        self.out_norm, self.head = graph.head(a)
        self.tok_embd = gm.tensor(graph.arch_of(a).EMBED)
        self.last_timing: dict = {}
        self.drv = drv
        if a.is_moe:
            n_chunks = -(-n_ctx // self.chunk)
            self.counts_host = drv.pagelocked_zeros((a.n_layer, n_chunks, a.n_expert), np.int32)
        self._chunk_no = 0
        self.profile, self._marks = False, []  # profile: time gdn / attention / moe / ffn phases with events

    def use_layout(self, kv_stream: bool) -> None:
        """The card's buffers as a pass of this kind needs them: every layer's K/V on the card (n_res rows), or
        streamed through it (n_ctx rows). A switch frees one layout before making the other (both fit the reserve)
        and forgets the card's copy of a state."""
        if self.buf is not None and self.buf.kv_stream == kv_stream:
            return
        self.buf = self.handoff = None
        self._owner = None  # the state whose copy the card holds: (weakref, pos, hash of its tokens)
        # a range's card keeps its own layers' state only; its reserve (plan_pass) still counts every layer's, so it
        # spends less than the budget allows, never more
        mine = None if (self.first, self.end) == (0, self.args.n_layer + 1) else range(self.first, self.end)
        self.buf = (Buffers(self.args, self.chunk, self.n_ctx, True, self.n_rows, mine) if kv_stream
                    else Buffers(self.args, self.chunk, self.n_res, layers=mine))
        self.handoff = StateHandoff(self.buf, self.chunk)

    def new_state(self, n_ctx: int) -> DecoderState:
        return DecoderState.new(self.args, n_ctx)

    @property
    def allocated_bytes(self) -> int:
        """Card memory this backend holds: weights, staging, activation and state buffers, vectors."""
        return self.streamer.device_bytes + self.reserved

    @property
    def tower_room(self) -> int:
        """Card bytes the budget leaves beside this model's plan: a vision tower's (engine/image_encoder.py)."""
        return max(0, self.vram_budget - self.allocated_bytes)

    def set_aside(self, nbytes: int) -> None:
        """nbytes of the budget kept for the vision tower: reserved, so replan() never places weights there."""
        self.reserved += int(nbytes)

    def replan(self) -> None:
        """Re-decide residency with the expert counts seen so far (expert pinning), and re-stage the weights. Under a
        RAM budget a placement whose streamer would take more host memory than the one it replaces is refused
        (RamBudgetError; the old one stays)."""
        p = plan_placement(self.infos.values(), self.vram_budget, self.reserved, self.expert_counts)
        if self.reader is not None:
            from ...errors import RamBudgetError

            now, new = self._host_bytes(self.placement), self._host_bytes(p)
            if new > now:
                raise RamBudgetError(f"replan: the new placement's streamer takes {new} B of page-locked host memory, "
                                     f"the RAM budget's split gave it {now} B", needed=new)
        self.streamer = None  # free the old buffers before allocating the new ones
        self.placement = p
        self.streamer = Streamer(self.gm, p, self.infos, self.stream, bus_bw=self.bus_bw, disk=self._disk(p))
        self.streamer.keep(self.held)

    # under a RAM budget ----------------------------------------------------------------------------------
    def _disk(self, placement):
        """(reader, the LayerStages of `placement`'s layers read from the file), or None without a RAM budget."""
        if self.reader is None:
            return None
        from .disk_stage import file_offsets, stage_plan

        plan = stage_plan(placement, self.infos, file_offsets(self.gm, self.infos))
        return self.reader, plan

    def host_need(self, placement=None):
        """The streamer's host bytes as ram_split sees them (every cold expert read: before hold())."""
        from .disk_stage import host_need

        placement = placement or self.placement
        disk = self._disk(placement)
        return host_need(placement, self.infos, disk[1] if disk else {},
                         self.reader.threads * self.reader.bounce_bytes if self.reader is not None else 0)

    def _host_bytes(self, placement) -> int:
        """Host bytes a streamer of `placement` takes with the held layers kept."""
        from ..ram_split import RamSplit

        g = self.host_need(placement)
        held = tuple(i for i in self.held if i in g.layers)
        return RamSplit(0, 0, g, held, tuple(i for i in g.layers if i not in held)).gpu_bytes

    def hold(self, layers) -> None:
        """Keep page-locked copies of `layers`' cold experts (ram_split.split_ram's `held`) instead of reading them."""
        self.held = tuple(layers)
        self.streamer.keep(self.held)

    def disk_stats(self) -> dict:
        """Bytes and reads the passes took from the file so far (zeros without a RAM budget)."""
        r = self.reader
        return {"bytes_read": r.bytes_read if r else 0, "reads": r.reads if r else 0}

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    # state hand-off ------------------------------------------------------------------------------------
    def _holds(self, st: DecoderState) -> bool:
        """Whether the card's copy is this state as it is now: the same object (not one reusing a freed
        object's id), at the same position, after the same tokens (CPU decode or a restore changes them)."""
        if self._owner is None:
            return False
        ref, pos, h = self._owner
        return ref() is st and pos == st.pos and h == tokens_hash(st)

    # forward -------------------------------------------------------------------------------------------
    def forward(self, tokens, state: DecoderState, all_logits: bool = True, snapshot_at=(), on_snapshot=None):
        with loader.on_this_thread():
            return self._forward(tokens, state, all_logits, snapshot_at, on_snapshot)

    def _forward(self, tokens, state: DecoderState, all_logits: bool, snapshot_at, on_snapshot):
        return in_passes(self, tokens, state, all_logits, snapshot_at, on_snapshot)

    def walk_items(self, items, all_logits: bool = False) -> list[np.ndarray]:
        """One pass of the walker over `items` (walker.Item): each one's logits."""
        return walk(self, items, all_logits)

    def block(self, i: int, W: dict) -> BlockTensors:
        """Block i's tensors by short name: its streamed matrices (W, by GGUF name) and its float32 vectors."""
        return BlockTensors(i, self.block_names[i], lambda name: W[name] if name in W else self.vec[name])

    def _gemm(self, layer: int, x, W, **kw):
        """kgm.gemm, its FLOPs counted in self.work."""
        self.work.add("gemm", layer, gemm_flops(x.shape[0], W.shape[-2], W.shape[-1]))
        return kgm.gemm(x, W, **kw)

    def _fork(self):
        """The side stream starts after the work queued on the main stream so far; returns it."""
        ev = self.drv.Event()
        ev.record(self.stream)
        self.side.wait_for_event(ev)
        return self.side

    def _join(self) -> None:
        """The main stream continues after the work queued on the side stream so far."""
        ev = self.drv.Event()
        ev.record(self.side)
        self.stream.wait_for_event(ev)

    def _mark(self, phase: str | None) -> None:
        """With profile on: an event where `phase` (gdn / attention / moe / ffn) starts (None: ends)."""
        if self.profile:
            ev = self._event()
            ev.record(self.stream)
            self._marks.append((phase, ev))

    def _phase_seconds(self) -> dict:
        out: dict = {}
        for (ph, a), (_, b) in zip(self._marks, self._marks[1:], strict=False):
            if ph is not None:
                out[ph] = out.get(ph, 0.0) + b.time_since(a) / 1e3
        self._marks.clear()
        return out

    @staticmethod
    def _event():
        import pycuda.driver as drv

        return drv.Event()

    def _phase(self, i: int, br) -> str:
        """A branch's profile phase: the mixer's layer type (gdn / attention), or moe / ffn."""
        if br.kind == "mixer":
            return self.args.layer_types[i]
        return "moe" if self.args.is_moe else "ffn"

    def graph_ops(self, i: int, state: DecoderState, T: int) -> GPUOps:
        """The op vocabulary over layer i for T rows continuing `state` on the card (tests call single ops
        through it; the card's state is zeroed at position 0, as a pass does)."""
        if state.pos == 0:
            self.handoff.upload(state, self.stream)
        self.buf.pos[:T].set(np.arange(state.pos, state.pos + T, dtype=np.int32))
        L = self.block(i, self.streamer.weights(i, self.layer_names[i]))
        return GPUOps(self).at(L, self.buf.pos[:T], [(0, T, state.pos, 0)], [(0, T, 0, [], None, None)]).branch(0)


def _check_supported(gm, args, infos) -> None:
    from ...errors import UnsupportedArchitectureError, UnsupportedTensorTypeError
    from ...format.quant import type_name

    if getattr(args, "has_rope_freqs", False):
        raise UnsupportedArchitectureError(f"{gm.path!r}: rope frequency factors are not supported on the GPU yet")
    for w in infos:
        t = gm.tensor(w.name)
        if t.qtype not in kgm.GEMM_TYPES:
            raise UnsupportedTensorTypeError(
                f"{gm.path!r}: tensor {w.name!r} has type {t.type_name}, which the GPU kernels do not handle "
                f"(they do {', '.join(type_name(q) for q in kgm.GEMM_TYPES)}); use backend='cpu'")

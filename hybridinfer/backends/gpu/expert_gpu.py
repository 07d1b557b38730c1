"""GPU prefill split by experts over several cards (`split_mode="expert"`): every card walks every layer of the pass
on every row, in lockstep, one worker thread a card in its own CUDA context; the routed experts of each MoE layer
are split between the cards (expert_card.py decides which, a pure function), the rest of a layer runs on each card.

A card is a GPUModel over its own experts (ExpertCard: its placement pins and streams only those, so the buses
stream different bytes at once) whose MoE op (ExpertOps) computes the routing for all rows as one card does, the
grouped products of its own experts only (its slice of the routing's expert offsets: the grouped GEMM unchanged)
and its partial sum of each row's routed experts (the other cards' pairs add exact zeros, in slot order). The
partials go down into page-locked host rows, the cards meet (a barrier), and each card takes the others' up and adds
them in card order, so every card goes on with the same rows. The shared expert is added after, as on one card.

Float order: one card sums a row's k routed experts in slot order in one accumulator; here each card sums its own
in slot order and the partials are added card after card (exact on every card alike: with two cards p1 + p0 is
p0 + p1 in IEEE arithmetic). The result differs from one card's by the rounding of that regrouping, a few ulps of
the MoE output, within the multi-card tests' tolerance.

Card 0 owns the head and the host's DecoderState; a later card runs layers [0, n_layer) on its own copy of each
state (its kernels write the same state card 0's do; a copy keeps two cards from writing one array), kept between
calls while the host state is as the last call left it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

import numpy as np

from ...errors import CardFailedError, HybridInferError, ParameterError
from ..state import DecoderState
from . import expert_card, loader
from . import k_elementwise as ke
from . import k_moe as km
from .backend import DEFAULT_CHUNK, GPUModel
from .graph_ops import GPUOps
from .multi import forward_many, in_passes
from .multi_gpu import CardsModel, card_slots, close_cards, closing_on_error, make_card
from .walker import Item, walk

BARRIER_S = 600.0  # a card waiting this long at the exchange for another has lost it


def due(r0: int, r1: int, pending: list[tuple[int, int]]) -> int:
    """How many of the deferred exchanges (their rows, in the order they were deferred) must be done before rows
    [r0, r1) are read: through the last one whose rows meet them (they are done in order)."""
    return max((k + 1 for k, (a, b) in enumerate(pending) if a < r1 and r0 < b), default=0)


class Exchange:
    """Where the cards' partial sums meet: page-locked host rows a card and slot (call number mod
    expert_card.HOST_SLOTS), and the barrier of each call."""

    def __init__(self, n_cards: int, rows: int, width: int):
        import pycuda.driver as drv

        self.n = n_cards
        self.host = [[drv.pagelocked_empty((rows, width), np.float32, mem_flags=drv.host_alloc_flags.PORTABLE)
                      for _ in range(expert_card.HOST_SLOTS)] for _ in range(n_cards)]
        self.barrier = threading.Barrier(n_cards)


class CardLink:
    """One card's side of the Exchange: its index, the card buffers the exchange takes (expert_card.link_bytes),
    and its upload stream, which carries the others' partials up without the card's thread waiting for them.

    Under a paced bus (a card profile) the uploads go through the card's weight Pacer on that stream: one clock for
    both, so the partials take their share of the bus the weights stream over, as on a real card (they had a clock
    of their own, and the card's thread slept through each upload, so the card launched nothing meanwhile).

    Deferred (two cards, from the walker's row loop): a chunk's own partial goes down as soon as it is computed,
    and its exchange (barrier, the other's partial up, the sums added into the chunk's hidden rows) is done when a
    branch is about to read its rows (`settle(r0, r1)`: the next layer's mixer) or when more than
    expert_card.PENDING are deferred, so the card computes later chunks while its thread waits. Buffers (a chunk's
    own partial, its gated shared expert, the other's partial) by call number mod P + 1 (P = PENDING): call m's are
    written again at call m + P + 1, whose upload is queued after this card's thread has seen call m + P + 1's
    partial down, which its compute stream queued after call m's adds.

    Host rows by call number mod S = expert_card.HOST_SLOTS: a card queues its rows of call c after passing call
    c - P - 1's barrier (none deferred: c - 1's), and before any barrier n a card waits for its uploads of calls up
    to n - expert_card.READ_LAG. So when a card writes call m + S's rows, every card has read call m's:
    READ_LAG <= S - P - 1."""

    def __init__(self, ex: Exchange, k: int, m):
        from pycuda import gpuarray

        self.ex, self.k, self.m, self.calls, self.bytes = ex, k, m, 0, 0
        C, D = m.chunk, m.args.n_embd
        sets = range(expert_card.LINK_SETS)
        self.recv, self.part, self.shared = ([gpuarray.empty((C, D), np.float32) for _ in sets] for _ in range(3))
        self.gate = [gpuarray.empty((C,), np.float32) for _ in sets]
        self.up_stream = m.drv.Stream()
        self.pending: list[tuple] = []
        self.reads: deque = deque()  # (call, the event after this card's upload of its host rows)
        # host seconds of a pass spent waiting for this card's own work up to the exchange (and its uploads of
        # earlier calls), and for the other cards
        self.sync_s, self.barrier_s = 0.0, 0.0

    def reset(self) -> None:
        """Before a pass."""
        self.calls, self.bytes, self.pending, self.sync_s, self.barrier_s = 0, 0, [], 0.0, 0.0
        self.reads.clear()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.recv + self.part + self.shared + self.gate)

    def _down(self, out):
        """out's rows down into this card's host rows of this call: (call, host slot, the event after the copy)."""
        call = self.calls
        slot = call % expert_card.HOST_SLOTS
        self.calls += 1
        self.m.drv.memcpy_dtoh_async(self.ex.host[self.k][slot][: out.shape[0]], out.gpudata, self.m.stream)
        ev = self.m.drv.Event()
        ev.record(self.m.stream)
        return call, slot, ev

    def _meet(self, ev, call: int) -> None:
        t0 = time.perf_counter()
        ev.synchronize()
        while self.reads and self.reads[0][0] <= call - expert_card.READ_LAG:
            self.reads.popleft()[1].synchronize()
        t1 = time.perf_counter()
        self.ex.barrier.wait(BARRIER_S)
        self.sync_s += t1 - t0
        self.barrier_s += time.perf_counter() - t1

    def add_partials(self, out) -> None:
        """out (this card's partial, n rows) becomes every card's partial summed in card order, now."""
        ex, k, s = self.ex, self.k, self.m.stream
        n = out.shape[0]
        call, slot, ev = self._down(out)
        self._meet(ev, call)
        if ex.n == 2 or k == 0:  # out holds this card's partial: two cards' p_k + p_j is p_0 + p_1 exactly
            order = [j for j in range(ex.n) if j != k]
        else:  # out starts again from card 0's, and this card's own comes back up in its turn
            self._up(out, ex.host[0][slot][:n], call)
            order = list(range(1, ex.n))
        for j in order:
            after = self.m.drv.Event()
            after.record(s)  # recv[0] free: the add before has read it
            self._up(self.recv[0][:n], ex.host[j][slot][:n], call, after)
            ke.add(out, self.recv[0][:n], stream=s)

    def defer(self, part, shared, gate, h, rows) -> None:
        """Two cards: part (this card's partial, n rows, in self.part[parity]), shared and gate (its gated shared
        expert, or None) summed into h (the pass's rows [rows[0], rows[1])) once the other's partial is here; the
        exchanges deferred longest ago done now, so that at most expert_card.PENDING stay deferred."""
        p = self.calls % expert_card.LINK_SETS
        if shared is not None:
            n = part.shape[0]
            for dst, src in ((self.shared[p][:n], shared), (self.gate[p][:n], gate)):
                self.m.drv.memcpy_dtod_async(dst.gpudata, src.gpudata, src.nbytes, self.m.stream)
            shared, gate = self.shared[p][:n], self.gate[p][:n]
        call, slot, ev = self._down(part)
        self._settle_first(len(self.pending) + 1 - expert_card.PENDING)
        self.pending.append((call, slot, ev, p, part, shared, gate, h, rows))

    def settle(self, r0: int | None = None, r1: int | None = None) -> None:
        """The deferred exchanges done (their sums queued into their rows) up to the last one whose rows meet
        [r0, r1) (None: all). A branch's last chunk is left pending into the next layer, whose first chunks then
        queue work for the card while this thread waits at the barrier."""
        self._settle_first(len(self.pending) if r0 is None else due(r0, r1, [e[8] for e in self.pending]))

    def _settle_first(self, n: int) -> None:
        """The n exchanges deferred longest ago done (none where n <= 0)."""
        todo, self.pending = self.pending[: max(n, 0)], self.pending[max(n, 0) :]
        s, j = self.m.stream, 1 - self.k
        for call, slot, ev, p, part, shared, gate, h, _ in todo:
            n = part.shape[0]
            self._meet(ev, call)
            self._up(self.recv[p][:n], self.ex.host[j][slot][:n], call)
            ke.add(part, self.recv[p][:n], stream=s)
            if shared is not None:
                km.shared_add(part, shared, gate, stream=s)
            ke.add(h, part, stream=s)

    def _up(self, dst, host, call: int, after=None) -> None:
        """host rows (call's) up into dst on the upload stream, after the event `after` when given, paced with the
        card's weights where its bus is (k_pace.Pacer); the compute stream waits for them, this thread does not."""
        st, drv = self.up_stream, self.m.drv
        if after is not None:
            st.wait_for_event(after)
        pacer = self.m.streamer.pacer
        if pacer is not None:
            pacer.upload([(int(dst.gpudata), host.reshape(-1).view(np.uint8))], st)
        else:
            drv.memcpy_htod_async(dst.gpudata, host, st)
        self.bytes += host.nbytes
        ev = drv.Event()
        ev.record(st)
        self.reads.append((call, ev))
        self.m.stream.wait_for_event(ev)


class ExpertOps(GPUOps):
    """GPUOps whose routed experts are this card's alone, their partial sum exchanged with the other cards'."""

    def _experts(self, x, W: list, P: int, offs=None):
        lo, hi = self.m.own
        ed = self.b.ed[:P]
        # the other cards' pairs: exact zeros in the combine (the grouped GEMM leaves rows outside its experts)
        self.m.drv.memset_d32_async(int(ed.gpudata), 0, int(ed.size), self.s)
        return super()._experts(x, W, P, offs=self.b.offs[lo : hi + 1])

    def _combine(self, ed, wts, out, sh, gl):
        link = self.m.link
        if self.h is not None and link.ex.n == 2:  # from the walker's rows: it adds nothing, settle() will
            part = link.part[link.calls % expert_card.LINK_SETS][: out.shape[0]]
            super()._combine(ed, wts, part, None, None)
            if sh is not None:
                self.m._join()
            link.defer(part, sh, gl, self.h, self.rows)
            return None
        super()._combine(ed, wts, out, None, None)
        link.add_partials(out)
        if sh is not None:
            self.m._join()
            km.shared_add(out, sh, gl, stream=self.s)
        return out

    def settle(self, r0: int | None = None, r1: int | None = None) -> None:
        self.m.link.settle(r0, r1)


class ExpertCard(GPUModel):
    """A GPUModel over the routed experts [own[0], own[1]) of every MoE layer (and every dense weight)."""

    ops_type = ExpertOps

    def __init__(self, *a, own: tuple[int, int], **kw):
        self.own = (int(own[0]), int(own[1]))
        super().__init__(*a, **kw)


class ExpertParallelModel(CardsModel):
    """Prefill over `devices` (multi_gpu.check_devices), split by experts; the other arguments are GPUModel's (disk:
    each card reads its own experts' cold ones). Two or more cards; the model must have routed experts."""

    single_pass = True

    def __init__(self, gm, args, n_ctx: int, devices, vram_budget=None, chunk: int = DEFAULT_CHUNK,
                 card_profile=None, bus_bw: float | None = None, fit_n_ctx: bool = False,
                 kv_stream: bool | None = None, disk=None):
        if not args.is_moe:
            raise ParameterError("split_mode='expert' needs a model with routed experts; this one is dense (use "
                                 "split_mode='layer')")
        self.args, self.chunk, self.cards = args, int(chunk), []
        devices, self.ctxs, slots, ws = card_slots(gm, args, n_ctx, devices, vram_budget, self.chunk, card_profile)
        slots = [expert_card.with_link(s, args, self.chunk) for s in slots]
        self.counts, _ = expert_card.plan_split(ws, slots, args.n_layer)
        self.ranges = expert_card.expert_ranges(self.counts)
        link = expert_card.link_bytes(args, self.chunk)
        with closing_on_error(self):
            for k, (d, ctx, s, rng) in enumerate(zip(devices, self.ctxs, slots, self.ranges, strict=True)):
                self.cards.append(make_card(
                    ctx, s.label, f"experts {rng[0]}..{rng[1] - 1} of each layer", ExpertCard, gm, args, n_ctx,
                    device=d, vram_budget=s.vram_budget - link, chunk=self.chunk, bus_bw=bus_bw,
                    card_profile=card_profile, fit_n_ctx=fit_n_ctx, kv_stream=kv_stream,
                    layers=None if k == 0 else (0, args.n_layer), own=rng, disk=disk))
        self.n_ctx = min(c.m.n_ctx for c in self.cards)
        self.n_rows = min(c.m.n_rows for c in self.cards)
        self.n_res = min(c.m.n_res for c in self.cards)
        with loader.on_card(self.ctxs[0]):
            self.exchange = Exchange(len(self.cards), self.chunk, args.n_embd)
        for k, c in enumerate(self.cards):
            with loader.on_card(c.ctx):
                c.m.link = CardLink(self.exchange, k, c.m)
        self.compiled = [x for c in self.cards for x in c.m.compiled]
        self.last_timing: dict = {}
        self._views: dict[tuple[int, int], tuple] = {}

    @property
    def hidden_to(self):
        return self.cards[0].m.hidden_to

    @hidden_to.setter
    def hidden_to(self, fn) -> None:  # the MTP drafter's rows: card 0's pass has them
        self.cards[0].m.hidden_to = fn

    @property
    def allocated_bytes(self) -> int:
        return sum(c.m.allocated_bytes + c.m.link.nbytes for c in self.cards)

    def forward(self, tokens, state: DecoderState, all_logits: bool = True, snapshot_at=(), on_snapshot=None):
        return in_passes(self, tokens, state, all_logits, snapshot_at, on_snapshot)

    def forward_many(self, prompts) -> list[np.ndarray]:
        return forward_many(self, prompts)

    def _forward(self, tokens, state, all_logits, snapshot_at, on_snapshot):  # multi.forward_many's one-prompt pass
        return self.forward(tokens, state, all_logits, snapshot_at, on_snapshot)

    def view(self, k: int, st: DecoderState) -> DecoderState:
        """Card k's (k >= 1) copy of `st`: the last call's while `st` is where that call left it (same object,
        position and tokens), so the card holds it and uploads nothing; else a new copy."""
        self._views = {key: v for key, v in self._views.items() if v[0]() is not None}
        got = self._views.get((k, id(st)))
        if got is not None and got[0]() is st:
            v = got[1]
            if v.pos == st.pos and np.array_equal(v.tokens[: st.pos], st.tokens[: st.pos]):
                return v
        v = st.copy()
        self._views[k, id(st)] = (weakref.ref(st), v)
        return v

    def walk_items(self, items: list[Item], all_logits: bool = False) -> list[np.ndarray]:
        """One pass over `items` on every card at once (card 0 on the host states, with their snapshots and the
        logits; the others on their copies): card 0's logits. A card's failure is a CardFailedError naming it."""
        K = len(self.cards)
        per = [items] + [[Item(it.ids, self.view(k, it.state)) for it in items] for k in range(1, K)]
        got: list = [None] * K
        errs: list = [None] * K
        for c in self.cards:
            c.m.link.reset()
            c.totals = {}

        def run(k: int) -> None:
            c = self.cards[k]
            try:
                with loader.on_card(c.ctx):
                    sink = None if k == 0 else c.host_rows(self.n_rows, 0)
                    got[k] = walk(c.m, per[k], all_logits and k == 0, None, sink)
            except BaseException as e:  # the others leave the barrier (BrokenBarrierError) rather than wait
                errs[k] = e
                self.exchange.barrier.abort()

        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(k,), name=f"hybridinfer-expert-card-{k}") for k in range(K)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(e is not None for e in errs):
            self._failed(errs)
        for c in self.cards:
            c.count()
        self._timing(items, time.perf_counter() - t0)
        return got[0]

    def _failed(self, errs) -> None:
        self.exchange.barrier.reset()
        self._views.clear()  # a card may hold part of a pass: every state goes up again next time
        for c in self.cards:
            c.m._owner = None
        k = next((k for k, e in enumerate(errs) if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                 next(k for k, e in enumerate(errs) if e is not None))
        e, c = errs[k], self.cards[k]
        if isinstance(e, CardFailedError):
            raise e
        what = e if isinstance(e, HybridInferError) else f"{type(e).__name__}: {e}"
        raise CardFailedError(f"GPU prefill failed on {c.label}: {what}", c.device, c.name) from e

    def _timing(self, items, wall: float) -> None:
        """last_timing: the busiest bus's copy time and card's GPU time; weight bytes and FLOPs summed over cards."""
        ts = [c.m.last_timing for c in self.cards]
        self.last_timing = {
            "wall_s": wall, "tokens": sum(len(it.ids) for it in items), "prompts": len(items), "micro_batches": 1,
            "copy_s": max(t["copy_s"] for t in ts), "gpu_s": max(t["gpu_s"] for t in ts),
            "bytes_h2d": sum(t["bytes_h2d"] for t in ts), "work": {"flops": sum(t["work"]["flops"] for t in ts)},
            "exchange_bytes": sum(c.m.link.bytes for c in self.cards),
            "cards": [{"device": c.device, "experts": c.m.own, "bytes_h2d": t["bytes_h2d"],
                       "up_bytes": c.m.link.bytes, "copy_s": t["copy_s"],
                       "gpu_s": t["gpu_s"], "flops": t["work"]["flops"], "layers": (c.m.first, c.m.end),
                       "phases": t.get("phases", {}), "host_s": t.get("host_s", {}),
                       "exchange_s": {"sync": c.m.link.sync_s, "barrier": c.m.link.barrier_s}}
                      for c, t in zip(self.cards, ts, strict=True)]}

    def close(self) -> None:
        def one(c):
            try:
                with loader.on_card(c.ctx):
                    c.m.link = None
            finally:
                c.close()

        cards, self.cards = self.cards, []
        try:
            close_cards(cards, one)
        finally:
            if cards or getattr(self, "exchange", None) is not None:
                with loader.on_card(self.ctxs[0]):  # its page-locked rows freed in the context that made them
                    self.exchange = None

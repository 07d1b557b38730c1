"""GPU prefill over several cards (`devices=[0, 1, ...]`): the layers cut into contiguous ranges (multi_card.py
decides them, a pure function), one GPUModel a card over its range in the card's own CUDA context, and the prompt's
micro-batches flowing through them (pipeline.py: one worker thread a card, the hidden rows handed on through
page-locked host memory, no peer-to-peer link assumed). Each card walks its range with the one GPU walker
(walker.walk over [first, end)), and each layer's GDN state and K/V go to the host DecoderState as a one-card pass
sends them (handoff.py). A device index may repeat: the repeats share that card's context (each with its own
streams and buffers), so the multi-card path runs on a one-GPU host too.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import replace

import numpy as np

from ...errors import BackendNotAvailableError, ParameterError
from ..state import DecoderState, check_tokens
from . import calibration, cards, k_peak, loader, multi_card
from .pipeline import Job, micro_batches, run_pipeline, state_view
from .placement import BudgetError, is_vector, weights_of
from .walker import item, walk
from .work import prefill_work

PLAN_TOKENS = 4096  # the prompt length the split is balanced for (the micro-batch count is chosen per prompt)


class CardRunner:
    """One card of the pipeline: a GPUModel over layers [first, end) in the card's context."""

    def __init__(self, device: int, ctx, model, name: str):
        self.device, self.ctx, self.m, self.name = device, ctx, model, name
        self.label = f"device {device} ({name})"
        self._rows: dict[tuple[int, int], np.ndarray] = {}
        self.totals: dict[str, float] = {}  # what its passes counted since the last reset: bytes_h2d, flops, ...

    def host_rows(self, n: int, i: int):
        """Its i-th output buffer of n hidden rows (made once): page-locked and portable, so the next card's
        context reads it as page-locked too."""
        got = self._rows.get((n, i))
        if got is None:
            import pycuda.driver as drv

            with loader.on_card(self.ctx):
                got = drv.pagelocked_empty((n, self.m.args.n_embd), np.float32, mem_flags=drv.host_alloc_flags.PORTABLE)
            self._rows = {k: v for k, v in self._rows.items() if k[0] == n}  # another length: the old ones go
            self._rows[n, i] = got
        return got

    def run(self, job: Job, state: DecoderState, rows_in, out):
        with loader.on_card(self.ctx):
            got = walk(self.m, [item(self.m, job.ids, state)], job.all_logits, rows_in, out)[0]
        self.count()
        return got

    def count(self) -> None:
        """Its model's last pass added to its totals."""
        t = self.m.last_timing
        for key, v in (("bytes_h2d", t["bytes_h2d"]), ("flops", t["work"]["flops"]), ("copy_s", t["copy_s"]),
                       ("gpu_s", t["gpu_s"]), ("passes", 1)):
            self.totals[key] = self.totals.get(key, 0) + v

    def close(self) -> None:
        with loader.on_card(self.ctx):  # its buffers freed in its context
            if self.m is not None:
                self.m.close()  # its reader of the model file (under a RAM budget)
            self.m, self._rows = None, {}


@contextlib.contextmanager
def closing_on_error(model):
    """Inside: a multi-card model's cards being built; on an error the cards built so far are closed (their buffers,
    and under a RAM budget their readers of the file) before it goes on."""
    try:
        yield
    except BaseException as e:
        try:
            model.close()
        except Exception as c:  # a card that failed may not close either: the build's error is the one to see
            e.add_note(f"closing the cards built so far also failed: {c!r}")
        raise


def close_cards(cards, close_one) -> None:
    """close_one(card) for every card, though some fail (a card that died may refuse its context): the others'
    buffers and file readers are still freed; then the first failure is raised."""
    first = None
    for c in cards:
        try:
            close_one(c)
        except Exception as e:
            first = first or e
    if first is not None:
        raise first


def make_card(ctx, label: str, share: str, build, *a, device: int, **kw) -> CardRunner:
    """One card of a multi-card model: build(*a, device=device, **kw) (its GPUModel) made in the card's context, as
    a CardRunner. A card that cannot run is a BackendNotAvailableError, and a pass plan larger than the split assumed
    a multi_card.CardBudgetError, both naming the card (`label`, its CardSlot's); `share` says what the card was to
    hold ("layers 0..11")."""
    with loader.on_card(ctx):
        try:
            m = build(*a, device=device, **kw)
        except BackendNotAvailableError as e:
            raise BackendNotAvailableError(f"{label}: {e}") from None
        except BudgetError as e:  # its own pass plan left less than the split assumed
            raise multi_card.CardBudgetError(label, f"{share}: {e}") from None
    return CardRunner(device, ctx, m, loader.device_name(device))


class CardsModel:
    """What a prefill over several cards (MultiGPUModel, expert_gpu.ExpertParallelModel) shows the engine whichever
    its split, from its `cards` (CardRunners, in card order): the card a vision tower runs on (engine/image_encoder.py)
    and, under a RAM budget (make_backend's _split_ram), its cards' readers of the model file.

    The tower's card is multi_card.tower_card's choice, made at the first ask and kept, so the room it reads, the
    bytes it sets aside from that card's budget and the context its encodes run in (`tower_context`) are one card's.
    Under a RAM budget each card's GPUModel has its own reader of the file (disk_stage.DiskSource.reader: its own
    pool, buffers and staging, used from that card's worker thread alone), and ram_split.split_cards splits the
    budget over them."""

    cards: list[CardRunner]
    _tower_k: int | None = None
    ram_split = None  # the ram_split.CardsSplit, once made

    @property
    def vram_budget(self) -> int:
        return min(c.m.vram_budget for c in self.cards)

    def new_state(self, n_ctx: int) -> DecoderState:
        return DecoderState.new(self.args, n_ctx)

    @property
    def tower(self) -> CardRunner:
        if self._tower_k is None:
            self._tower_k = multi_card.tower_card([c.m.tower_room for c in self.cards])
        return self.cards[self._tower_k]

    @property
    def tower_room(self) -> int:
        return self.tower.m.tower_room

    def set_aside(self, nbytes: int) -> None:
        self.tower.m.set_aside(nbytes)

    @property
    def tower_context(self):
        """The chosen card's CUDA context (loader.card_context's): gpu/vision.py enters it for every encode."""
        return self.tower.ctx

    def host_need(self) -> tuple:
        """Each card's ram_split.GpuHost, in card order."""
        out = []
        for c in self.cards:
            with loader.on_card(c.ctx):
                out.append(c.m.host_need())
        return tuple(out)

    def hold(self, held) -> None:
        """held[k]: the layers whose cold experts card k keeps in page-locked copies (CardsSplit.held), made in its
        context."""
        for c, h in zip(self.cards, held, strict=True):
            with loader.on_card(c.ctx):
                c.m.hold(h)

    def disk_stats(self) -> dict:
        """Bytes and reads the cards' passes took from the file so far, summed, and each card's."""
        per = [c.m.disk_stats() for c in self.cards]
        return {"bytes_read": sum(d["bytes_read"] for d in per), "reads": sum(d["reads"] for d in per), "cards": per}

    @property
    def tok_embd(self):
        return self.cards[0].m.tok_embd

    @tok_embd.setter
    def tok_embd(self, t) -> None:  # under a budget every card embeds from the CPU's copy, not the file's mapping
        for c in self.cards:
            c.m.tok_embd = t


def check_devices(devices, vram_budget, device=None) -> tuple[list[int], list]:
    """devices: card indices in pipeline order (a repeat: another context on that card); vram_budget: one for all,
    one a device, or None (each card's free memory less 512 MiB); device: the one-card option, which must not be
    given too. Returns (devices, a budget a device)."""
    if devices is None and isinstance(vram_budget, (list, tuple)):
        raise ParameterError(f"vram_budget {vram_budget!r}: one budget a device needs devices=[...]")
    if device is not None and devices is not None:
        raise ParameterError(f"give device or devices, not both (device={device!r}, devices={devices!r})")
    if not isinstance(devices, (list, tuple)) or not devices:
        raise ParameterError(f"devices must be a non-empty list of CUDA device indices, got {devices!r}")
    for d in devices:
        if type(d) is not int or d < 0:
            raise ParameterError(f"devices: {d!r} is not a CUDA device index (an int >= 0)")
    budgets = list(vram_budget) if isinstance(vram_budget, (list, tuple)) else [vram_budget] * len(devices)
    if len(budgets) != len(devices):
        raise ParameterError(f"{len(budgets)} VRAM budgets for {len(devices)} devices: give one for all or one a "
                             "device")
    for d, b in zip(devices, budgets, strict=True):
        if b is not None and (type(b) is not int or b <= 0):
            raise ParameterError(f"vram_budget of device {d} must be a positive number of bytes, got {b!r}")
    return list(devices), budgets


class MultiGPUModel(CardsModel):
    """Prefill over `devices` (see check_devices), each card a GPUModel over its layer range; the other arguments
    are GPUModel's (disk: each card reads its own layers' cold experts). micro_batch: rows a micro-batch (None: the
    count the time model prefers for each prompt)."""

    single_pass = True

    def __init__(self, gm, args, n_ctx: int, devices, vram_budget=None, chunk: int = 1024, card_profile=None,
                 bus_bw: float | None = None, fit_n_ctx: bool = False, kv_stream: bool | None = None,
                 micro_batch: int | None = None, disk=None):
        from .backend import GPUModel

        if micro_batch is not None and (type(micro_batch) is not int or micro_batch < 1):
            raise ParameterError(f"micro_batch must be a positive number of rows, got {micro_batch!r}")
        self.args, self.micro_batch, self.cards = args, micro_batch, []
        devices, ctxs, slots, ws = card_slots(gm, args, n_ctx, devices, vram_budget, chunk, card_profile)
        self.plan = layer_plan(gm, args, n_ctx, ws, slots)
        with closing_on_error(self):
            for (d, ctx), sh in zip(zip(devices, ctxs, strict=True), self.plan.shares, strict=True):
                self.cards.append(make_card(
                    ctx, sh.slot.label, f"layers {sh.first}..{sh.end - 1}", GPUModel, gm, args, n_ctx, device=d,
                    vram_budget=sh.slot.vram_budget, chunk=chunk, bus_bw=bus_bw, card_profile=card_profile,
                    fit_n_ctx=fit_n_ctx, kv_stream=kv_stream, layers=(sh.first, sh.end), disk=disk))
        self.n_ctx = min(c.m.n_ctx for c in self.cards)
        self.n_rows = min(min(c.m.n_rows, c.m.n_res or c.m.n_rows) for c in self.cards)
        self.chunk = chunk
        self.compiled = [x for c in self.cards for x in c.m.compiled]
        self.last_timing: dict = {}
        self._views: dict[int, tuple] = {}

    @property
    def allocated_bytes(self) -> int:
        return sum(c.m.allocated_bytes for c in self.cards)

    def rows_for(self, T: int) -> int:
        """Rows a micro-batch of a T-token prompt: the given micro_batch, else T over the time model's count; never
        more than every card's pass holds."""
        if self.micro_batch is not None:
            return min(self.micro_batch, self.n_rows)
        m = multi_card.micro_batch_count(self.plan.shares, self.plan.tokens, T)
        return max(1, min(-(-T // m), self.n_rows))

    def forward(self, tokens, state: DecoderState, all_logits: bool = True, snapshot_at=(), on_snapshot=None):
        """The prompt through the cards; with snapshots asked for inside it, in segments ending there (the pipeline
        drained at each, so the host state is whole when on_snapshot takes it)."""
        ids = check_tokens(tokens, self.args.n_vocab)
        state.check_room(len(ids))
        p0 = state.pos
        cuts = sorted({int(p) - p0 for p in snapshot_at if p0 < int(p) < p0 + len(ids)})
        outs = []
        for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True):
            lg = self._run([(ids[a:b], state)], all_logits)[0]
            outs.append(lg)
            if b < len(ids) and on_snapshot is not None:
                on_snapshot(state, lg[-1])
        return np.concatenate(outs, axis=0) if all_logits else outs[-1]

    def forward_many(self, prompts) -> list[np.ndarray]:
        """(ids, state, snapshot_at, on_snapshot) each: last-token logits. Prompts without inner snapshots flow
        through the cards together (a card starts the next prompt while the one after it finishes this one)."""
        out: list = [None] * len(prompts)
        plain = []
        for j, (ids, st, at, cb) in enumerate(prompts):
            ids = check_tokens(ids, self.args.n_vocab)
            st.check_room(len(ids))
            if cb is not None and any(st.pos < int(p) < st.pos + len(ids) for p in at):
                out[j] = self.forward(ids, st, False, at, cb)
            else:
                plain.append((j, ids, st))
        if plain:
            for (j, _, _), lg in zip(plain, self._run([(ids, st) for _, ids, st in plain], False), strict=True):
                out[j] = lg
        return out

    def views_of(self, st: DecoderState) -> list[DecoderState]:
        """Each card's view of `st` (pipeline.state_view): the last call's while the state is as that call left it
        (the same object, position, tokens and arrays), so a card that still holds its copy uploads nothing, as one
        card's GPUModel._holds spares it; else new views."""
        self._views = {k: v for k, v in self._views.items() if v[0]() is not None}
        got = self._views.get(id(st))
        if got is not None and got[0]() is st:
            v = got[1][0]
            if (v.pos == st.pos and np.array_equal(v.tokens[: st.pos], st.tokens[: st.pos])
                    and all(x is y for n in st.arrays for x, y in zip(v.arrays[n], st.arrays[n], strict=True))):
                return got[1]
        vs = [state_view(st) for _ in self.cards]
        self._views[id(st)] = (weakref.ref(st), vs)
        return vs

    def _run(self, prompts, all_logits: bool) -> list[np.ndarray]:
        import time

        for _, st in prompts:
            if st.n_ctx > self.n_ctx:
                raise ValueError(f"state n_ctx {st.n_ctx} exceeds the GPU backend's n_ctx {self.n_ctx}")
        rows = min(self.rows_for(len(ids)) for ids, _ in prompts)
        jobs = [replace(j, all_logits=all_logits) for j in micro_batches([len(ids) for ids, _ in prompts], rows)]
        for c in self.cards:
            c.totals = {}
        t0 = time.perf_counter()
        # row buffers of a power of two: made once for most prompt lengths
        per = [self.views_of(st) for _, st in prompts]
        try:
            res = run_pipeline(self.cards, jobs, prompts, min(self.n_rows, 1 << max(rows - 1, 1).bit_length()),
                               [[vs[k] for vs in per] for k in range(len(self.cards))])
        except BaseException:
            self._views.clear()  # a card may hold part of a pass: every state goes up again next time
            for c in self.cards:
                c.m._owner = None
            raise
        out = []
        for seq in range(len(prompts)):
            mine = [res[j] for j in jobs if j.seq == seq]
            out.append(np.concatenate(mine, axis=0) if all_logits else mine[-1])
        # the busiest bus's copy time and card's GPU time; bytes and FLOPs summed over cards and micro-batches
        self.last_timing = {"wall_s": time.perf_counter() - t0, "tokens": sum(len(i) for i, _ in prompts),
                            "prompts": len(prompts), "micro_batches": len(jobs), "rows": rows,
                            "copy_s": max(c.totals.get("copy_s", 0.0) for c in self.cards),
                            "gpu_s": max(c.totals.get("gpu_s", 0.0) for c in self.cards),
                            "bytes_h2d": sum(c.totals.get("bytes_h2d", 0) for c in self.cards),
                            "work": {"flops": sum(c.totals.get("flops", 0.0) for c in self.cards)},
                            "cards": [dict(c.totals, device=c.device, layers=(c.m.first, c.m.end))
                                      for c in self.cards]}
        return out

    def close(self) -> None:
        cards, self.cards = self.cards, []
        close_cards(cards, lambda c: c.close())


def card_slots(gm, args, n_ctx: int, devices, vram_budget, chunk: int, card_profile):
    """(devices, their contexts, their multi_card.CardSlots, the matrices placed) for a prefill over `devices` (see
    check_devices): each card's budget (None: its free memory less 512 MiB, shared by the cards repeating it), the
    bytes its pass buffers and vectors reserve, and the card its time model takes."""
    from .backend import plan_pass

    devices, budgets = check_devices(devices, vram_budget)
    loader.init(devices[0])
    loader.configure(card_profile)
    ctxs = [loader.card_context(d) for d in devices]
    ws = weights_of(gm, args, matrices_only=True)
    vec = sum(4 * int(np.prod(t.ne)) for n, t in gm.tensors.items() if is_vector(n, t)  # as GPUModel keeps them
              and not (n.startswith("blk.") and int(n.split(".")[1]) >= args.n_layer))
    slots = []
    for k, (d, ctx) in enumerate(zip(devices, ctxs, strict=True)):
        with loader.on_card(ctx):
            import pycuda.driver as drv

            if budgets[k] is None:
                budgets[k] = (int(drv.mem_get_info()[0]) - (512 << 20)) // devices.count(d)
            cc = drv.Context.get_device().compute_capability()
            # a profile compiles and paces as the old card does, but the kernels run at this card's speed: the
            # split's time model takes the profile's bus and this card's measured FMA peak (else it would cut a
            # bus-bound prompt into micro-batches that each stream the weights again)
            table = (replace(cards.card(card_profile), fp32_flops=k_peak.fma_peak_flops(rounds=1 << 12))
                     if card_profile else _card_like(cc))
        res = vec + plan_pass(args, chunk, budgets[k] - vec, ws, n_ctx).reserve(args, chunk)
        slots.append(multi_card.CardSlot(table, budgets[k], res, calibration.efficiency_for(table.limits),
                                         f"device {d} ({loader.device_name(d)})"))
    return devices, ctxs, slots, ws


def layer_plan(gm, args, n_ctx: int, ws, slots) -> multi_card.MultiPlan:
    """The layer split balanced for a prompt of min(n_ctx, PLAN_TOKENS) tokens."""
    T = min(n_ctx, PLAN_TOKENS)
    w = prefill_work(gm, args, T)
    return multi_card.split_cards(ws, [w.by_layer.get(i, 0.0) for i in range(args.n_layer + 1)], slots, T,
                                  4 * args.n_embd)


def choose_split(gm, args, n_ctx: int, devices, vram_budget=None, chunk: int = 1024, card_profile=None) -> str:
    """split_mode "auto": "expert" where the time model predicts the expert split faster than the layer pipeline
    for a prompt of min(n_ctx, PLAN_TOKENS) tokens (a bus-bound prompt of a MoE model), else "layer"."""
    from . import expert_card

    if not args.is_moe:
        return "layer"
    _, _, slots, ws = card_slots(gm, args, n_ctx, devices, vram_budget, chunk, card_profile)
    try:
        ep = expert_card.plan_experts(gm, args, ws, [expert_card.with_link(s, args, chunk) for s in slots],
                                      min(n_ctx, PLAN_TOKENS))
    except multi_card.CardBudgetError:
        return "layer"
    return expert_card.choose(layer_plan(gm, args, n_ctx, ws, slots).seconds, ep.seconds)


def open_cards(gm, args, n_ctx: int, devices, split_mode=None, **kw):
    """The prefill over `devices` in `split_mode` (expert_card.SPLIT_MODES; None: auto, choose_split's); kw:
    MultiGPUModel's (micro_batch: the layer pipeline's alone)."""
    from . import expert_card

    mode = expert_card.check_split_mode(split_mode)
    if mode == "auto" and kw.get("micro_batch") is not None:
        mode = "layer"  # micro-batches are the layer pipeline's
    if mode == "auto":
        mode = choose_split(gm, args, n_ctx, devices, kw.get("vram_budget"), kw.get("chunk", 1024),
                            kw.get("card_profile"))
    if mode == "layer":
        return MultiGPUModel(gm, args, n_ctx, devices, **kw)
    if kw.pop("micro_batch", None) is not None and split_mode == "expert":
        raise ParameterError("micro_batch is the layer pipeline's (split_mode='layer'); an expert split runs every "
                             "card over the whole pass")
    from .expert_gpu import ExpertParallelModel

    return ExpertParallelModel(gm, args, n_ctx, devices, **kw)


def _card_like(cc) -> cards.Card:
    """The table card standing for a card of compute capability `cc` in the split's time model (a card newer than
    the table: the newest class's)."""
    cls = cards.class_of(tuple(cc))
    return cards.card(cls if cls in cards.PROFILES else "pascal")

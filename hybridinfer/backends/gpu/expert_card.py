"""Expert-parallel prefill over several cards (`split_mode="expert"`): which routed experts each card owns, and the
predicted time of a prompt, beside the layer pipeline's (multi_card.py), for the choice between the two. Pure
functions, no GPU.

Every card walks every layer on every row of the prompt, in lockstep: the dense part of a layer (attention or Gated
DeltaNet, norms, router, shared expert) runs on each card (its weights duplicated, resident or streamed under each
card's budget), while the routed experts of each MoE layer are split: card c owns a contiguous range of expert ids
(the same count in every layer), pins and streams only those, and computes the layer's routed sum over them for all
rows. The partial sums cross through pinned host memory and are added in card order on every card, so all cards go
on with the same rows. A bus-bound prompt gains because each bus streams different bytes at the same time (a layer
pipeline's later card waits for the rows of the card before it, so their buses work one after the other); the dense
compute is not shared, so a compute-bound prompt gains less than from the pipeline.

Why contiguous ranges: a card's kernels then see its experts as one [n, N, K] tensor and its slice of the routing's
expert offsets, so the grouped GEMM runs unchanged (gpu/expert_gpu.py). Why one count for every layer: the cards meet
at every MoE layer, so a layer whose share is larger on one card holds the other back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from ...errors import ParameterError
from . import timemodel
from .multi_card import CardBudgetError, CardSlot
from .placement import HOST_ONLY, BudgetError, Placement, WeightInfo, plan_placement

SPLIT_MODES = ("auto", "layer", "expert")  # llama.cpp's -sm/--split-mode names where the meaning is the same


def check_split_mode(mode) -> str:
    """The split mode named by `mode` (None: auto), or a ParameterError naming the bad value."""
    if mode is None:
        return "auto"
    if mode not in SPLIT_MODES:
        hint = " (llama.cpp's row and tensor split single matrices; here a model splits by layers or by experts)" \
            if mode in ("row", "tensor") else ""
        raise ParameterError(f"split mode {mode!r} is not one of {', '.join(SPLIT_MODES)}{hint}")
    return mode


def expert_counts_of(n_expert: int, n_cards: int, first: int | None = None) -> list[int]:
    """Experts a layer each card owns: `first` for card 0 and the rest split evenly (first None: all even)."""
    if n_cards < 1 or n_expert < n_cards:
        raise ParameterError(f"{n_expert} experts a layer cannot be split over {n_cards} cards (one expert a card "
                             "at least)")
    if first is None:
        return [n_expert * (c + 1) // n_cards - n_expert * c // n_cards for c in range(n_cards)]
    if not 1 <= first <= n_expert - (n_cards - 1):
        raise ParameterError(f"card 0's {first} experts leave fewer than one a card for the other {n_cards - 1}")
    return [first, *expert_counts_of(n_expert - first, n_cards - 1)] if n_cards > 1 else [first]


def expert_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Each card's contiguous expert ids [first, end) from its count, in card order."""
    out, e = [], 0
    for n in counts:
        out.append((e, e + n))
        e += n
    return out


def own_weights(ws: Iterable[WeightInfo], rng: tuple[int, int], head_layer: int | None = None) -> list[WeightInfo]:
    """One card's weights under an expert split: every dense matrix, each routed-expert tensor cut to experts
    [first, end) of `rng` (a tensor of fewer experts than end is refused), and the head (layer head_layer) only
    where head_layer is None (the card that computes the logits)."""
    lo, hi = rng
    out = []
    for w in ws:
        if head_layer is not None and w.layer == head_layer:
            continue
        if w.n_expert:
            if hi > w.n_expert:
                raise ParameterError(f"{w.name!r} has {w.n_expert} experts, the split gives a card ids {lo}..{hi - 1}")
            w = replace(w, nbytes=(hi - lo) * w.slab, n_expert=hi - lo, first_expert=w.first_expert + lo)
        out.append(w)
    return out


@dataclass(frozen=True)
class ExpertShare:
    """One card of an expert split: its expert ids [first, end) in every MoE layer, its placement, and its seconds
    over the whole prompt: compute (its dense layers and its experts' share of the routed products), its weights'
    transfer, and the partial sums' exchange (on its bus, in the compute's path)."""

    slot: CardSlot
    experts: tuple[int, int]
    placement: Placement
    compute_s: float
    transfer_s: float
    exchange_s: float

    @property
    def stream_bytes(self) -> int:
        return self.placement.stream_bytes_per_pass


@dataclass(frozen=True)
class ExpertPlan:
    tokens: int
    shares: tuple[ExpertShare, ...]
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else math.inf


def lockstep_seconds(compute: Sequence[Sequence[float]], transfer: Sequence[Sequence[float]]) -> float:
    """Seconds for cards walking the same layers in lockstep, each streaming its own weights through two staging
    slots as timemodel.pipeline_seconds replays one card (compute[c][i], transfer[c][i]: card c's layer i): no card
    leaves layer i before every card is through it (the partial sums' exchange). One card: pipeline_seconds."""
    if len(compute) != len(transfer) or any(len(c) != len(t) for c, t in zip(compute, transfer, strict=True)):
        raise ParameterError("lockstep_seconds: compute and transfer need the same cards and layers")
    n = len(compute[0]) if compute else 0
    if any(len(c) != n for c in compute):
        raise ParameterError("lockstep_seconds: every card walks the same layers")
    K = len(compute)
    copy_end, free = [0.0] * K, [[0.0, 0.0] for _ in range(K)]
    done = 0.0
    for i in range(n):
        ends = []
        for c in range(K):
            t, ready = transfer[c][i], 0.0
            if t < 0 or compute[c][i] < 0:
                raise ParameterError(f"card {c} layer {i}: negative seconds")
            if t > 0:
                copy_end[c] = max(copy_end[c], free[c][i % 2]) + t
                ready = copy_end[c]
            ends.append(max(done, ready) + compute[c][i])
        done = max(ends)
        for c in range(K):
            if transfer[c][i] > 0:
                free[c][i % 2] = done
    return done


def _exchange_bytes(K: int, k: int, rows_bytes: int) -> tuple[int, int]:
    """(down, up) bytes card k moves a MoE layer: its partial down, the others' up (with more than two cards a card
    after the first also takes its own back up, so that every card adds them in card order)."""
    return rows_bytes, (K - 1 if K == 2 or k == 0 else K) * rows_bytes


def predict_experts(ws: Sequence[WeightInfo], flops: Sequence[float], routed: Mapping[int, float],
                    slots: Sequence[CardSlot], counts: Sequence[int], tokens: int, row_bytes: int,
                    expert_counts=None, placements: Sequence[Placement] | None = None) -> ExpertPlan:
    """The ExpertPlan of an expert split giving card c counts[c] experts a layer (in card order).

    ws: the matrices the GPU path places (placement.weights_of(..., matrices_only=True)); flops[i]: the prompt's
    FLOPs in layer i, the head last (work.prefill_work's by_layer); routed[i]: those of layer i's routed experts
    (its "moe" cell); row_bytes: one hidden row (4 n_embd). Card 0 computes the head. placements: the cards'
    placements when already made (plan_split makes them once for every prompt length)."""
    ws = [w for w in ws if w.name not in HOST_ONLY]
    K, head, rows = len(slots), len(flops) - 1, tokens * row_bytes
    moe_layers = sorted({w.layer for w in ws if w.n_expert})
    if not moe_layers:
        raise ParameterError("an expert split needs a model with routed experts (this one has none)")
    n_exp = max(w.n_expert for w in ws)
    ranges = expert_ranges(counts)
    comp_all, tr_all, shares = [], [], []
    for k, (s, rng) in enumerate(zip(slots, ranges, strict=True)):
        mine = own_weights(ws, rng, None if k == 0 else head)
        if placements is not None:
            p = placements[k]
        else:
            try:
                p = plan_placement(mine, s.vram_budget, s.reserved, expert_counts)
            except BudgetError as e:
                raise CardBudgetError(s.label, f"experts {rng[0]}..{rng[1] - 1} of each layer: {e}") from None
        byname = {w.name: w for w in mine}
        share = (rng[1] - rng[0]) / n_exp
        f = [flops[i] - routed.get(i, 0.0) * (1 - share) for i in range(len(flops))]
        if k:
            f[head] = 0.0  # the head runs on card 0
        comp, tr = timemodel.layer_times(f, [p.layer_stream_bytes(byname, i) for i in range(len(flops))],
                                         s.card.fp32_flops, s.card.bus_bw, s.eff.compute, s.eff.bus)
        down, up = _exchange_bytes(K, k, rows)
        xs = (down + up) / s.bus if K > 1 else 0.0
        for i in moe_layers:
            comp[i] += xs  # the compute stream waits for the exchange
            tr[i] += up / s.bus if K > 1 else 0.0  # and its up half takes the bus the weights stream over
        comp_all.append(comp)
        tr_all.append(tr)
        shares.append(ExpertShare(s, rng, p, sum(comp) - xs * len(moe_layers), sum(tr), xs * len(moe_layers)))
    return ExpertPlan(tokens, tuple(shares), lockstep_seconds(comp_all, tr_all))


def plan_split(ws: Sequence[WeightInfo], slots: Sequence[CardSlot], head_layer: int,
               expert_counts=None) -> tuple[list[int], list[Placement]]:
    """The experts a layer each card owns and the cards' placements: the streamed bytes over each card's bus as even
    as whole experts allow (card 0 also holds the head; each card pins the most used of its own experts under its
    budget, as plan_placement does on one card). Two cards: a bisection on card 0's count; more: an even split."""
    slots = list(slots)
    ws = [w for w in ws if w.name not in HOST_ONLY]
    if not slots:
        raise ParameterError("no cards to split the experts over")
    for s in slots:
        if s.vram_budget <= 0:
            raise ParameterError(f"{s.label}: vram budget must be more than 0 bytes, got {s.vram_budget}")
    n_exp = max((w.n_expert for w in ws), default=0)
    if not n_exp:
        raise ParameterError("an expert split needs a model with routed experts (this one has none)")
    memo: dict[tuple[int, ...], list[Placement]] = {}

    def place(counts: list[int]) -> list[Placement]:
        key = tuple(counts)
        if key not in memo:
            out = []
            for k, (s, rng) in enumerate(zip(slots, expert_ranges(counts), strict=True)):
                try:
                    out.append(plan_placement(own_weights(ws, rng, None if k == 0 else head_layer), s.vram_budget,
                                              s.reserved, expert_counts))
                except BudgetError as e:
                    raise CardBudgetError(s.label, f"experts {rng[0]}..{rng[1] - 1} of each layer: {e}") from None
            memo[key] = out
        return memo[key]

    def lean(counts: list[int]) -> float:  # > 0: card 0's bus carries longer than card 1's
        p = place(counts)
        return p[0].stream_bytes_per_pass / slots[0].bus - p[1].stream_bytes_per_pass / slots[1].bus

    if len(slots) != 2:
        counts = expert_counts_of(n_exp, len(slots))
        return counts, place(counts)
    # card 0's count: a first guess moves experts from the even split by the bytes one expert id takes over every
    # layer, a bracket around it grows until the lean turns, then a bisection (a few placements, not log2 E)
    one = sum(w.slab for w in ws if w.n_expert)
    half = n_exp // 2
    g = half - round(lean([half, n_exp - half]) / (one / slots[0].bus + one / slots[1].bus))
    g = min(max(g, 1), n_exp - 1)
    step = 1
    if lean([g, n_exp - g]) > 0:
        lo, hi = max(1, g - 1), g
        while lo > 1 and lean([lo, n_exp - lo]) > 0:
            hi, lo, step = lo, max(1, lo - 2 * step), 2 * step
    else:
        lo, hi = g, min(n_exp - 1, g + 1)
        while hi < n_exp - 1 and lean([hi, n_exp - hi]) <= 0:
            lo, hi, step = hi, min(n_exp - 1, hi + 2 * step), 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if lean([mid, n_exp - mid]) > 0:
            hi = mid
        else:
            lo = mid
    best = min((lo, hi), key=lambda n0: (max(place([n0, n_exp - n0])[0].stream_bytes_per_pass / slots[0].bus,
                                             place([n0, n_exp - n0])[1].stream_bytes_per_pass / slots[1].bus),
                                         abs(n0 - n_exp / 2)))
    counts = [best, n_exp - best]
    return counts, place(counts)


def choose(layer_seconds: float, expert_seconds: float) -> str:
    """"expert" where the expert split is predicted faster (a bus-bound prompt), else "layer" (a tie: layer, the
    mode that moves fewer bytes between the cards)."""
    return "expert" if expert_seconds < layer_seconds else "layer"


# Exchanges a card keeps deferred (expert_gpu.CardLink.defer): a chunk's sums are needed only when the next layer
# reads its rows, so up to a layer's chunks wait while the card computes the next ones (at one, a chunk's work
# of 1,024 rows was shorter than the barrier and the emulated bus of the exchange before it, and the card
# stalled). Buffer sets by call number mod PENDING + 1, host rows mod PENDING + 1 + READ_LAG, and a card waits
# for its upload of a call's rows READ_LAG barriers later (CardLink says why).
PENDING = 3
READ_LAG = 2
LINK_SETS = PENDING + 1
HOST_SLOTS = PENDING + 1 + READ_LAG


def link_bytes(args, chunk: int) -> int:
    """Card bytes the exchange takes (expert_gpu.CardLink): LINK_SETS sets, by call number, of a chunk of rows
    each for the other cards' partial sums coming up, this card's own partial and its gated shared expert, and the
    gate's logits."""
    return LINK_SETS * (3 * 4 * chunk * args.n_embd + 4 * chunk)


def with_link(s: CardSlot, args, chunk: int) -> CardSlot:
    """`s` with the exchange's buffer reserved beside its pass buffers."""
    return replace(s, reserved=s.reserved + link_bytes(args, chunk))


def plan_experts(gm, args, ws: Sequence[WeightInfo], slots: Sequence[CardSlot], tokens, expert_counts=None):
    """The ExpertPlan of `gm` over `slots` for a prompt of `tokens` tokens (a sequence of lengths: a list of plans,
    the split and placements made once)."""
    from .work import prefill_work

    counts, places = plan_split(ws, slots, args.n_layer, expert_counts)
    out = []
    for T in ([tokens] if isinstance(tokens, int) else tokens):
        w = prefill_work(gm, args, T)
        flops = [w.by_layer.get(i, 0.0) for i in range(args.n_layer + 1)]
        routed = {i: w.cells.get(("moe", i), 0.0) for i in range(args.n_layer)}
        out.append(predict_experts(ws, flops, routed, slots, counts, T, 4 * args.n_embd, expert_counts, places))
    return out[0] if isinstance(tokens, int) else out

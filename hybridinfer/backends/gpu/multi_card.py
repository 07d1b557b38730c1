"""Prefill over several cards: the layers cut into contiguous ranges (pipeline order), one range a card, each card's
placement under its own budget, and the predicted time of a prompt cut into micro-batches of rows that flow through
the cards. Pure functions, no GPU.

Why contiguous ranges: no peer-to-peer link is assumed, so the hidden rows cross from one card to the next through
pinned host memory; contiguous ranges cross once a boundary per micro-batch. Why micro-batches: a pipeline of ranges
beats one card only where the cards work at once (card 0 runs micro-batch m+1 while card 1 runs micro-batch m). A card
streams its own layers' weights once per micro-batch, so more micro-batches buy overlap of compute with repeated
transfers; the count is the time model's choice (a transfer-bound prompt is best in one, and gains from the cards'
summed VRAM keeping more resident).

The time of one micro-batch on a card (a stage) is the single-card model (timemodel.pipeline_seconds) over its layers
with its compute divided by the micro-batch count, plus the hidden rows' trips over its bus; the stages then run as a
pipeline: micro-batch m leaves card k when it has left card k-1 and card k is done with micro-batch m-1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...errors import ParameterError
from . import calibration, cards, timemodel
from .placement import HOST_ONLY, BudgetError, Placement, WeightInfo, plan_placement, staged

MIN_ROWS = 64  # a micro-batch is at least this many rows (fewer would leave the card's GEMMs idle)
MAX_MICRO = 32


class CardBudgetError(BudgetError):
    """A card's budget cannot hold its share: its reserve and the double staging of its layers. `card` names it."""

    def __init__(self, card: str, msg: str):
        super().__init__(f"{card}: {msg}")
        self.card = card


@dataclass(frozen=True)
class CardSlot:
    """One card of a split: its table entry, its VRAM budget, the bytes its activation and state buffers and vectors
    take (reserved), the calibrated efficiencies of its kernels, and the label errors name it by (device and card)."""

    card: cards.Card
    vram_budget: int
    reserved: int
    eff: calibration.Efficiency
    label: str

    @property
    def bus(self) -> float:
        return self.card.bus_bw * self.eff.bus

    @property
    def flops(self) -> float:
        return self.card.fp32_flops * self.eff.compute


def slot(card_name: str, vram_budget: int, reserved: int, index: int = 0,
         eff: calibration.Efficiency | None = None) -> CardSlot:
    """The CardSlot of table card `card_name` (or a class: fermi, kepler ...) as device `index`."""
    c = cards.card(card_name)
    return CardSlot(c, int(vram_budget), int(reserved), eff or calibration.efficiency_for(c.limits),
                    f"card {index} ({c.name})")


@dataclass(frozen=True)
class CardShare:
    """What one card does: layers [first, end) (layer n_layer is the head), its placement, and its seconds: compute
    of the whole prompt, its weights' transfer once, the hidden rows' trips of the whole prompt, one stage."""

    slot: CardSlot
    first: int
    end: int
    placement: Placement
    compute_s: float
    transfer_s: float
    handoff_s: float
    stage_s: float

    @property
    def stream_bytes(self) -> int:
        return self.placement.stream_bytes_per_pass


@dataclass(frozen=True)
class MultiPlan:
    tokens: int
    micro_batches: int
    shares: tuple[CardShare, ...]
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else math.inf

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.first, s.end) for s in self.shares]


def pipeline_total(stages: Sequence[float], micro_batches: int) -> float:
    """Seconds for `micro_batches` micro-batches to pass stages of these seconds each, in order on every stage."""
    if micro_batches < 1:
        raise ParameterError(f"micro-batches must be at least 1, got {micro_batches!r}")
    done = [0.0] * len(stages)  # when each stage finished its last micro-batch
    for _ in range(micro_batches):
        left = 0.0
        for k, s in enumerate(stages):
            done[k] = max(done[k], left) + s
            left = done[k]
    return done[-1] if done else 0.0


def micro_batch_counts(tokens: int) -> list[int]:
    """Candidate micro-batch counts: powers of two while a micro-batch keeps MIN_ROWS rows (1 always)."""
    out, m = [1], 2
    while m <= MAX_MICRO and tokens // m >= MIN_ROWS:
        out.append(m)
        m *= 2
    return out


def split_cards(weights: Iterable[WeightInfo], flops_by_layer: Sequence[float], slots: Sequence[CardSlot],
                tokens: int, row_bytes: int, micro_batches: int | None = None) -> MultiPlan:
    """The split of a model's layers over `slots` (in pipeline order) for a prompt of `tokens` tokens.

    weights: the matrices the GPU path places (placement.weights_of(..., matrices_only=True)); flops_by_layer[i]: the
    prompt's FLOPs in layer i, the head being the last (work.prefill_work); row_bytes: one hidden row (4 n_embd).
    micro_batches None: the count of micro_batch_counts with the least predicted time (the fewest on a tie). The
    ranges minimise the slowest card's stage, then its bytes over its bus; with one card the plan is
    plan_placement's and timemodel's exactly."""
    slots = list(slots)
    units = len(flops_by_layer)
    if not slots:
        raise ParameterError("no cards to split the layers over")
    if len(slots) > units:
        raise ParameterError(f"{len(slots)} cards for {units} layers (the head counts as one): one card a layer at "
                             "most")
    if not isinstance(tokens, int) or tokens < 1:
        raise ParameterError(f"prompt tokens must be a positive count, got {tokens!r}")
    for s in slots:
        if s.vram_budget <= 0:
            raise ParameterError(f"{s.label}: vram budget must be more than 0 bytes, got {s.vram_budget}")
    ws = [w for w in weights if w.name not in HOST_ONLY]
    nbytes, stg = [0] * units, [0] * units
    for w in ws:
        if not 0 <= w.layer < units:
            raise ParameterError(f"weight {w.name!r} of layer {w.layer} outside the {units} layers of the split")
        nbytes[w.layer] += w.nbytes
        stg[w.layer] += staged(w)
    counts = [micro_batches] if micro_batches is not None else micro_batch_counts(tokens)
    best = None
    for m in counts:
        ranges = _ranges(nbytes, stg, flops_by_layer, slots, m, tokens * row_bytes)
        plan = _predict(ws, flops_by_layer, slots, ranges, tokens, row_bytes, m)
        if best is None or plan.seconds < best.seconds:
            best = plan
    return best


def _ranges(nbytes, stg, flops, slots, m: int, rows_bytes: int) -> list[tuple[int, int]]:
    """Contiguous ranges, one a card, minimising (slowest stage, most bytes a bus carries) lexicographically: a
    bottleneck partition by dynamic programming over range ends."""
    n, K = len(nbytes), len(slots)
    pb, pf = [0], [0.0]
    for b, f in zip(nbytes, flops, strict=True):
        pb.append(pb[-1] + b)
        pf.append(pf[-1] + f)
    inf = (math.inf, math.inf)

    def cost(k: int, i: int, j: int, top: int) -> tuple[float, float]:
        s = slots[k]
        room = s.vram_budget - s.reserved - 2 * top  # what may stay resident beside the double staging
        if room < 0:
            return inf
        streamed = max(0, pb[j] - pb[i] - room)
        trips = ((k > 0) + (k < K - 1)) * rows_bytes
        stage = max((pf[j] - pf[i]) / s.flops / m, streamed / s.bus) + trips / m / s.bus
        return stage, (pb[j] - pb[i]) / s.bus

    # best[k][j]: (value, start) of the first k+1 cards over layers [0, j)
    best = [[(inf, -1)] * (n + 1) for _ in range(K)]
    for k in range(K):
        for j in range(k + 1, n - (K - 1 - k) + 1):
            top = 0
            for i in range(j - 1, k - 1, -1):  # card k takes [i, j)
                top = max(top, stg[i])
                if k == 0 and i > 0:
                    continue
                prev = best[k - 1][i][0] if k else (0.0, 0.0)
                if prev == inf:
                    continue
                c = cost(k, i, j, top)
                v = max(prev, c)
                if v < best[k][j][0]:
                    best[k][j] = (v, i)
    if best[K - 1][n][0] == inf:
        _no_split(slots, stg)
    out, j = [], n
    for k in range(K - 1, -1, -1):
        i = best[k][j][1]
        out.append((i, j))
        j = i
    return out[::-1]


def _no_split(slots, stg) -> None:
    """Raise the error naming the first card that cannot hold even the least share, else one naming them all."""
    least = 2 * min((s for s in stg if s), default=0)
    for s in slots:
        if s.reserved + least > s.vram_budget:
            raise CardBudgetError(s.label, f"vram budget {s.vram_budget} B cannot hold its {s.reserved} B of "
                                           f"activations, state and vectors plus the double staging of one layer "
                                           f"({least} B at least); raise its --vram-budget")
    raise CardBudgetError(", ".join(s.label for s in slots),
                          "no split of the layers fits every card's budget beside the double staging of its largest "
                          "layer; raise the budgets or add a card")


def _predict(ws, flops, slots, ranges, tokens: int, row_bytes: int, m: int) -> MultiPlan:
    K, rows = len(slots), -(-tokens // m)
    shares = []
    for k, (s, (i, j)) in enumerate(zip(slots, ranges, strict=True)):
        mine = [w for w in ws if i <= w.layer < j]
        try:
            p = plan_placement(mine, s.vram_budget, s.reserved)
        except BudgetError as e:
            raise CardBudgetError(s.label, f"layers {i}..{j - 1}: {e}") from None
        byname = {w.name: w for w in mine}
        comp, tr = timemodel.layer_times([flops[x] for x in range(i, j)],
                                         [p.layer_stream_bytes(byname, x) for x in range(i, j)],
                                         s.card.fp32_flops, s.card.bus_bw, s.eff.compute, s.eff.bus)
        hand = ((k > 0) + (k < K - 1)) * rows * row_bytes / s.bus
        stage = timemodel.pipeline_seconds([c / m for c in comp], tr) + hand
        shares.append(CardShare(s, i, j, p, sum(comp), sum(tr), hand * m, stage))
    return MultiPlan(tokens, m, tuple(shares), pipeline_total([sh.stage_s for sh in shares], m))


def micro_batch_count(shares: Sequence[CardShare], plan_tokens: int, tokens: int) -> int:
    """The micro-batch count (of micro_batch_counts) of least predicted time for a prompt of `tokens` tokens over a
    split planned for `plan_tokens`: compute and hand-off scale with the tokens, each card's weights cross its bus
    once a micro-batch (a stage taken as the larger of its compute and its transfer)."""
    f = tokens / plan_tokens
    best = (math.inf, 1)
    for m in micro_batch_counts(tokens):
        stages = [max(sh.compute_s * f / m, sh.transfer_s) + sh.handoff_s * f / m for sh in shares]
        best = min(best, (pipeline_total(stages, m), m))
    return best[1]


def tower_card(rooms: Sequence[int]) -> int:
    """The card a vision tower runs on beside a multi-card prefill (engine/image_encoder.py): the index of the one
    with the most bytes left under its budget (`rooms`, GPUModel.tower_room's, in card order), the first on a tie."""
    if not rooms:
        raise ParameterError("tower_card: no cards to choose from")
    return max(range(len(rooms)), key=lambda k: (int(rooms[k]), -k))

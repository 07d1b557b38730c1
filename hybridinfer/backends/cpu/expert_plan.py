"""What stays in RAM under a RAM budget, which cached expert makes room, and what to read ahead: pure functions.

A MoE layer's routed experts are most of a model's bytes (122B-A10B: ~95 %), and one token uses k of E of them.
Under `ram_budget` every other tensor stays resident, and each layer gets a number of expert slots: some pinned
(the experts the usage counts rank first, read at load, never evicted) and the rest a cache filled from the GGUF
when routing selects an expert that is not there (cpu/expert_store.py). The usage counts are the GPU placement's
kind (gpu/placement.py `expert_counts`: tokens routed to (layer, expert)), ranked the same way: most used first,
then the lower layer, then the lower expert.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ...errors import RamBudgetError
from ..expert_io import DIRECT_ALIGN, aligned_span  # noqa: F401 (the readers' alignment, planned with)

DYNAMIC_SHARE = 0.5  # of a layer's slots, the part the cache may refill (the rest pinned); at least k


@dataclass(frozen=True)
class ExpertLayer:
    """One block's routed experts as planning sees them: `expert_bytes` is one expert's gate, up and down."""

    block: int
    n_expert: int
    expert_bytes: int


@dataclass(frozen=True)
class RamPlan:
    """What a RAM budget keeps: `fixed_bytes` (every tensor but the routed experts), per block the number of
    expert slots, the pinned experts (slots 0.. hold them) and those the other slots start with, and `extra_bytes`
    (the readers' buffers)."""

    budget: int
    fixed_bytes: int
    extra_bytes: int
    layers: tuple[ExpertLayer, ...]
    slots: Mapping[int, int] = field(default_factory=dict)
    pinned: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    preload: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # what the refillable slots start with

    @property
    def expert_bytes(self) -> int:
        """bytes of all routed experts in the file"""
        return sum(L.n_expert * L.expert_bytes for L in self.layers)

    @property
    def slot_bytes(self) -> int:
        return sum(self.slots[L.block] * L.expert_bytes for L in self.layers)

    @property
    def resident_bytes(self) -> int:
        """what the weights hold in RAM: at most the budget"""
        return self.fixed_bytes + self.slot_bytes + self.extra_bytes

    @property
    def on_disk(self) -> bool:
        """whether any expert is read from the file while the model runs"""
        return any(self.slots[L.block] < L.n_expert for L in self.layers)

    def summary(self) -> str:
        """One line: what stays resident and what is read from the file."""
        slots = sorted({self.slots[L.block] for L in self.layers})
        n_exp = sorted({L.n_expert for L in self.layers})
        pinned = sum(len(p) for p in self.pinned.values())
        return (f"ram budget {_size(self.budget)}: {_size(self.resident_bytes)} resident ({_size(self.fixed_bytes)} "
                f"dense, attention, GDN, shared experts, embeddings and head; {_size(self.slot_bytes)} in "
                f"{'/'.join(map(str, slots))} of {'/'.join(map(str, n_exp))} expert slots per layer, {pinned} "
                f"pinned); {_size(self.expert_bytes - self.slot_bytes)} of routed experts read from the file when "
                "selected")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def plan_ram(budget: int, fixed_bytes: int, layers: Sequence[ExpertLayer], n_used: int,
             counts: Mapping[tuple[int, int], int] | None = None, extra_bytes: int = 0,
             dynamic_share: float = DYNAMIC_SHARE) -> RamPlan:
    """Slots per layer under `budget` bytes: the same number in every layer (as many as fit after `fixed_bytes`
    and `extra_bytes`, at most E), the bytes left over giving one more slot to the first layers they cover. Every
    layer needs n_used refillable slots (one token's experts); fewer raises RamBudgetError with the least budget
    that fits. Of each layer's slots, max(n_used, dynamic_share of them) are refillable, the rest pin the experts
    `counts` ranks first; the refillable ones start with the next ranked (`preload`: the cache is full from the
    first token, as the budget allows). A budget that holds every expert pins them all (nothing is read while
    running)."""
    budget, fixed_bytes, extra_bytes, n_used = int(budget), int(fixed_bytes), int(extra_bytes), int(n_used)
    if budget <= 0:
        raise RamBudgetError(f"ram budget must be more than 0 bytes, got {budget}")
    if not 0.0 <= dynamic_share <= 1.0:
        raise ValueError(f"dynamic_share must be in [0, 1], got {dynamic_share}")
    layers = tuple(layers)
    per_slot = sum(L.expert_bytes for L in layers)
    need = fixed_bytes + extra_bytes + n_used * per_slot
    if budget < need:
        raise RamBudgetError(
            f"ram budget {budget} B ({_size(budget)}) is too small: the resident weights take "
            f"{fixed_bytes} B, the expert readers' buffers {extra_bytes} B, and one token's {n_used} experts in each "
            f"of {len(layers)} layers {n_used * per_slot} B; at least {need} B ({_size(need)}) is "
            "needed", needed=need)
    free = budget - fixed_bytes - extra_bytes
    full = {L.block: L.n_expert for L in layers}
    if free >= sum(L.n_expert * L.expert_bytes for L in layers):
        return RamPlan(budget, fixed_bytes, 0, layers, full, {L.block: tuple(range(L.n_expert)) for L in layers},
                       {L.block: () for L in layers})
    s = min(max(L.n_expert for L in layers), free // per_slot) if per_slot else 0
    slots = {L.block: min(s, L.n_expert) for L in layers}
    left = free - sum(slots[L.block] * L.expert_bytes for L in layers)
    for L in layers:  # the bytes a whole round cannot use: one more slot each while they last
        if slots[L.block] < L.n_expert and left >= L.expert_bytes:
            slots[L.block] += 1
            left -= L.expert_bytes
    pinned, preload = {}, {}
    for L in layers:
        n = slots[L.block]
        dyn = min(n, max(n_used, math.ceil(n * dynamic_share)))
        rank = rank_experts(counts, L.block, L.n_expert)
        pinned[L.block] = tuple(sorted(rank[: n - dyn]))
        preload[L.block] = tuple(rank[n - dyn : n])
        if n >= L.n_expert:
            pinned[L.block], preload[L.block] = tuple(range(L.n_expert)), ()
    return RamPlan(budget, fixed_bytes, extra_bytes, layers, slots, pinned, preload)


def rank_experts(counts: Mapping[tuple[int, int], int] | None, block: int, n_expert: int) -> list[int]:
    """Block `block`'s experts, most used first (ties: the lower id), as the GPU placement ranks its pins."""
    c = counts or {}
    return sorted(range(n_expert), key=lambda e: (-c.get((block, e), 0), e))


def victims(occupants: Sequence[int], counts: Sequence[int], last_use: Sequence[int], locked, n: int,
            first: int = 0) -> list[int]:
    """The n slots a frequency-weighted cache refills: among slots first.. (the ones before are pinned) not in
    `locked` (holding or loading experts the current step needs), empty ones first, then the expert with the
    fewest uses (counts[expert], decayed), the least recently used among equals (last_use[slot]). Fewer than n
    free slots raises ValueError (the caller sized the step to fit)."""
    cand = [s for s in range(first, len(occupants)) if s not in locked]
    if len(cand) < n:
        raise ValueError(f"{n} slots wanted, {len(cand)} free")

    def score(s):
        e = occupants[s]
        return (-1, 0, s) if e < 0 else (int(counts[e]), int(last_use[s]), s)

    return sorted(cand, key=score)[:n]


def halvings(uses_before: int, uses_after: int, every: int) -> int:
    """How many times a layer's usage counts halve as its routed uses go from uses_before to uses_after: once every
    `every` uses, so that what was popular long ago fades (a frequency-weighted cache, not a lifetime LFU)."""
    if every <= 0:
        return 0
    return int(uses_after) // every - int(uses_before) // every


def prefetch_plan(last: Sequence[Sequence[int] | None], layer: int, depth: int, present, limit: int) -> list:
    """(layer, expert) pairs to read ahead while layer `layer` runs: the experts the previous step routed to in the
    next `depth` layers (`last[j]`, None: not run yet) that are not already held or loading (present(j, e) False),
    nearest layer first, at most `limit` per layer."""
    out = []
    for j in range(layer + 1, min(len(last), layer + 1 + max(0, int(depth)))):
        if last[j] is None:
            continue
        want = [int(e) for e in dict.fromkeys(last[j]) if not present(j, int(e))]
        out.extend((j, e) for e in want[: max(0, int(limit))])
    return out


def expert_chunks(experts: Sequence[int], pinned, size: int) -> list[list[int]]:
    """A step's experts (in the order they should run) cut into chunks of at most `size` that need a slot (a
    layer's refillable slots, or half of them so that the next chunk reads while this one computes); the pinned
    ones, which need none, go with the first chunk. Each selected expert is read at most once a step."""
    size = max(1, int(size))
    need = [int(e) for e in experts if int(e) not in pinned]
    chunks = [need[i : i + size] for i in range(0, len(need), size)] or [[]]
    chunks[0] = chunks[0] + [int(e) for e in experts if int(e) in pinned]
    return chunks

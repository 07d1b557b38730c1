"""How a RAM budget is split between GPU prefill and CPU decode (backend "gpu" or "auto" with `ram_budget`): pure
functions, no card.

Both sides hold weights in host RAM: the CPU backend its copy (cpu/expert_plan.plan_ram: every tensor but the routed
experts, plus expert slots), and the GPU streamer page-locked copies of what it uploads each pass. The two cannot share
bytes: the CPU's copy is repacked for its kernels and its expert slots change as decode routes, while the card takes
the file's bytes. So the budget is split, and the total host RAM of the weights (CPU copy + GPU copies + staging +
readers' buffers) stays within it:

1. The GPU side first takes the least it runs with (`GpuHost.least`): page-locked copies of the streamed tensors that
   are not routed experts (attention, GDN, shared experts, the head where the card does not keep them), two staging
   buffers of the largest layer's cold experts (gpu/disk_stage.py), and with O_DIRECT its readers' buffers. Its
   routed experts the card does not pin are read from the file on every pass.
2. The CPU plans under what is left (`cpu_share`): decode reads experts one token at a time, where a miss costs a
   whole read's latency, while a prompt pass reads a layer's experts in bulk while the card computes, so the CPU's
   expert slots come first. Too little for the CPU is refused with the budget that would do (`refuse`).
3. What the CPU leaves (it holds every expert and less than its share was used) keeps whole layers' cold experts in
   page-locked copies again (`split_ram`), first layers first (a pass's first read has nothing to overlap with); when
   every layer fits, nothing is read and the staging and readers go.

Several cards (`devices=[...]`, either split mode): each card's streamer is a GpuHost of its own (its staging buffers
and readers' buffers are its own), the CPU plans under the budget less all their leasts, and `split_cards` keeps
whole layers' cold experts on the cards in the order a pass reads them (first layers first, card by card within a
layer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import RamBudgetError


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class GpuHost:
    """The GPU streamer's host bytes: `dense` (page-locked copies of streamed tensors that are not routed experts),
    per streamed layer the bytes of its routed experts the card does not pin (`layers`), and the readers' buffers
    (`bounce`, O_DIRECT only)."""

    dense: int
    layers: Mapping[int, int] = field(default_factory=dict)
    bounce: int = 0

    @property
    def staging(self) -> int:
        """both staging buffers: two of the largest layer's cold experts"""
        return 2 * max(self.layers.values(), default=0)

    @property
    def least(self) -> int:
        """with every layer's cold experts read from the file, or held when that takes less (a small model's
        experts can weigh less than the staging and O_DIRECT readers' buffers reading them would)"""
        return self.dense + min(self.staging + self.bounce, sum(self.layers.values())) if self.layers else self.dense

    @property
    def full(self) -> int:
        """with page-locked copies of everything streamed (nothing read)"""
        return self.dense + sum(self.layers.values())


@dataclass(frozen=True)
class RamSplit:
    """The split: `cpu_bytes` (what the CPU backend's plan keeps), the GPU's host bytes, the layers whose cold
    experts keep page-locked copies (`held`) and those read from the file on every pass (`disk`)."""

    budget: int
    cpu_bytes: int
    gpu: GpuHost
    held: tuple[int, ...]
    disk: tuple[int, ...]

    @property
    def gpu_bytes(self) -> int:
        g = self.gpu
        return g.dense + sum(g.layers[i] for i in self.held) + (
            2 * max(g.layers[i] for i in self.disk) + g.bounce if self.disk else 0)

    @property
    def total(self) -> int:
        return self.cpu_bytes + self.gpu_bytes

    @property
    def read_per_pass(self) -> int:
        """bytes each prompt pass reads from the file"""
        return sum(self.gpu.layers[i] for i in self.disk)

    def part(self) -> str:
        """the GPU side's bytes, as summary() says them"""
        g = self.gpu
        held = sum(g.layers[i] for i in self.held)
        return (f"{_size(self.gpu_bytes)} ({_size(g.dense)} page-locked streamed tensors, {_size(held)} cold experts "
                f"of {len(self.held)} layers kept, {_size(self.gpu_bytes - g.dense - held)} staging and readers)")

    def summary(self) -> str:
        return (f"ram budget {_size(self.budget)} split: cpu decode {_size(self.cpu_bytes)}, gpu prefill "
                f"{self.part()}; {_size(self.read_per_pass)} of routed experts in {len(self.disk)} layers read from "
                "the file each prompt pass")


@dataclass(frozen=True)
class CardsSplit:
    """The split with several cards: `cpu_bytes` and each card's part (`cards`: a RamSplit of that card's GpuHost
    whose cpu_bytes is 0); `held` and `disk` are per card."""

    budget: int
    cpu_bytes: int
    cards: tuple[RamSplit, ...]

    @property
    def held(self) -> tuple[tuple[int, ...], ...]:
        return tuple(c.held for c in self.cards)

    @property
    def disk(self) -> tuple[tuple[int, ...], ...]:
        return tuple(c.disk for c in self.cards)

    @property
    def gpu_bytes(self) -> int:
        return sum(c.gpu_bytes for c in self.cards)

    @property
    def total(self) -> int:
        return self.cpu_bytes + self.gpu_bytes

    @property
    def read_per_pass(self) -> int:
        """bytes each prompt pass reads from the file, over all cards"""
        return sum(c.read_per_pass for c in self.cards)

    def summary(self) -> str:
        parts = "; ".join(f"card {k} {c.part()}" for k, c in enumerate(self.cards))
        return (f"ram budget {_size(self.budget)} split: cpu decode {_size(self.cpu_bytes)}, gpu prefill on "
                f"{len(self.cards)} cards {_size(self.gpu_bytes)} ({parts}); {_size(self.read_per_pass)} of routed "
                f"experts in {sum(len(d) for d in self.disk)} card layers read from the file each prompt pass")


def _cards(gpu: GpuHost | Sequence[GpuHost]) -> tuple[GpuHost, ...]:
    return (gpu,) if isinstance(gpu, GpuHost) else tuple(gpu)


def least_of(gpu: GpuHost | Sequence[GpuHost]) -> int:
    """The GPU side's least: one card's, or the sum of several cards' (each streams through its own buffers)."""
    return sum(g.least for g in _cards(gpu))


def cpu_share(budget: int, gpu: GpuHost | Sequence[GpuHost]) -> int:
    """What the CPU backend plans under: the budget less the GPU side's least (every card's; at least 1 byte, so that
    a budget too small for both gets the CPU plan's refusal with its least, which `refuse` adds the GPU's to)."""
    return max(1, int(budget) - least_of(gpu))


def refuse(err: RamBudgetError, budget: int, gpu: GpuHost | Sequence[GpuHost]) -> RamBudgetError:
    """The CPU plan's refusal under cpu_share(budget): the same, in terms of the whole budget."""
    cards = _cards(gpu)
    least = least_of(cards)
    need = err.needed + least
    where = "" if isinstance(gpu, GpuHost) else \
        f" over {len(cards)} cards ({' + '.join(f'{g.least} B' for g in cards)}: each card's own staging)"
    return RamBudgetError(f"ram budget {budget} B ({_size(budget)}) is too small for GPU prefill and CPU decode: GPU "
                          f"prefill takes {least} B ({_size(least)}) of page-locked host memory{where} and the CPU "
                          f"backend at least {err.needed} B; at least {need} B ({_size(need)}) is needed", needed=need)


def split_ram(budget: int, gpu: GpuHost, cpu_bytes: int) -> RamSplit:
    """The split once the CPU has planned under cpu_share(budget) and keeps `cpu_bytes`: the GPU keeps page-locked
    copies of every layer's cold experts if they fit beside it (nothing read), else of the first layers that fit
    beside the staging and readers, and reads the rest."""
    c = split_cards(budget, [gpu], cpu_bytes).cards[0]
    return RamSplit(int(budget), int(cpu_bytes), gpu, c.held, c.disk)


def split_cards(budget: int, gpus: Sequence[GpuHost], cpu_bytes: int) -> CardsSplit:
    """split_ram over several cards' streamers: every card's cold experts held if they all fit beside the CPU's
    `cpu_bytes`, else each card's least kept (a card whose experts weigh less than its staging holds them all) and
    whole layers held in the order a pass reads them, first layers first, card by card within a layer, while they
    fit; the rest read. The total is at most the budget whenever cpu_bytes is at most cpu_share(budget, gpus)."""
    budget, cpu_bytes, gpus = int(budget), int(cpu_bytes), tuple(gpus)
    room = budget - cpu_bytes - sum(g.dense for g in gpus)
    if room >= sum(sum(g.layers.values()) for g in gpus):
        held = [sorted(g.layers) for g in gpus]
    else:
        whole = [g.least == g.full for g in gpus]  # held rather than staged (GpuHost.least)
        room -= sum(g.least - g.dense for g in gpus)
        held = [sorted(g.layers) if w else [] for g, w in zip(gpus, whole, strict=True)]
        for i, k in sorted((i, k) for k, g in enumerate(gpus) if not whole[k] for i in g.layers):
            if gpus[k].layers[i] > room:
                break
            held[k].append(i)
            room -= gpus[k].layers[i]
    out = CardsSplit(budget, cpu_bytes, tuple(RamSplit(budget, 0, g, tuple(h), tuple(i for i in sorted(g.layers)
                                                                                     if i not in h))
                                              for g, h in zip(gpus, held, strict=True)))
    if out.total > budget:
        raise RamBudgetError(f"ram budget {budget} B: the CPU backend keeps {cpu_bytes} B beside GPU prefill's "
                             f"{out.gpu_bytes} B", needed=out.total)
    return out

"""`hybridinfer plan --cards`: a model's prefill split over several cards (gpu/multi_card.py) against one card
(card_plan.plan_for_card): each card's layers, placement and seconds, and the predicted time of each prompt. Reads
only the model's layout: no weights, no GPU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..backends.gpu import expert_card, multi_card
from ..backends.gpu.placement import weights_of
from ..backends.gpu.work import prefill_work
from ..errors import ParameterError
from .card_plan import CONTEXT_RESERVE, PROMPTS, CardPlan, card_reserve, find_card, plan_for_card


@dataclass
class CardsPlan:
    model: str
    one: CardPlan  # the first card alone
    splits: list[multi_card.MultiPlan]  # one a prompt length
    experts: list | None = None  # the expert split's expert_card.ExpertPlan a prompt length (None: a dense model)
    expert_note: str = ""  # why there is no expert split (a card's budget cannot hold its share)

    def choice(self, j: int) -> str:
        """The split the automatic choice takes for prompt j (multi_gpu.choose_split's rule)."""
        if not self.experts:
            return "layer"
        return expert_card.choose(self.splits[j].seconds, self.experts[j].seconds)


def card_list(cards: str, card: str | None) -> list[str]:
    """--cards N (N of --card) or --cards NAME,NAME,... as card names."""
    text = str(cards).strip()
    if text.isdigit():
        if card is None:
            raise ParameterError(f"--cards {text}: give --card, the card to take {text} of")
        if int(text) < 1:
            raise ParameterError(f"--cards must be at least 1, got {text}")
        return [card] * int(text)
    names = [x.strip() for x in text.split(",")]
    if not all(names):
        raise ParameterError(f"--cards must be a count or comma-separated card names, got {cards!r}")
    for n in names:
        find_card(n)
    return names


def budgets_for(names: Sequence[str], vram_budget) -> list[int]:
    """Each card's budget: one for all (an int), one a card (a sequence), or None (its memory less the context's)."""
    cs = [find_card(n) for n in names]
    if vram_budget is None:
        return [c.vram - CONTEXT_RESERVE for c in cs]
    got = [vram_budget] * len(cs) if isinstance(vram_budget, int) else list(vram_budget)
    if len(got) != len(cs):
        raise ParameterError(f"{len(got)} VRAM budgets for {len(cs)} cards: give one for all or one a card")
    for k, (c, b) in enumerate(zip(cs, got, strict=True)):
        if not isinstance(b, int) or b <= 0:
            raise ParameterError(f"--vram-budget of card {k} ({c.name}) must be a positive number of bytes, got {b!r}")
        if b > c.vram:
            raise ParameterError(f"--vram-budget {b / 2**30:.2f} GiB of card {k} ({c.name}) exceeds its "
                                 f"{c.vram / 2**30:.2f} GiB")
    return got


def plan_cards(gm, args, names: Sequence[str], vram_budget=None, prompts=PROMPTS, chunk: int | None = None,
               micro_batches: int | None = None) -> CardsPlan:
    """The split of `gm` over cards `names` (pipeline order) for each prompt length, and the first card alone.
    vram_budget: one for all, one a card, or None (each card's memory less CONTEXT_RESERVE)."""
    from ..backends.gpu.backend import DEFAULT_CHUNK

    names = list(names)
    if not names:
        raise ParameterError("no cards to plan for")
    budgets = budgets_for(names, vram_budget)
    prompts = tuple(prompts)
    one = plan_for_card(gm, args, names[0], vram_budget=budgets[0], prompts=prompts, chunk=chunk)
    chunk = DEFAULT_CHUNK if chunk is None else int(chunk)
    ws = weights_of(gm, args, matrices_only=True)
    n_ctx = max(prompts)
    slots = [multi_card.slot(n, b, card_reserve(gm, args, ws, b, chunk, n_ctx), k)
             for k, (n, b) in enumerate(zip(names, budgets, strict=True))]
    splits = []
    for T in prompts:
        w = prefill_work(gm, args, T)
        flops = [w.by_layer.get(i, 0.0) for i in range(args.n_layer + 1)]
        splits.append(multi_card.split_cards(ws, flops, slots, T, 4 * args.n_embd, micro_batches))
    experts, note = None, ""
    if getattr(args, "is_moe", False):
        try:
            experts = expert_card.plan_experts(gm, args, ws, [expert_card.with_link(s, args, chunk) for s in slots],
                                               prompts)
        except multi_card.CardBudgetError as e:
            note = str(e)
    return CardsPlan(gm.path, one, splits, experts, note)


def format_cards(pl: CardsPlan) -> str:
    G = 2**30
    out = [f"model:      {pl.model}", f"cards:      {len(pl.splits[0].shares)}; layer split: in pipeline order, the "
           "hidden rows cross between cards through pinned host memory once a micro-batch", ""]
    for j, (sp, one) in enumerate(zip(pl.splits, pl.one.prefill, strict=True)):
        out.append(f"prompt of {sp.tokens} tokens, split mode layer in {sp.micro_batches} micro-batch(es): "
                   f"{sp.seconds:.2f} s "
                   f"({sp.tok_s:.0f} tok/s); {pl.one.card.name} alone {one.seconds:.2f} s "
                   f"({one.seconds / sp.seconds:.2f}x)")
        out += ["", "| card | layers | budget GiB | resident GiB | streamed GiB | compute s | transfer s | "
                    "hand-off s | stage s |", "|---|---|---|---|---|---|---|---|---|"]
        for sh in sp.shares:
            p = sh.placement
            last = f"{sh.end - 1}" + (" (head)" if sh is sp.shares[-1] else "")
            out.append(f"| {sh.slot.label} | {sh.first}..{last} | {sh.slot.vram_budget / G:.2f} | "
                       f"{p.resident_bytes / G:.2f} | {sh.stream_bytes / G:.2f} | {sh.compute_s:.2f} | "
                       f"{sh.transfer_s * sp.micro_batches:.2f} | {sh.handoff_s:.2f} | {sh.stage_s:.2f} |")
        out.append("")
        if pl.experts:
            out += _expert_lines(pl.experts[j], one.seconds, pl.one.card.name)
        out += [f"split mode (auto): {pl.choice(j)}", ""]
    if pl.expert_note:
        out += [f"no expert split: {pl.expert_note}", ""]
    out.append("layer split, transfer s: the card's streamed weights once a micro-batch, over the whole prompt")
    if pl.experts:
        out.append("expert split: every card runs every layer on every row, the routed experts shared out; exchange s: "
                   "the partial sums down and the others' up over the card's bus, once a MoE layer (the up half in "
                   "transfer s too: it shares the bus with the weights)")
    return "\n".join(out)


def _expert_lines(ep, one_s: float, one_name: str) -> list[str]:
    G = 2**30
    out = [f"split mode expert: {ep.seconds:.2f} s ({ep.tok_s:.0f} tok/s); {one_name} alone {one_s:.2f} s "
           f"({one_s / ep.seconds:.2f}x)", "",
           "| card | experts | budget GiB | resident GiB | streamed GiB | compute s | transfer s | exchange s |",
           "|---|---|---|---|---|---|---|---|"]
    for sh in ep.shares:
        p = sh.placement
        out.append(f"| {sh.slot.label} | {sh.experts[0]}..{sh.experts[1] - 1} | {sh.slot.vram_budget / G:.2f} | "
                   f"{p.resident_bytes / G:.2f} | {sh.stream_bytes / G:.2f} | {sh.compute_s:.2f} | "
                   f"{sh.transfer_s:.2f} | {sh.exchange_s:.2f} |")
    return out + [""]

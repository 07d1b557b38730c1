"""`hybridinfer plan`: what a named card would do with a model: the placement under its VRAM (resident,
streamed, pinned experts), predicted prefill times and CPU decode time per token (gpu/timemodel.py), from the
card table (gpu/cards.py), the engine's own count of FLOPs and streamed bytes (gpu/work.py, Placement) and the
calibrated efficiencies (gpu/calibration.py). Reads only the model's layout (a GGUF file's header, or a
ShapeModel): no weights, no GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..backends.gpu import calibration, cards, timemodel
from ..backends.gpu.backend import _check_supported
from ..backends.gpu.placement import BudgetError, Placement, is_vector, plan_placement, weights_of
from ..backends.gpu.work import prefill_work
from ..errors import ParameterError

CONTEXT_RESERVE = 512 << 20  # the default budget leaves this much of the card to the CUDA context (as GPUModel)
PROMPTS = (128, 947, 4096)


@dataclass(frozen=True)
class PrefillPrediction:
    tokens: int
    flops: float
    stream_bytes: int
    compute_s: float  # all layers' compute, no overlap
    transfer_s: float  # all layers' uploads, no overlap
    seconds: float  # the double-buffered schedule

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else math.inf

    @property
    def bound(self) -> str:
        return "transfer" if self.transfer_s > self.compute_s else "compute"


@dataclass
class CardPlan:
    model: str
    card: cards.Card
    vram_budget: int
    n_ctx: int
    chunk: int
    placement: Placement
    weight_bytes: int  # matrices the GPU path places (the embedding stays on the host)
    expert_slabs: int
    pinned_slabs: int
    eff: calibration.Efficiency
    prefill: list[PrefillPrediction] = field(default_factory=list)
    decode_bytes: int = 0
    host_bw: float | None = None
    decode_eff: float = 0.0
    decode_source: str = ""

    @property
    def decode_s(self) -> float | None:
        return None if self.host_bw is None else timemodel.decode_seconds(self.decode_bytes, self.host_bw,
                                                                          self.decode_eff)


def find_card(name: str) -> cards.Card:
    try:
        return cards.card(str(name))
    except ValueError as e:
        raise ParameterError(f"--card: {e}") from None


def vector_bytes(gm, args) -> int:
    """Bytes of the float32 vectors GPUModel keeps on the card (norms, conv kernels, ssm_a, dt bias)."""
    return sum(4 * math.prod(t.ne) for n, t in gm.tensors.items() if is_vector(n, t)
               and not (n.startswith("blk.") and int(n.split(".")[1]) >= args.n_layer))


def plan_for_card(gm, args, card_name: str, vram_budget: int | None = None, host_bw: float | None = None,
                  prompts=PROMPTS, chunk: int | None = None, eff: calibration.Efficiency | None = None,
                  decode_eff: float | None = None) -> CardPlan:
    """The plan of `gm` (a GGUFModel or ShapeModel; args = model_args(gm)) on card `card_name` under
    `vram_budget` bytes (None: the card's memory less CONTEXT_RESERVE), for prompts of `prompts` tokens
    (n_ctx: the longest), decode at `host_bw` bytes/s (None: no decode figure)."""
    from ..backends.gpu.backend import DEFAULT_CHUNK, Buffers
    from .benchmarks.decode import bytes_per_token

    c = find_card(card_name)
    prompts = tuple(prompts)
    if not prompts or any(not isinstance(t, int) or t < 1 for t in prompts):
        raise ParameterError(f"prompt lengths must be positive token counts, got {prompts!r}")
    if vram_budget is None:
        vram_budget = c.vram - CONTEXT_RESERVE
    elif not isinstance(vram_budget, int) or vram_budget <= 0:
        raise ParameterError(f"--vram-budget must be a positive number of bytes, got {vram_budget!r}")
    elif vram_budget > c.vram:
        raise ParameterError(f"--vram-budget {vram_budget / 2**30:.2f} GiB exceeds the {c.vram / 2**30:.2f} GiB "
                             f"of {c.name}")
    if host_bw is not None and not (isinstance(host_bw, (int, float)) and math.isfinite(host_bw) and host_bw > 0):
        raise ParameterError(f"--host-bw must be a positive rate, got {host_bw!r}")
    chunk = DEFAULT_CHUNK if chunk is None else int(chunk)
    n_ctx = max(prompts)
    eff = eff or calibration.efficiency_for(c.limits)
    d_eff, d_src = (decode_eff, "given") if decode_eff is not None else calibration.DECODE
    ws = weights_of(gm, args, matrices_only=True)
    _check_supported(gm, args, ws)  # the GPU kernels' weight types, as GPUModel checks them
    reserved = Buffers.nbytes(args, chunk, n_ctx) + vector_bytes(gm, args)
    try:
        p = plan_placement(ws, vram_budget, reserved)
    except BudgetError as e:
        raise ParameterError(f"--vram-budget {vram_budget / 2**30:.2f} GiB on {c.name}: {e}") from None
    byname = {w.name: w for w in ws}
    placed = [w for w in ws if w.name in p.resident or w.name in p.pinned_experts
              or any(w.name in names for names in p.streamed.values())]
    slabs = sum(w.n_expert for w in placed if w.n_expert)
    pinned = sum(len(v) for v in p.pinned_experts.values()) + sum(
        byname[n].n_expert for n in p.resident if byname[n].n_expert)
    plan = CardPlan(gm.path, c, vram_budget, n_ctx, chunk, p, sum(w.nbytes for w in placed), slabs, pinned, eff,
                    decode_bytes=bytes_per_token(gm, args), host_bw=host_bw, decode_eff=d_eff, decode_source=d_src)
    layers = list(range(args.n_layer + 1))  # the head is planned as layer n_layer
    by_bytes = [p.layer_stream_bytes(byname, i) for i in layers]
    for T in prompts:
        w = prefill_work(gm, args, T)
        comp, tr = timemodel.layer_times([w.by_layer.get(i, 0.0) for i in layers], by_bytes, c.fp32_flops,
                                         c.bus_bw, eff.compute, eff.bus)
        plan.prefill.append(PrefillPrediction(T, w.flops, p.stream_bytes_per_pass, sum(comp), sum(tr),
                                              timemodel.pipeline_seconds(comp, tr)))
    return plan


def format_plan(pl: CardPlan) -> str:
    c, p, G = pl.card, pl.placement, 2**30
    lim = c.limits
    out = [f"model:      {pl.model}",
           f"card:       {c.name} ({c.chip}, {lim.sm}, {c.card_class}): {c.fp32_flops / 1e12:.2f} TFLOP/s fp32, "
           f"{c.mem_bw / 1e9:.0f} GB/s memory, {c.vram / G:.2f} GiB, bus {c.bus_bw / 1e9:.1f} GB/s",
           f"budget:     {pl.vram_budget / G:.2f} GiB of VRAM; n_ctx {pl.n_ctx}, {pl.chunk} tokens per kernel call",
           f"placement:  {p.resident_bytes / G:.2f} GiB resident, {p.staging_bytes / G:.2f} GiB double staging, "
           f"{p.reserved_bytes / G:.2f} GiB activations, state and vectors; {p.stream_bytes_per_pass / G:.2f} GiB "
           f"streamed per pass, of {pl.weight_bytes / G:.2f} GiB of weights; {len(p.streamed)} layers stream "
           "(the head counts as one)"]
    if pl.expert_slabs:
        out.append(f"experts:    {pl.pinned_slabs} of {pl.expert_slabs} expert slabs pinned on the card "
                   "(gate, up and down of each layer's experts, in layer order until prompts are seen)")
    out.append(f"efficiency: compute {pl.eff.compute:.2f} of fp32 peak, bus {pl.eff.bus:.2f} of the bus rate: "
               f"{pl.eff.source}")
    out += ["", "| prompt tokens | GFLOP | compute s | transfer s | predicted s | tok/s | bound by |",
            "|---|---|---|---|---|---|---|"]
    for r in pl.prefill:
        out.append(f"| {r.tokens} | {r.flops / 1e9:.0f} | {r.compute_s:.2f} | {r.transfer_s:.2f} | {r.seconds:.2f} | "
                   f"{r.tok_s:.0f} | {r.bound} |")
    out.append("")
    dec = f"decode:     {pl.decode_bytes / 1e9:.3f} GB of weights per token"
    if pl.host_bw is None:
        out.append(dec + " (give --host-bw for a time)")
    else:
        s = pl.decode_s
        out.append(dec + f" at {pl.host_bw / 1e9:.1f} GB/s x {pl.decode_eff:.2f} ({pl.decode_source}): "
                   f"{s * 1e3:.0f} ms per token ({1 / s:.1f} tok/s)")
    return "\n".join(out)

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
    kv: KVPlan | None = None

    @property
    def decode_s(self) -> float | None:
        return None if self.host_bw is None else timemodel.decode_seconds(self.decode_bytes, self.host_bw,
                                                                          self.decode_eff)


@dataclass(frozen=True)
class KVPlan:
    """Where a sequence's state lives and how long a prompt it allows. Host: every sequence's state, its K/V in the
    cache types (what CPU decode reads); card: a GPU prefill pass's copy, the K/V and hidden rows of each of its
    positions as GPUModel's Buffers hold them."""

    types: tuple[str, str]  # (K, V) cache types
    attention_layers: int  # layers keeping per-token rows
    host_per_token: int  # K/V bytes a token in the host state
    recurrent_bytes: int  # recurrent (GDN conv and S) bytes a sequence
    card_kv_per_token: int  # K/V bytes a token of a GPU pass on the card
    card_per_token: int  # all the pass's per-token bytes on the card (K/V and hidden rows)
    trained: int  # the model's trained context
    longest_pass: int  # most tokens a pass fits in the VRAM budget beside the least weight staging
    ram_bytes: int | None = None  # host memory counted for states (None: not given)
    model_bytes: int = 0  # the weights, which take host memory beside the states
    longest_host: int | None = None  # most tokens one sequence's state fits in ram_bytes beside the weights
    card_stream_per_token: int = 0  # a pass's per-token bytes on the card when its K/V stream (one layer's at a time)
    longest_stream: int = 0  # most tokens a pass fits so, its K/V in host memory and streamed per attention layer


def kv_plan(gm, args, vram_budget: int, chunk: int, ram_bytes: int | None = None) -> KVPlan:
    """KVPlan of `gm` (args in the cache types: state_kinds.with_cache_types) under `vram_budget` bytes of VRAM
    (GPU passes of `chunk` tokens a kernel call) and `ram_bytes` of host memory (None: no host figure)."""
    from ..backends.gpu.backend import Buffers, pass_tokens_fitting, plan_pass
    from ..engine.context import longest_fitting
    from ..models.state_kinds import ARRAYS, cache_types, layer_arrays, state_bytes

    per_token = [(i, s) for i, s in layer_arrays(args.layer_types) if s.per_token]
    host = sum(s.nbytes(args, 1) for _, s in per_token)
    recurrent = state_bytes(args, 0)
    card = Buffers.layout(args, chunk, 1)
    card_kv = sum(math.prod(shape) * dt.itemsize for key, (shape, dt) in card.items()
                  if isinstance(key, tuple) and key[0] == "state" and ARRAYS[key[1][0]].per_token)
    ws = weights_of(gm, args, matrices_only=True)
    model = sum(w.nbytes for w in weights_of(gm, args))
    longest_host = None if ram_bytes is None else longest_fitting(recurrent, host, ram_bytes - model)
    room = vram_budget - vector_bytes(gm, args)
    return KVPlan(cache_types(args), len({i for i, _ in per_token}), host, recurrent, card_kv,
                  Buffers.nbytes(args, chunk, 1) - Buffers.nbytes(args, chunk, 0), int(args.context_length),
                  pass_tokens_fitting(args, chunk, room, ws), ram_bytes, model, longest_host,
                  card_stream_per_token=Buffers.nbytes(args, chunk, 1, True, 0) - Buffers.nbytes(args, chunk, 0, True,
                                                                                                0),
                  longest_stream=plan_pass(args, chunk, room, ws, 1 << 30, fit=True).n_ctx)


def format_kv(kv: KVPlan, vram_budget: int) -> list[str]:
    from ..engine.context import size_text

    k, v = kv.types
    out = [f"K/V:        {k} K, {v} V: {size_text(kv.host_per_token)} a token over {kv.attention_layers} attention "
           f"layers, and {size_text(kv.recurrent_bytes)} of recurrent state a sequence, in host RAM (every "
           f"sequence's state, which CPU decode reads); a sequence of the trained {kv.trained} tokens takes "
           f"{size_text(kv.recurrent_bytes + kv.trained * kv.host_per_token)}"]
    if kv.ram_bytes is not None:
        n, room = kv.longest_host, kv.ram_bytes - kv.model_bytes
        seqs = room // (kv.recurrent_bytes + kv.trained * kv.host_per_token)
        fit = (f"{seqs} sequence(s) of the trained length (the default context with --max-seqs {seqs} or fewer)"
               if seqs else f"one sequence of at most {n} tokens" if n else "no sequence's state")
        out.append(f"host:       {size_text(kv.ram_bytes)} of RAM, less {size_text(kv.model_bytes)} of weights, hold "
                   + fit)
    n = kv.longest_pass
    out.append(f"GPU pass:   a prefill pass keeps its K/V ({size_text(kv.card_kv_per_token)} a token, as the GPU "
               f"backend holds them) and hidden rows on the card, {size_text(kv.card_per_token)} a token in all; the "
               f"{size_text(vram_budget)} "
               "VRAM budget holds " + (f"a prompt of {min(n, kv.trained)} tokens" if n else "no prompt")
               + (" (the trained length)" if n >= kv.trained else "") + " beside the least weight staging (a "
               "shorter -c leaves more of the budget to resident weights)")
    if n < kv.trained and kv.longest_stream > n:
        m = min(kv.longest_stream, kv.trained)
        out.append(f"K/V stream: a longer prompt keeps its K/V in host memory and streams each attention layer's "
                   f"through the card ({size_text(kv.card_stream_per_token)} a token of context on the card), in "
                   f"passes of {n} tokens: the budget holds a context of {m} tokens"
                   + (" (the trained length)" if m >= kv.trained else "") + " (the default context there)")
    return out


def find_card(name: str) -> cards.Card:
    try:
        return cards.card(str(name))
    except ValueError as e:
        raise ParameterError(f"--card: {e}") from None


def vector_bytes(gm, args) -> int:
    """Bytes of the float32 vectors GPUModel keeps on the card (norms, conv kernels, ssm_a, dt bias)."""
    return sum(4 * math.prod(t.ne) for n, t in gm.tensors.items() if is_vector(n, t)
               and not (n.startswith("blk.") and int(n.split(".")[1]) >= args.n_layer))


def card_reserve(gm, args, ws, vram_budget: int, chunk: int, n_ctx: int) -> int:
    """Bytes GPUModel keeps beside the weights under `vram_budget`: its float32 vectors and the larger of its pass
    layouts (backend.plan_pass) for passes up to n_ctx rows."""
    from ..backends.gpu.backend import plan_pass

    vec = vector_bytes(gm, args)
    return plan_pass(args, chunk, vram_budget - vec, ws, n_ctx).reserve(args, chunk) + vec


def plan_for_card(gm, args, card_name: str, vram_budget: int | None = None, host_bw: float | None = None,
                  prompts=PROMPTS, chunk: int | None = None, eff: calibration.Efficiency | None = None,
                  decode_eff: float | None = None, ram_bytes: int | None = None) -> CardPlan:
    """The plan of `gm` (a GGUFModel or ShapeModel; args = model_args(gm), in the K/V cache types of
    state_kinds.with_cache_types) on card `card_name` under `vram_budget` bytes (None: the card's memory less
    CONTEXT_RESERVE), for prompts of `prompts` tokens (n_ctx: the longest), decode at `host_bw` bytes/s (None: no
    decode figure), sequence states in `ram_bytes` of host memory (None: no host figure)."""
    from ..backends.gpu.backend import DEFAULT_CHUNK
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
    reserved = card_reserve(gm, args, ws, vram_budget, chunk, n_ctx)
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
                    decode_bytes=bytes_per_token(gm, args), host_bw=host_bw, decode_eff=d_eff, decode_source=d_src,
                    kv=kv_plan(gm, args, vram_budget, chunk, ram_bytes))
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
                   "(gate, up and down; until prompts are seen, expert 0 of every layer, then expert 1 ...)")
    out.append(f"efficiency: compute {pl.eff.compute:.2f} of fp32 peak, bus {pl.eff.bus:.2f} of the bus rate: "
               f"{pl.eff.source}")
    out += ["", "| prompt tokens | GFLOP | compute s | transfer s | predicted s | tok/s | bound by |",
            "|---|---|---|---|---|---|---|"]
    for r in pl.prefill:
        out.append(f"| {r.tokens} | {r.flops / 1e9:.0f} | {r.compute_s:.2f} | {r.transfer_s:.2f} | {r.seconds:.2f} | "
                   f"{r.tok_s:.0f} | {r.bound} |")
    out.append("")
    if pl.kv is not None:
        out += format_kv(pl.kv, pl.vram_budget)
    dec = f"decode:     {pl.decode_bytes / 1e9:.3f} GB of weights per token"
    if pl.host_bw is None:
        out.append(dec + " (give --host-bw for a time)")
    else:
        s = pl.decode_s
        out.append(dec + f" at {pl.host_bw / 1e9:.1f} GB/s x {pl.decode_eff:.2f} ({pl.decode_source}): "
                   f"{s * 1e3:.0f} ms per token ({1 / s:.1f} tok/s)")
    return "\n".join(out)

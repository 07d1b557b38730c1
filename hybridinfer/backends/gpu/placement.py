"""What stays resident on the card and what streams, under a VRAM budget. Pure functions, no GPU.

Budget arithmetic (every term in bytes, all counted against `vram_budget`):

    resident weights + 2 x (largest streamed set of one layer)   [double-buffered staging on the card]
    + activations (per prompt chunk) + state (K/V rows of the prompt, GDN S and conv)  <= vram_budget

Order of residency, most useful first: small tensors (norms, biases, gates: needed by every layer, costly
to stream as many tiny copies), then attention and GDN projections and dense / shared-expert FFNs (every
token uses them), then routed experts ranked by how many tokens they took in the prompts seen so far
("expert pinning"; unseen experts rank by layer order). A streamed layer uploads its non-resident tensors;
an expert tensor streams as its non-resident experts' slabs (each expert's rows are contiguous in GGUF).
The embedding stays on the host (prefill needs one row per token); the output head is planned as one more
layer after the last block (index n_layer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

SMALL_BYTES = 1 << 20  # tensors below this are "small"
STAGE_ALIGN = 256  # each tensor's offset in a staging buffer
HOST_ONLY = ("token_embd.weight",)


@dataclass(frozen=True)
class WeightInfo:
    name: str
    nbytes: int
    layer: int  # -1 for tensors outside the blocks
    n_expert: int = 0  # > 0 for routed-expert tensors [E, N, K]: nbytes = n_expert * slab
    first_expert: int = 0  # the file's expert id of expert 0 here (a card's share of an expert split: expert_card.py)

    @property
    def slab(self) -> int:
        return self.nbytes // self.n_expert if self.n_expert else self.nbytes


@dataclass
class Placement:
    vram_budget: int
    resident: set[str] = field(default_factory=set)  # whole tensors kept on the card
    pinned_experts: dict[str, set[int]] = field(default_factory=dict)  # expert tensor -> resident experts
    streamed: dict[int, list[str]] = field(default_factory=dict)  # layer -> tensors (partly) streamed
    resident_bytes: int = 0
    staging_bytes: int = 0  # both staging buffers
    reserved_bytes: int = 0  # activations + state
    stream_bytes_per_pass: int = 0  # bytes crossing the bus per prompt

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.staging_bytes + self.reserved_bytes

    def layer_stream_bytes(self, weights: Mapping[str, WeightInfo], layer: int) -> int:
        """Bytes of `layer` that cross the bus per pass."""
        return sum(streamed_bytes(weights[n], self) for n in self.streamed.get(layer, []))

    def layer_staged_bytes(self, weights: Mapping[str, WeightInfo], layer: int) -> int:
        """Bytes of one staging buffer for `layer`: every tensor not wholly resident, at full size (pinned
        experts are copied into their slot on the card, so a grouped GEMM sees one [E, N, K] tensor)."""
        return sum(staged(weights[n]) for n in self.streamed.get(layer, []) if n not in self.resident)


def staged(w: WeightInfo) -> int:
    return -(-w.nbytes // STAGE_ALIGN) * STAGE_ALIGN


def streamed_bytes(w: WeightInfo, p: Placement) -> int:
    if w.name in p.resident:
        return 0
    if w.n_expert:
        return w.slab * (w.n_expert - len(p.pinned_experts.get(w.name, ())))
    return w.nbytes


class BudgetError(ValueError):
    """The budget cannot hold even the minimum (staging for the largest layer + activations + state)."""


def plan_placement(weights: Iterable[WeightInfo], vram_budget: int, reserved: int = 0,
                   expert_counts: Mapping[tuple[int, int], int] | None = None,
                   host_only: tuple[str, ...] = HOST_ONLY) -> Placement:
    """Decide residency for `weights` under `vram_budget`, keeping `reserved` bytes (activations, state).

    expert_counts[(layer, e)]: tokens routed to expert e of layer `layer` so far (missing = 0).
    Greedy by usefulness; each candidate is accepted only if the total (resident + the double staging that
    the remaining streamed layers still need + reserved) stays within the budget.
    """
    ws = {w.name: w for w in weights if w.name not in host_only}
    counts = expert_counts or {}
    p = Placement(vram_budget, reserved_bytes=reserved)
    for w in ws.values():
        p.streamed.setdefault(w.layer, []).append(w.name)

    layer_bytes = {lay: p.layer_staged_bytes(ws, lay) for lay in p.streamed}  # kept current below

    def staging() -> int:
        return 2 * max(layer_bytes.values(), default=0)

    def move(w: WeightInfo, nbytes: int) -> None:  # nbytes of w go resident (negative: back to the stream)
        p.resident_bytes += nbytes
        if not w.n_expert or w.name in p.resident:
            layer_bytes[w.layer] -= staged(w) if nbytes > 0 else -staged(w)

    def total() -> int:
        return p.resident_bytes + staging() + reserved

    def fits(before: int) -> bool:  # within budget, or closer to it (residency can shrink the staging)
        t = total()
        return t <= vram_budget or t < before


    dense = [w for w in ws.values() if not w.n_expert]
    small = sorted((w for w in dense if w.nbytes < SMALL_BYTES), key=lambda w: (w.layer, w.name))
    big = sorted((w for w in dense if w.nbytes >= SMALL_BYTES), key=lambda w: (w.layer, w.name))
    for w in small + big:
        # a tensor leaving the stream may shrink staging, so test with the staging it would leave behind
        before = total()
        p.resident.add(w.name)
        move(w, w.nbytes)
        if not fits(before):
            p.resident.discard(w.name)
            move(w, -w.nbytes)
    # the most used first; among equal counts (a fresh model: all) expert 0 of every layer, then expert 1 ..., so every
    # layer keeps about as many on the card and streams about as many bytes: with two staging slots the bus then
    # works beside every layer's compute (pinning whole early layers first left the bus idle through them and every
    # later layer waiting on it: 1.84 -> 1.73 s predicted for the 35B-A3B's 4,096-token expert split at 5 GiB a card)
    experts = [(counts.get((w.layer, w.first_expert + e), 0), -e, -w.layer, w.name, e)
               for w in ws.values() if w.n_expert for e in range(w.n_expert)]
    experts.sort(reverse=True)
    for _, _, _, name, e in experts:
        w = ws[name]
        pin = p.pinned_experts.setdefault(name, set())
        before = total()
        pin.add(e)
        move(w, w.slab)
        if not fits(before):
            pin.discard(e)
            move(w, -w.slab)
        elif len(pin) == w.n_expert:  # the whole tensor is resident: no staging slot any more
            del p.pinned_experts[name]
            p.resident.add(name)
            layer_bytes[w.layer] -= staged(w)
    p.pinned_experts = {k: v for k, v in p.pinned_experts.items() if v}
    p.streamed = {lay: [n for n in names if streamed_bytes(ws[n], p)] for lay, names in p.streamed.items()}
    p.streamed = {lay: names for lay, names in p.streamed.items() if names}
    p.staging_bytes = 2 * max((p.layer_staged_bytes(ws, lay) for lay in p.streamed), default=0)
    p.stream_bytes_per_pass = sum(p.layer_stream_bytes(ws, lay) for lay in p.streamed)
    if p.total_bytes > vram_budget:
        largest = max(p.streamed, key=lambda lay: p.layer_stream_bytes(ws, lay))
        raise BudgetError(
            f"vram budget {vram_budget} B cannot hold the double staging of layer {largest} ({p.staging_bytes} B "
            f"for both buffers) plus {p.resident_bytes} B resident and {reserved} B of activations and state; "
            f"raise --vram-budget or use smaller prompt chunks")
    return p


def is_vector(name: str, t) -> bool:
    """Tensors the GPU backend keeps as float32 vectors, not GEMM weights: 1-D ones (norms, ssm_a, dt bias),
    one-row matrices (ffn_gate_inp_shexp, stored [D] or [D, 1]) and the conv kernels."""
    return len(t.ne) < 2 or all(int(n) == 1 for n in t.ne[1:]) or name.endswith("ssm_conv1d.weight")


def weights_of(gm, args, matrices_only: bool = False) -> list[WeightInfo]:
    """WeightInfo for every tensor of a GGUFModel (expert tensors carry their expert count). The output head
    (output.weight, or token_embd.weight when tied) is layer n_layer. matrices_only: skip what is_vector()
    names (the GPU backend keeps those as float32 vectors of its own)."""
    head = "token_embd.weight" if args.tied_output else "output.weight"
    out = []
    for name, t in gm.tensors.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if layer >= args.n_layer:
            continue  # MTP blocks: not used by prefill
        if matrices_only and is_vector(name, t):
            continue
        n_exp = int(t.ne[2]) if name.endswith("_exps.weight") and len(t.ne) == 3 else 0
        out.append(WeightInfo(name, int(t.nbytes), args.n_layer if name == head else layer, n_exp))
    return out

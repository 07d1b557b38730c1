"""A CPUModel under a RAM budget: which tensors it copies, and the expert store of the layers it reads from the file
(expert_plan.plan_ram decides, expert_store.py reads)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from ...errors import ParameterError
from .expert_plan import ExpertLayer, RamPlan, plan_ram
from .expert_store import IO_MODES, ExpertCache, ExpertReader, ExpertStore, Part, unmap  # noqa: F401 (CPUModel's)
from .weights import huge_page_buffer

EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_ALIGN = 64


@dataclass(frozen=True)
class ExpertOptions:
    """How a CPU backend under a RAM budget reads its experts (Engine.load's CPU options of the same names)."""

    ram_budget: int
    expert_io: str = "pread"  # or "direct" (O_DIRECT)
    read_timeout: float = 30.0  # seconds one step waits for its reads
    readers: int = 8  # reader threads (mostly blocked in pread: an NVMe wants several reads queued)
    prefetch_layers: int = 1  # layers read ahead from the previous step's routing
    drop_cache: bool = False  # each range read is dropped from the page cache (benchmarks)
    expert_counts: dict | None = None  # (block, expert) -> uses, as the GPU placement's: pins the most used

    @classmethod
    def of(cls, options: dict) -> ExpertOptions | None:
        """The options popped from an Engine.load options dict (None without ram_budget), checked."""
        keys = [f.name for f in cls.__dataclass_fields__.values()]
        got = {k: options.pop(k) for k in keys if k in options}
        if got.get("ram_budget") is None:
            extra = sorted(k for k in got if k != "ram_budget")
            if extra:
                raise ParameterError(f"{', '.join(extra)} only apply with ram_budget")
            return None
        o = cls(**got)
        if isinstance(o.ram_budget, bool) or not isinstance(o.ram_budget, int) or o.ram_budget <= 0:
            raise ParameterError(f"ram_budget must be a positive number of bytes, got {o.ram_budget!r}")
        if o.expert_io not in IO_MODES:
            raise ParameterError(f"expert_io must be one of {', '.join(IO_MODES)}, got {o.expert_io!r}")
        if int(o.readers) < 1:
            raise ParameterError(f"readers must be at least 1, got {o.readers!r}")
        if int(o.prefetch_layers) < 0:
            raise ParameterError(f"prefetch_layers must be 0 or more, got {o.prefetch_layers!r}")
        return o


def _part(gm, m) -> Part:
    t = gm.tensor(m.name)
    return Part(int(t.offset), int(t.nbytes) // m.n_expert, int(t.qtype))


def _expert_blocks(blocks) -> list:
    """The blocks whose routed experts are three stacked tensors: (block index, (gate, up, down) Mats)."""
    out = []
    for L in blocks:
        if all(k in L for k in EXPS):
            mats = tuple(L[k] for k in EXPS)
            if all(m.n_expert > 1 for m in mats):
                out.append((L.i, mats))
    return out


def _nbytes(v) -> int:
    raw = getattr(v, "raw", v)
    return -(-raw.nbytes // _ALIGN) * _ALIGN


def plan_model(model, blocks, opts: ExpertOptions) -> tuple[RamPlan, list]:
    """The RAM plan of a CPUModel's tensors (before any copy) and its expert blocks."""
    eb = _expert_blocks(blocks)
    exps = {id(m) for _, mats in eb for m in mats}
    fixed = _nbytes(model.out) + model.out_norm.nbytes + model.freq_factors.nbytes + int(model.tok_embd.nbytes)
    for L in blocks:
        fixed += sum(_nbytes(v) for v in L.tensors.values() if id(v) not in exps)
    layers = [ExpertLayer(i, mats[0].n_expert, sum(m.raw.nbytes // m.n_expert for m in mats)) for i, mats in eb]
    max_range = max((m.raw.nbytes // m.n_expert for _, mats in eb for m in mats), default=0)
    extra = opts.readers * (max_range + 2 * 4096) if opts.expert_io == "direct" else 0
    plan = plan_ram(opts.ram_budget, fixed, layers, model.args.n_expert_used, opts.expert_counts, extra)
    return plan, eb


def attach(model, gm, blocks, opts: ExpertOptions, owners: list, weights: str = "auto",
           replicate: bool = False) -> tuple[RamPlan, ExpertStore | None, list]:
    """Plan the budget; when experts are read from the file, make the store (pinned experts read now) and return
    the owners the weight copy should still take (every Mat but the disk-backed experts). The token embedding is
    copied into RAM too (a budget holds it; the file's pages are not relied on)."""
    if replicate or weights == "mmap":
        raise ParameterError("ram_budget keeps its resident weights in one copy: it does not go with weights='mmap' "
                             f"or numa replicate (got weights={weights!r}, replicate={replicate})")
    plan, eb = plan_model(model, blocks, opts)
    if not plan.on_disk:
        return plan, None, owners
    model.tok_embd = replace(model.tok_embd, data=np.array(model.tok_embd.raw()))
    exps = {id(m) for _, mats in eb for m in mats}
    max_range = max(m.raw.nbytes // m.n_expert for _, mats in eb for m in mats)
    reader = ExpertReader(os.fspath(gm.path), opts.expert_io, opts.readers, opts.read_timeout, opts.drop_cache,
                          max_range)
    store = ExpertStore(reader, model.simd, model.args.n_expert_used, opts.prefetch_layers)
    try:
        for i, mats in eb:
            parts = [_part(gm, m) for m in mats]
            n = plan.slots[i]
            buf = huge_page_buffer(sum(-(-p.per * n // _ALIGN) * _ALIGN for p in parts))
            c = ExpertCache(store, i, mats, parts, n, plan.pinned[i], buf, plan.preload[i])
            store.caches[id(mats[0])] = c
            if i < model.args.n_layer:
                store.order.append(c)
        for c in store.order + [c for c in store.caches.values() if c not in store.order]:
            c.ready_slots(list(c.pending))
    except BaseException:
        store.close()
        raise
    return plan, store, [(o, k) for o, k in owners if id(o[k]) not in exps]


def plan_file(gm, n_used: int, ram_budget: int, counts=None) -> RamPlan:
    """The RAM plan of a GGUF (or a ShapeModel: its tensor table alone, no weights read) under `ram_budget`, from the
    stored sizes (a loaded model's differs by its alignment padding): what `hybridinfer plan --ram-budget` shows."""
    fixed, parts = 0, {}
    for name, t in gm.tensors.items():
        short = name.split(".")[2] if name.startswith("blk.") else ""
        if short in EXPS and len(t.ne) == 3 and int(t.ne[2]) > 1:
            parts.setdefault(int(name.split(".")[1]), []).append((int(t.ne[2]), int(t.nbytes)))
        else:
            fixed += -(-int(t.nbytes) // _ALIGN) * _ALIGN
    layers = [ExpertLayer(i, ps[0][0], sum(nb // n for n, nb in ps)) for i, ps in sorted(parts.items())]
    return plan_ram(ram_budget, fixed, layers, n_used, counts)


def uniform_read_bytes(plan: RamPlan, n_used: int) -> float:
    """Expected bytes read per decode token when routing is uniform: each layer's k experts miss the slots with
    probability 1 - slots / E (a trained router is skewed, so this is the worst case a cache sees)."""
    return sum(n_used * L.expert_bytes * (1 - plan.slots[L.block] / L.n_expert) for L in plan.layers)

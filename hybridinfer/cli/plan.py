"""`hybridinfer plan`: the placement and predicted times of a model on a named card (gpu/card_plan.py)."""

from __future__ import annotations

import os

from ..errors import ParameterError
from .args import add_cache_types, add_model_source, gb_per_s, parse_size, parse_sizes, positive_ints, threads_int


def _host_bandwidth(threads: int | None) -> float:
    """This host's read bandwidth with `threads` (default all), measured as `bench decode` measures its floor."""
    from ..backends.cpu.simd import SimdLib
    from ..tools.benchmarks.decode import probe_bytes

    return SimdLib(n_threads=threads or os.cpu_count() or 1).read_bandwidth(probe_bytes())


def cmd_plan(a) -> int:
    from ..models import model_args
    from ..models.state_kinds import with_cache_types
    from ..tools.card_plan import find_card, format_plan, plan_for_card

    if a.cards is None and a.card is None:
        raise ParameterError("plan takes --card NAME (and --cards N or --cards NAME,NAME for several cards)")
    if a.card is not None:
        find_card(a.card)  # a bad name is reported before any model is read
    names = None
    if a.cards is not None:
        from ..tools.multi_plan import card_list

        names = card_list(a.cards, a.card)
    prompts = positive_ints("--prompts", a.prompts, "token counts")
    if bool(a.model) == bool(a.shape):
        raise ParameterError(f"plan takes one of -m MODEL or --shape SHAPE (got -m {a.model!r}, --shape {a.shape!r})")
    if a.shape:
        from ..tools.shape_model import ShapeModel

        gm = ShapeModel(a.arch, a.shape, a.quant)
    else:
        from ..format.gguf_model import GGUFModel

        gm = GGUFModel(a.model)
    if a.vram_budget == 0:
        raise ParameterError("--vram-budget must be more than 0 bytes, got 0")
    if isinstance(a.vram_budget, list) and names is None:
        raise ParameterError(f"--vram-budget: one size for --card (a list is one a card of --cards), got "
                             f"{len(a.vram_budget)}")
    if names is not None:  # prefill alone: no decode figure, so no bandwidth probe
        from ..tools.multi_plan import format_cards, plan_cards

        args = with_cache_types(model_args(gm), a.cache_type_k, a.cache_type_v)
        cp = plan_cards(gm, args, names, vram_budget=a.vram_budget, prompts=prompts)
        print(format_cards(cp))
        if a.ram_budget is not None and getattr(args, "is_moe", False):
            _cards_ram_lines(gm, args, cp, a.ram_budget)
        return 0
    host_bw, note = a.host_bw, ""
    if host_bw is None:
        host_bw, note = _host_bandwidth(a.threads), " (--host-bw not given: measured on this host)"
    ram = a.ram
    if ram is None:
        from ..backends.cpu.weights import mem_available

        ram = mem_available()
    args = with_cache_types(model_args(gm), a.cache_type_k, a.cache_type_v)
    pl = plan_for_card(gm, args, a.card, vram_budget=a.vram_budget, host_bw=host_bw, prompts=prompts,
                       ram_bytes=ram)
    print(format_plan(pl) + note)
    if a.ram_budget is not None and getattr(args, "is_moe", False):
        _ram_lines(gm, args, pl.placement, a.ram_budget)
    return 0


def _ram_lines(gm, args, placement, budget: int, label: str = "") -> None:
    """The RAM budget's split between the card's streamer (page-locked copies, expert staging) and the CPU backend
    (ram_split.py), as a load under it makes it, from the tensor table alone. placement: one card's, or a list of
    (placement, weight infos) a card for several (their streamers' needs split together, ram_split.split_cards)."""
    from ..backends.cpu.expert_setup import plan_file, uniform_read_bytes
    from ..backends.gpu.disk_stage import host_need, stage_plan
    from ..backends.gpu.placement import weights_of
    from ..backends.ram_split import cpu_share, refuse, split_cards, split_ram
    from ..errors import RamBudgetError

    def need_of(p, infos):
        return host_need(p, infos, stage_plan(p, infos, dict.fromkeys(infos, 0)))

    if isinstance(placement, list):
        need = tuple(need_of(p, infos) for p, infos in placement)
    else:
        need = need_of(placement, {w.name: w for w in weights_of(gm, args, matrices_only=True)})
    try:
        rp = plan_file(gm, args.n_expert_used, cpu_share(budget, need))
    except RamBudgetError as e:
        raise refuse(e, budget, need) from None
    split = (split_cards if isinstance(need, tuple) else split_ram)(budget, need, rp.resident_bytes)
    print(f"ram split{label}:  {split.summary()}")
    print(f"cpu ram{label}:    {rp.summary()}; about {uniform_read_bytes(rp, args.n_expert_used) / 1e6:.1f} MB "
          "read per decode token at uniform routing")


def _cards_ram_lines(gm, args, cp, budget: int) -> None:
    """_ram_lines for each split of `cp` (tools/multi_plan.CardsPlan): every card's streamer beside the CPU."""
    from ..backends.gpu.expert_card import own_weights
    from ..backends.gpu.placement import weights_of

    ws = weights_of(gm, args, matrices_only=True)
    every = {w.name: w for w in ws}
    _ram_lines(gm, args, [(sh.placement, every) for sh in cp.splits[-1].shares], budget, " (layer split)")
    if cp.experts:
        cards = [(sh.placement, {w.name: w for w in own_weights(ws, sh.experts, None if k == 0 else args.n_layer)})
                 for k, sh in enumerate(cp.experts[-1].shares)]
        _ram_lines(gm, args, cards, budget, " (expert split)")


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="placement and predicted prefill / decode times of a model on a named old card "
                                    "(from the file's header or a synthetic shape; no GPU, no weights read)")
    add_model_source(p, model_help="GGUF file (its header only is read)")
    p.add_argument("--shape", help="plan a synthetic shape instead of a file (e.g. 35b-a3b; see `synth`)")
    p.add_argument("--arch", default="qwen35moe", help="architecture of --shape (default qwen35moe)")
    p.add_argument("--quant", default="q4_k_m", help="quantization of --shape (default q4_k_m)")
    p.add_argument("--card", default=None, help="c2075, m2090, gtx580, gtx680, k20, k40, k80, m40, gtx980ti, p100, "
                                                 "or a class: fermi, kepler, maxwell, pascal")
    p.add_argument("--cards", default=None, metavar="N|NAME,NAME",
                   help="prefill split over several cards: N of --card, or a list of card names in pipeline order "
                        "(each with --vram-budget, or its memory less 512 MiB); shows each card's layers and the "
                        "predicted time against the first card alone")
    p.add_argument("--vram-budget", type=parse_sizes, default=None,
                   help="VRAM the engine may use, or with --cards one size a card (5GiB,11GiB) (default: the card's "
                        "memory less 512 MiB)")
    p.add_argument("--host-bw", type=gb_per_s, default=None, metavar="GB/s",
                   help="host memory read bandwidth for CPU decode (default: measured on this host)")
    p.add_argument("-t", "--threads", type=threads_int, default=None,
                   help="threads of the host bandwidth probe without --host-bw, as decode would run (default: all "
                        "cores)")
    p.add_argument("--prompts", default="128,947,4096", help="comma-separated prompt lengths to predict")
    add_cache_types(p)
    p.add_argument("--ram", type=parse_size, default=None,
                   help="host memory for the weights and sequence states, e.g. 64GiB (default: what this host has "
                        "available)")
    p.add_argument("--ram-budget", type=parse_size, default=None,
                   help="also plan GPU prefill and CPU decode under this RAM budget (its split between them, what "
                        "stays resident, what is read from the file; run's --ram-budget)")
    p.set_defaults(fn=cmd_plan)

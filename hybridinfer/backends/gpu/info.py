"""`hybridinfer info --gpu`: the card, the class it compiles and tiles for, the tiles it will use for typical
shapes, and whether its kernels are in the disk cache (compiling them ahead on request)."""

from __future__ import annotations

from ...format import quant
from . import kclass
from .cards import CardLimits

# (label, T, N, K, weight type, tokens a group): the shapes a 35B-A3B prefill of 947 tokens runs
TYPICAL = (
    ("dense 947 x 8192 x 2048 Q4_K", 947, 8192, 2048, quant.Q4_K, None),
    ("dense 128 x 8192 x 2048 Q4_K", 128, 8192, 2048, quant.Q4_K, None),
    ("MoE gate/up 256 experts ~30 tokens, 512 x 2048 Q4_K", 7576, 512, 2048, quant.Q4_K, 7576 / 256),
    ("MoE down 256 experts ~30 tokens, 2048 x 512 Q6_K", 7576, 2048, 512, quant.Q6_K, 7576 / 256),
)


def tile_plan(limits: CardLimits) -> list[tuple[str, tuple[int, int]]]:
    """(label, tile) choose_tile gives each TYPICAL shape under `limits`."""
    from .k_gemm import choose_tile

    return [(label, choose_tile(limits, T, N, K, q, rpg)) for label, T, N, K, q, rpg in TYPICAL]


def report(card_profile: str | None = None, compile_ahead: bool = False) -> list[str]:
    """The lines of `info --gpu` (raises BackendNotAvailableError without a card or pycuda)."""
    from . import loader

    loader.init()  # BackendNotAvailableError without pycuda or a card
    import pycuda.driver as drv

    loader.configure(card_profile)
    dev = drv.Context.get_device()
    cc = dev.compute_capability()
    lim = loader.limits()
    cls = loader.kernel_class()
    prof = f"profile {card_profile} ({lim.sm}, {lim.regs_per_thread} registers a thread)" if card_profile else \
        f"its own ({lim.card_class})"
    lines = [f"gpu:           {dev.name()}, sm_{cc[0]}{cc[1]}, {lim.sm_count} SMs, "
             f"{dev.total_memory() / 2**30:.1f} GiB",
             f"compiled for:  {prof}; kernel class {cls} (nvcc {' '.join(kclass.nvcc_options(cls)) or 'defaults'})",
             "tiles:"]
    lines += [f"  {label:<52} {t[0]} x {t[1]}" for label, t in tile_plan(lim)]
    warm = {f: loader.is_cached(f) for f in loader.FAMILIES}
    lines.append(f"kernel cache:  {loader.cache_dir()}: " + ", ".join(f"{f} {'warm' if w else 'cold'}"
                                                                    for f, w in warm.items()))
    if compile_ahead:
        line = loader.describe_compiles(loader.compile_all())
        lines.append(line or "kernel cache:  every family already cached, nothing compiled")
    return lines

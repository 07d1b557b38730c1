"""Kernel classes: how the kernels are compiled for a card's limits, and what their launchers must match.

Two classes cover the cards: "r63" for compute capabilities whose threads have 63 registers (sm_2x, sm_30), and
"r255" for the rest (sm_35 and later). r63 is compiled with -maxrregcount 63 and -DHI_REG63, which selects the
lean GEMM body (no registers held across a k chunk, at most 4 x 8 outputs a thread), 8 rows of S a thread in the
delta rule, and no __launch_bounds__ (ptxas lets bounds override -maxrregcount). Pure data and functions.
"""

from __future__ import annotations

from .cards import CardLimits

R63, R255 = "r63", "r255"
CLASSES = (R63, R255)

# nvcc / clang options of each class (the same defines reach clang in the ptxas check)
DEFINES = {R63: ("-DHI_REG63",), R255: ()}
MAXREG = {R63: 63, R255: None}

# gdn_delta_rule: rows of S a thread holds (GDN_MAXR) and the block size bound (GDN_MAX_THREADS), per class
GDN_MAXR = {R63: 8, R255: 16}
GDN_MAX_THREADS = {R63: 512, R255: 256}

# The archs CUDA 11.8's ptxas checks each class on. It cannot target sm_2x or sm_30, so the 63-register class is
# assembled for sm_35 held to 63 registers, as those cards hold every thread.
CHECK_ARCHS = {R63: ("sm_35",), R255: ("sm_35", "sm_37", "sm_50", "sm_52", "sm_60")}


def kernel_class(limits: CardLimits) -> str:
    return R63 if limits.regs_per_thread <= 63 else R255


def nvcc_options(cls: str) -> list[str]:
    """The options PyCUDA's nvcc compiles a family with for class `cls`."""
    if cls not in CLASSES:
        raise ValueError(f"unknown kernel class {cls!r} (known: {', '.join(CLASSES)})")
    opts = list(DEFINES[cls])
    if MAXREG[cls]:
        opts.append(f"-maxrregcount={MAXREG[cls]}")
    return opts


def resident_blocks(limits: CardLimits, regs: int, smem: int, threads: int) -> int:
    """Blocks of `threads` threads using `regs` registers a thread and `smem` bytes of shared memory that one
    multiprocessor holds at once (register allocation rounded to 256 a warp, as from sm_30; sm_2x rounds to 64
    a warp pair, close enough for a choice between tiles)."""
    warps = -(-threads // 32)
    regs_block = warps * (-(-max(regs, 1) * 32 // 256) * 256)
    by_regs = limits.regs_per_sm // regs_block
    by_smem = limits.smem_per_sm // smem if smem else limits.blocks_per_sm
    by_threads = limits.threads_per_sm // threads
    return max(0, min(by_regs, by_smem, by_threads, limits.blocks_per_sm))

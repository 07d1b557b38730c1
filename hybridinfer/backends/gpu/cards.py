"""The cards this engine is for: each compute capability's limits (what tiles and launch bounds must fit) and a
table of named cards with their speeds (what the time model predicts from). Pure data and functions, no GPU.

Limits per compute capability are CUDA's ("Compute Capabilities" table of the CUDA C Programming Guide,
"Technical Specifications per Compute Capability"): registers a thread may use (63 on sm_2x and sm_30, 255 from
sm_35), 32-bit registers and shared memory per multiprocessor, shared memory a block may take (48 KB on every
class here), resident threads and blocks per multiprocessor.

Card figures (fp32 peak at base clock, memory bandwidth, memory size, bus) are NVIDIA's datasheets as collected
in Wikipedia's "List of Nvidia graphics processing units" (Tesla and GeForce tables); each row names its chip.
Bus rates are what a pinned host-to-device copy reaches, not the link's nominal rate: PCIe 2.0 x16 ~6 GB/s,
PCIe 3.0 x16 ~12 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

KB = 1024
PCIE2_X16 = 6.0e9  # bytes/s a pinned host-to-device copy reaches on PCIe 2.0 x16
PCIE3_X16 = 12.0e9


@dataclass(frozen=True)
class CardLimits:
    """What a kernel launch must fit on one compute capability (sm_count: the card's, or 0 when unknown)."""

    cc: tuple[int, int]
    regs_per_thread: int
    regs_per_sm: int
    smem_per_sm: int
    smem_per_block: int
    threads_per_sm: int
    blocks_per_sm: int
    sm_count: int = 0

    @property
    def sm(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    @property
    def card_class(self) -> str:
        return class_of(self.cc)


# per compute capability: (regs/thread, regs/SM, smem/SM, smem/block, threads/SM, blocks/SM)
_CC = {
    (2, 0): (63, 32 * KB, 48 * KB, 48 * KB, 1536, 8),
    (2, 1): (63, 32 * KB, 48 * KB, 48 * KB, 1536, 8),
    (3, 0): (63, 64 * KB, 48 * KB, 48 * KB, 2048, 16),
    (3, 5): (255, 64 * KB, 48 * KB, 48 * KB, 2048, 16),
    (3, 7): (255, 128 * KB, 112 * KB, 48 * KB, 2048, 16),
    (5, 0): (255, 64 * KB, 64 * KB, 48 * KB, 2048, 32),
    (5, 2): (255, 64 * KB, 96 * KB, 48 * KB, 2048, 32),
    (6, 0): (255, 64 * KB, 64 * KB, 48 * KB, 2048, 32),
}


def limits_for(cc: tuple[int, int], sm_count: int = 0) -> CardLimits:
    """The limits of compute capability `cc`; a newer one than the table (a modern card) gets sm_60's, which
    every later class meets or exceeds, except its real SM count."""
    cc = (int(cc[0]), int(cc[1]))
    row = _CC.get(cc) or (_CC[(6, 0)] if cc > (6, 0) else None)
    if row is None:
        raise ValueError(f"compute capability {cc[0]}.{cc[1]} is not one this engine runs on (sm_20 and later)")
    return CardLimits(cc, *row, sm_count=int(sm_count))


def class_of(cc: tuple[int, int]) -> str:
    """fermi (sm_2x), kepler (sm_3x), maxwell (sm_5x), pascal (sm_60) or modern (anything newer)."""
    major = cc[0]
    if major == 2:
        return "fermi"
    if major == 3:
        return "kepler"
    if major == 5:
        return "maxwell"
    if cc == (6, 0):
        return "pascal"
    if cc > (6, 0):
        return "modern"
    raise ValueError(f"compute capability {cc[0]}.{cc[1]} is older than sm_20")


@dataclass(frozen=True)
class Card:
    """A named card: its chip's limits and its speeds."""

    name: str
    chip: str
    limits: CardLimits
    fp32_flops: float  # peak FLOP/s at base clock (2 x cores x clock)
    mem_bw: float  # bytes/s
    vram: int  # bytes
    bus_bw: float  # bytes/s host to device, pinned

    @property
    def card_class(self) -> str:
        return self.limits.card_class


def _card(name, chip, cc, sms, gflops, mem_gbs, vram_gib, bus):
    return Card(name, chip, limits_for(cc, sms), gflops * 1e9, mem_gbs * 1e9, int(vram_gib * (1 << 30)), bus)


CARDS = {c.name: c for c in (
    # Fermi: 448 cores at 1.15 GHz; 6 GB GDDR5 at 144 GB/s (Tesla C2075 datasheet)
    _card("c2075", "GF110", (2, 0), 14, 1030, 144, 6, PCIE2_X16),
    _card("m2090", "GF110", (2, 0), 16, 1331, 177, 6, PCIE2_X16),
    _card("gtx580", "GF110", (2, 0), 16, 1581, 192.4, 1.5, PCIE2_X16),
    # Kepler GK104 (63 registers a thread like Fermi): 1,536 cores at 1.006 GHz
    _card("gtx680", "GK104", (3, 0), 8, 3090, 192.2, 2, PCIE3_X16),
    # Kepler GK110 / GK210: K40 2,880 cores at 745 MHz; K80 per GPU 2,496 cores at 562 MHz
    _card("k20", "GK110", (3, 5), 13, 3520, 208, 5, PCIE3_X16),
    _card("k40", "GK110B", (3, 5), 15, 4290, 288, 12, PCIE3_X16),
    _card("k80", "GK210", (3, 7), 13, 2800, 240, 12, PCIE3_X16),
    # Maxwell GM200: 3,072 cores at 948 MHz
    _card("m40", "GM200", (5, 2), 24, 5820, 288, 12, PCIE3_X16),
    _card("gtx980ti", "GM200", (5, 2), 22, 5630, 336.5, 6, PCIE3_X16),
    # Pascal GP100 (PCIe): 3,584 cores at 1.126 GHz base
    _card("p100", "GP100", (6, 0), 56, 8070, 732, 16, PCIE3_X16),
)}

# --card-profile: the class's representative card
PROFILES = {"fermi": "c2075", "kepler": "k40", "maxwell": "m40", "pascal": "p100"}


def card(name: str) -> Card:
    key = name.lower().replace("tesla", "").replace(" ", "").replace("-", "")
    if key in PROFILES:
        key = PROFILES[key]
    if key not in CARDS:
        raise ValueError(f"unknown card {name!r} (known: {', '.join(sorted(CARDS))}; profiles: "
                         f"{', '.join(PROFILES)})")
    return CARDS[key]


def profile_limits(profile: str, sm_count: int) -> CardLimits:
    """The limits a run under --card-profile `profile` compiles and picks tiles for, on a card of `sm_count`
    multiprocessors (the card we have: the profile constrains each block, not how many SMs run them)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown card profile {profile!r} (known: {', '.join(PROFILES)})")
    return replace(CARDS[PROFILES[profile]].limits, sm_count=int(sm_count))


def paced_bus(card_profile: str | None, bus_bw: float | None = None) -> float | None:
    """The rate (bytes/s) the weight stream is paced to: bus_bw when given, else the profile's class bus (PCIe 2.0
    x16 for Fermi, 3.0 x16 later), else None (the card's own, unpaced)."""
    if bus_bw is not None or card_profile is None:
        return bus_bw
    return card(card_profile).bus_bw

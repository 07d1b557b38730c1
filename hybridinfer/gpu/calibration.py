"""The efficiencies `hybridinfer plan` scales the card table's peak rates by: measured figures, each with the
command that produced it, or conservative defaults until one is measured. Data only.

compute: the fraction of the card's fp32 peak (cards.Card.fp32_flops) a whole prefill pass reaches: counted
    FLOPs (gpu/work.py) over the compute stream's time with the model resident, over the FMA peak. Measured
    under the class's profile on the card we have, it is the fraction the class's kernels (tiles, registers,
    shared memory) reach, applied to the old card's peak: it assumes the old card's kernels reach the same
    fraction of its own peak, the usual first approximation across generations.
bus: the fraction of the bus rate (cards.Card.bus_bw, already what a pinned copy reaches) the weight stream
    reaches, over the copy stream's busy time.
decode: the fraction of the host's read bandwidth CPU decode reaches (weight bytes per token x tok/s).

Produced by (the figures are printed under "calibration" at the end of the tables):
    hybridinfer bench prefill -m M --card-profile CLASS --bus-bw GB/s   (compute: resident rows; bus: budget rows)
    hybridinfer bench decode -m M                                        (decode: the "% of floor" column)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ParameterError


@dataclass(frozen=True)
class Efficiency:
    compute: float
    bus: float
    source: str


# compute: conservative until measured under each profile. Fermi and GK10x run the 63-register tiles (issue 23
# measured the dense GEMM held to 63 registers at ~0.4 of an H100's FMA peak, the grouped MoE GEMM lower), so a
# whole pass is put at 0.2; later classes at 0.25. For scale: today's tiles on an H200 reach 0.268 (bench prefill,
# 35B-A3B Q4_K_M, 947 tokens, resident).
# bus: measured. `hybridinfer bench prefill -m 35b-a3b-q4_k_m.gguf --prompts 947 --vram-budget 6GiB --bus-bw 6` on
# an H200 streamed 14.83 GiB per pass at 0.998 of the paced 6 GB/s (wall 1.02x the transfer floor); the pacing
# (gpu/pacing.py) reproduces the card table's bus rate, so this is the streamer's own share of it (gaps between
# uploads), the same for every class: 0.99 here.
_BUS = 0.99
_BUS_SRC = "bus: bench prefill --bus-bw 6, 35B-A3B under 6 GiB"
CALIBRATION: dict[str, Efficiency] = {
    "fermi": Efficiency(0.20, _BUS, f"compute: default (not yet measured under --card-profile fermi); {_BUS_SRC}"),
    "kepler": Efficiency(0.20, _BUS, f"compute: default (not yet measured under --card-profile kepler); {_BUS_SRC}"),
    "maxwell": Efficiency(0.25, _BUS, f"compute: default (not yet measured under --card-profile maxwell); "
                                      f"{_BUS_SRC}"),
    "pascal": Efficiency(0.25, _BUS, f"compute: default (not yet measured under --card-profile pascal); {_BUS_SRC}"),
}
# CPU decode: bench decode's fraction of the read-bandwidth floor; conservative until measured on the host
DECODE = (0.5, "default (not yet measured: hybridinfer bench decode)")


def efficiency(card_class: str) -> Efficiency:
    if card_class not in CALIBRATION:
        raise ParameterError(f"no calibration for card class {card_class!r} (known: {', '.join(CALIBRATION)})")
    return CALIBRATION[card_class]

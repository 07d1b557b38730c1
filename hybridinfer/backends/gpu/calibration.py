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

from ...errors import ParameterError


@dataclass(frozen=True)
class Efficiency:
    compute: float
    bus: float
    source: str


# compute: measured under each profile. `hybridinfer bench prefill -m 35b-a3b-q4_k_m.gguf --prompts 947
# --vram-budget 6GiB --card-profile CLASS` on an H200, the whole-model-resident row: fermi (the 63-register kernel
# class) 14.45 TFLOP/s = 0.240 of the 60.3 TFLOP/s FMA peak; kepler (K40's sm_35), maxwell and pascal (the
# 255-register class) 16.14-16.20 = 0.268. A GK10x card (sm_30: 63 registers a thread) runs fermi's kernels, so it
# takes fermi's figure (efficiency_for).
# bus: measured in the same runs, the budget rows: 0.996 of the paced 6 GB/s (fermi), 0.992-0.994 of 12 GB/s (the
# others); the pacing (gpu/pacing.py) reproduces the card table's bus rate, so this is the streamer's own share of
# it (gaps between uploads).
_SRC = "bench prefill --card-profile {} (35B-A3B Q4_K_M, 947 tokens; compute: resident, bus: 6 GiB budget)"
CALIBRATION: dict[str, Efficiency] = {
    "fermi": Efficiency(0.240, 0.996, _SRC.format("fermi")),
    "kepler": Efficiency(0.268, 0.994, _SRC.format("kepler")),
    "maxwell": Efficiency(0.268, 0.992, _SRC.format("maxwell")),
    "pascal": Efficiency(0.268, 0.994, _SRC.format("pascal")),
}
# CPU decode: bench decode's fraction of the read-bandwidth floor; conservative until measured on the host
DECODE = (0.94, "bench batch, 35B-A3B Q4_K_M, one sequence, 16-core host: 94.3 GB/s of weights read per second "
                "against its ~100 GB/s")


def efficiency_for(limits) -> Efficiency:
    """The calibration of the kernels a card runs: a 63-register card (sm_2x, sm_30) fermi's, else its class's
    (a class newer than the table: pascal's)."""
    if limits.regs_per_thread <= 63:
        return CALIBRATION["fermi"]
    return CALIBRATION.get(limits.card_class, CALIBRATION["pascal"])


def efficiency(card_class: str) -> Efficiency:
    if card_class not in CALIBRATION:
        raise ParameterError(f"no calibration for card class {card_class!r} (known: {', '.join(CALIBRATION)})")
    return CALIBRATION[card_class]

"""The per-card time model of `hybridinfer plan`. Pure functions, no GPU.

Prefill streams layer by layer through two staging slots (gpu/streamer.py): layer L's upload waits for the copy
before it (one copy stream) and for its slot to be free (the compute of the last streamed layer that used slot
L % 2); layer L's compute waits for the compute before it and for its own upload. `pipeline_seconds` replays that
schedule with each layer's compute time (its counted FLOPs over the card's fp32 peak x the compute efficiency)
and transfer time (its streamed bytes over the bus rate x the bus efficiency). The result lies between
max(sum compute, sum transfer) (perfect overlap) and their sum (none).

Decode runs on the CPU: each token reads the active weights (every dense tensor, k of E experts, one embedding
row) from host memory: bytes per token / (host bandwidth x decode efficiency).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ...errors import ParameterError


def pipeline_seconds(compute: Sequence[float], transfer: Sequence[float]) -> float:
    """Seconds to run layers 0..n-1 in order where layer i computes for compute[i] seconds after its upload of
    transfer[i] seconds (0: resident, no upload, no slot), double-buffered as the Streamer does."""
    if len(compute) != len(transfer):
        raise ParameterError(f"{len(compute)} compute times for {len(transfer)} transfer times")
    copy_end = comp_end = 0.0
    slot_free = [0.0, 0.0]  # when the compute last using each staging slot ends
    for i, (c, t) in enumerate(zip(compute, transfer, strict=True)):
        if c < 0 or t < 0 or not (math.isfinite(c) and math.isfinite(t)):
            raise ParameterError(f"layer {i}: compute {c!r} s and transfer {t!r} s must be finite and >= 0")
        ready = 0.0
        if t > 0:
            copy_end = max(copy_end, slot_free[i % 2]) + t
            ready = copy_end
        comp_end = max(comp_end, ready) + c
        if t > 0:
            slot_free[i % 2] = comp_end
    return comp_end


def layer_times(flops_by_layer: Sequence[float], bytes_by_layer: Sequence[int], fp32_flops: float, bus_bw: float,
                compute_eff: float, bus_eff: float) -> tuple[list[float], list[float]]:
    """(compute seconds, transfer seconds) per layer on a card of `fp32_flops` peak and `bus_bw` bus."""
    for name, v in (("fp32_flops", fp32_flops), ("bus_bw", bus_bw), ("compute efficiency", compute_eff),
                    ("bus efficiency", bus_eff)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ParameterError(f"{name} must be a positive finite number, got {v!r}")
    if compute_eff > 1 or bus_eff > 1:
        raise ParameterError(f"efficiencies are fractions of a peak, at most 1: compute {compute_eff}, bus {bus_eff}")
    comp = [f / (fp32_flops * compute_eff) for f in flops_by_layer]
    tr = [b / (bus_bw * bus_eff) for b in bytes_by_layer]
    return comp, tr


def decode_seconds(bytes_per_token: int, host_bw: float, decode_eff: float) -> float:
    """Seconds per decoded token: the active weights read from host memory at host_bw x decode_eff."""
    if not (math.isfinite(host_bw) and host_bw > 0):
        raise ParameterError(f"host bandwidth must be a positive finite rate in bytes/s, got {host_bw!r}")
    if not (0 < decode_eff <= 1):
        raise ParameterError(f"decode efficiency must be in (0, 1], got {decode_eff!r}")
    return bytes_per_token / (host_bw * decode_eff)

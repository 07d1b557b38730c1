"""Pacing of the host-to-device weight stream to an old card's bus (`bus_bw` bytes/s) on a faster card: what to
hold and for how long. Pure functions, no GPU; the Streamer runs the schedule through k_pace.Pacer (host-side
holds in stream order, native/simd/pace.c).

A layer's uploads are cut into pieces of at most `max_piece` bytes, each given its share of the layer's time on
the slow bus (its bytes / bus_bw, rounded so the shares add up to the whole copy's time exactly). On the copy
stream each piece waits until the previous pieces' shares have elapsed, then copies at the
card's own rate; a last hold waits out the final share before the layer is marked ready. So the compute stream sees
each layer arrive when the slow bus would have delivered it, and the copy stream is busy as long as it would be,
whatever the real bus does within the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import ParameterError

# bytes per paced piece: ~1.4 ms at 6 GB/s, so a hold's wake-up (microseconds) is lost in it, and an upload queued on
# another stream of the card (the expert split's partial sums) waits at most that long for the bus: with 32 MiB
# pieces (~5.6 ms) a two-card pass of 4,096 tokens took 1.80-1.87 s, with 8 MiB 1.56 s (the 35B-A3B, fermi profile)
MAX_PIECE = 8 << 20


@dataclass(frozen=True)
class Piece:
    copy: int  # index of the copy it belongs to
    offset: int  # bytes into that copy
    nbytes: int
    hold_ns: int  # this piece's share of the slow bus's time


def check_bus_bw(bus_bw) -> float:
    """bus_bw as a float; a clear error for a rate that is not a positive finite number of bytes/s."""
    try:
        v = float(bus_bw)
    except (TypeError, ValueError):
        raise ParameterError(f"bus_bw must be bytes per second, got {bus_bw!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise ParameterError(f"bus_bw must be a positive finite rate in bytes/s, got {bus_bw!r}")
    return v


def pace_pieces(sizes, bus_bw: float, max_piece: int = MAX_PIECE) -> list[Piece]:
    """The pieces of copies of `sizes` bytes (in order), each at most `max_piece`, with hold times in ns whose
    running sum is the running byte count over `bus_bw`, rounded to the ns (so no rounding error accumulates)."""
    bw = check_bus_bw(bus_bw)
    if int(max_piece) < 1:
        raise ParameterError(f"max_piece must be at least 1 byte, got {max_piece!r}")
    out, done, t_prev = [], 0, 0
    for i, n in enumerate(sizes):
        n = int(n)
        if n < 0:
            raise ParameterError(f"copy {i} has a negative size {n}")
        for off in range(0, n, int(max_piece)):
            nb = min(int(max_piece), n - off)
            done += nb
            t = round(done * 1e9 / bw)
            out.append(Piece(i, off, nb, t - t_prev))
            t_prev = t
    return out


def paced_seconds(sizes, bus_bw: float) -> float:
    """The time a paced upload of `sizes` takes on the copy stream (where the card's own bus is faster)."""
    return sum(p.hold_ns for p in pace_pieces(sizes, bus_bw)) / 1e9

"""Sampling settings and their checks: SamplingParams (greedy, temperature, top-k, top-p, min-p, repetition and
presence penalties, seed) and stop strings. The sampler that applies them is cpu/sampling_nb.py."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .errors import ParameterError


def check_number(name: str, value, *, integer: bool = False):
    """`value` as given, after checking it is a finite real number (an integer with `integer`); bools are not
    numbers here (True as a temperature is a mistake, not 1.0)."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ParameterError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise ParameterError(f"{name} must be a finite number, got {value!r}")
    return value


def check_int(name: str, value, lo: int) -> int:
    """`value` as an int, after checking it is an integer >= lo."""
    check_number(name, value, integer=True)
    if value < lo:
        raise ParameterError(f"{name} must be >= {lo}, got {value!r}")
    return int(value)


def check_stop(stop) -> list[str]:
    """Stop strings as a list: None, one string or a sequence of them, none empty (an empty one would match
    before the first token)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ParameterError(f"a stop string must be a non-empty str, got {s!r}")
    return stops


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name))
        if self.temperature < 0:
            raise ParameterError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p < 1.0:
            raise ParameterError(f"min_p must be in [0, 1), got {self.min_p!r}")
        check_int("top_k", self.top_k, 0)  # 0: off
        if self.repeat_penalty <= 0:
            raise ParameterError(f"repeat_penalty must be > 0, got {self.repeat_penalty!r}")
        check_int("repeat_last_n", self.repeat_last_n, 0)
        if self.seed is not None:
            check_number("seed", self.seed, integer=True)

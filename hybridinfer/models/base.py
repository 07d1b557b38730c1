"""What every architecture module shares: metadata access and the tensor-spec check."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ..errors import GGUFError, MissingMetadataError, TensorShapeError
from ..format.gguf_model import GGUFModel


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the architecture reads: GGUF name, ggml `ne`, whether it may be absent."""

    name: str
    ne: tuple[int, ...]
    optional: bool = False


class Meta:
    """`{arch}.` metadata keys with typed conversion and clear errors."""

    def __init__(self, gm: GGUFModel, arch: str):
        self.gm, self.arch = gm, arch

    def get(self, key: str, default: Any = ...) -> Any:
        full = f"{self.arch}.{key}"
        if default is ...:
            return self.gm.meta(full)
        return self.gm.meta(full, default)

    def _bad(self, key: str, v: Any, want: str) -> GGUFError:
        return GGUFError(f"{self.gm.path!r}: metadata {self.arch}.{key} = {v!r} {want}")

    def int(self, key: str, default: Any = ..., lo: int | None = None) -> int:
        """An integer, at least `lo` when given (a count of 0 would divide by zero or build empty layers)."""
        v = self.get(key, default)
        if isinstance(v, list) and v:  # some converters write per-layer arrays; all equal in the models we run
            if any(isinstance(x, list) for x in v) or len(set(v)) != 1:
                raise MissingMetadataError(
                    f"{self.gm.path!r}: {self.arch}.{key} varies per layer ({v[:8]}...), which is not supported")
            v = v[0]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(key, v, "is not an integer")
        if lo is not None and v < lo:
            raise self._bad(key, v, f"must be >= {lo}")
        return v

    def float(self, key: str, default: Any = ..., positive: bool = False) -> float:
        """A finite number (> 0 with `positive`: an epsilon or a RoPE base)."""
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self._bad(key, v, "is not a finite number")
        if positive and v <= 0:
            raise self._bad(key, v, "must be > 0")
        return float(v)

    def ints(self, key: str, default: Any = ...) -> list | None:
        """A list of integers or booleans (or the default)."""
        v = self.get(key, default)
        if v is default:
            return v
        if not isinstance(v, list) or not all(isinstance(x, int) for x in v):
            raise self._bad(key, v if not isinstance(v, list) else v[:8], "is not an array of integers")
        return v


def n_vocab_of(gm: GGUFModel) -> int:
    """The vocabulary size: token_embd's row count (metadata may omit it)."""
    t = gm.tensor("token_embd.weight")
    return int(t.ne[1])


def check_tensors(gm: GGUFModel, specs: list[TensorSpec]) -> None:
    """Every required tensor exists with the implied shape and a readable type; optional ones are checked
    only if present. Raises MissingTensorError / TensorShapeError / UnsupportedTensorTypeError."""
    for s in specs:
        if s.optional and not gm.has(s.name):
            continue
        gm.tensor(s.name, s.ne)


def check_rope_dims(gm: GGUFModel, arch: str, n_rot: int, head_dim: int) -> None:
    """RoPE rotates pairs of a head's dimensions: an even count, at most the head's."""
    if n_rot % 2 or n_rot > head_dim:
        raise GGUFError(f"{gm.path!r}: metadata {arch}.rope.dimension_count = {n_rot} must be even and at most "
                        f"the head size {head_dim}")


def require(cond: bool, gm: GGUFModel, what: str) -> None:
    if not cond:
        raise TensorShapeError(f"{gm.path!r}: inconsistent hyperparameters: {what}")


def describe(args) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in fields(args)}

"""What every architecture module shares: metadata access and the tensor-spec check."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import MissingMetadataError, TensorShapeError
from ..gguf_model import GGUFModel


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

    def int(self, key: str, default: Any = ...) -> int:
        v = self.get(key, default)
        if isinstance(v, list):  # some converters write per-layer arrays; all equal in the models we run
            if len(set(v)) != 1:
                raise MissingMetadataError(
                    f"{self.gm.path!r}: {self.arch}.{key} varies per layer ({v[:8]}...), which is not supported")
            v = v[0]
        return int(v)

    def float(self, key: str, default: Any = ...) -> float:
        return float(self.get(key, default))


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


def require(cond: bool, gm: GGUFModel, what: str) -> None:
    if not cond:
        raise TensorShapeError(f"{gm.path!r}: inconsistent hyperparameters: {what}")


def describe(args) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in fields(args)}

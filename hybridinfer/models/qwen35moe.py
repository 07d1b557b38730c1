"""`qwen35moe`: Qwen3.5 / 3.6 MoE hybrid (35B-A3B, 122B-A10B). Same trunk as `qwen35`; every layer's FFN
is a softmax-top-k-renormalised MoE plus a sigmoid-gated shared expert (spec §5)."""

from __future__ import annotations

from dataclasses import dataclass

from ..gguf_model import GGUFModel
from . import qwen35

ARCH = "qwen35moe"
tensor_specs = qwen35.tensor_specs


@dataclass(frozen=True)
class ModelArgs(qwen35.ModelArgs):
    @classmethod
    def from_gguf(cls, gm: GGUFModel, arch: str = ARCH) -> ModelArgs:
        return super().from_gguf(gm, arch)

"""`qwen35moe`: Qwen3.5 / 3.6 MoE hybrid (35B-A3B, 122B-A10B). Same trunk as `qwen35`; every layer's FFN
is a softmax-top-k-renormalised MoE plus a sigmoid-gated shared expert (docs/gguf-qwen35.md §5)."""

from __future__ import annotations

from dataclasses import dataclass

from ..format.gguf_model import GGUFModel
from . import qwen35
from .graph import Branch
from .qwen35 import EMBED, head  # noqa: F401  (this architecture's description: qwen35's with moe as the FFN)

ARCH = "qwen35moe"
tensor_specs = qwen35.tensor_specs


@dataclass(frozen=True)
class ModelArgs(qwen35.ModelArgs):
    @classmethod
    def from_gguf(cls, gm: GGUFModel, arch: str = ARCH) -> ModelArgs:
        return super().from_gguf(gm, arch)


def moe(ops, a, x):
    """Routed SwiGLU experts (softmax, top k, renormalised) plus the sigmoid-gated shared expert
    (docs/gguf-qwen35.md §5)."""
    shared = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp") if a.n_ff_shexp else None
    return ops.moe(x, router="ffn_gate_inp", experts=("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                   shared=shared, shared_gate="ffn_gate_inp_shexp" if a.n_ff_shexp else None)


def layer(a, i: int) -> tuple[Branch, ...]:
    return qwen35.mixer(a, i), Branch("post_attention_norm", moe, "ffn")


def mtp(a):
    """qwen35's MTP block with the MoE FFN."""
    return qwen35.mtp(a, moe)

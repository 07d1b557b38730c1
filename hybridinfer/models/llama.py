"""`llama`: dense pre-norm transformer (SmolLM2, Llama 2/3 style), GQA, RoPE on adjacent pairs.

llama.cpp's converter permutes HF q/k rows so that its NORM RoPE (pairs 2i, 2i+1) equals HF's
rotate-half RoPE; GGUF weights are therefore used with the pairwise rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format.gguf_model import GGUFModel
from .base import Meta, TensorSpec, check_rope_dims, check_tensors, n_vocab_of, require
from .graph import Branch

ARCH = "llama"


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_rot: int
    rope_theta: float
    rms_eps: float
    context_length: int
    tied_output: bool
    has_rope_freqs: bool
    # K/V cache types (llama.cpp's -ctk / -ctv names): the engine's setting (state_kinds.with_cache_types)
    cache_type_k: str = "f32"
    cache_type_v: str = "f32"
    cache_rotate: bool = True  # llama.cpp's Hadamard rotation of quantized K/V (state_kinds.kv_rotation)

    # the shared vocabulary of every ModelArgs the engine reads
    @property
    def layer_types(self) -> tuple[str, ...]:
        return ("attention",) * self.n_layer

    rope_neox = False
    attn_gate = False
    qk_norm = False
    is_moe = False

    @classmethod
    def from_gguf(cls, gm: GGUFModel) -> ModelArgs:
        m = Meta(gm, ARCH)
        n_embd = m.int("embedding_length", lo=1)
        n_head = m.int("attention.head_count", lo=1)
        head_dim = m.int("attention.key_length", max(n_embd // n_head, 1), lo=1)
        require(head_dim * n_head == n_embd or gm.has("blk.0.attn_q.weight"), gm, "head_count")
        args = cls(
            arch=ARCH,
            n_vocab=n_vocab_of(gm),
            n_embd=n_embd,
            n_layer=m.int("block_count", lo=1),
            n_head=n_head,
            n_head_kv=m.int("attention.head_count_kv", n_head, lo=1),
            head_dim=head_dim,
            n_ff=m.int("feed_forward_length", lo=1),
            n_rot=m.int("rope.dimension_count", head_dim, lo=2),
            rope_theta=m.float("rope.freq_base", 10000.0, positive=True),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-5, positive=True),
            context_length=m.int("context_length", 2048, lo=1),
            tied_output=not gm.has("output.weight"),
            has_rope_freqs=gm.has("rope_freqs.weight"),
        )
        require(args.n_head % args.n_head_kv == 0, gm, f"head_count {n_head} not a multiple of "
                f"head_count_kv {args.n_head_kv}")
        check_rope_dims(gm, ARCH, args.n_rot, head_dim)
        check_tensors(gm, tensor_specs(args))
        return args


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    D, hd = a.n_embd, a.head_dim
    specs = [
        TensorSpec("token_embd.weight", (D, a.n_vocab)),
        TensorSpec("output_norm.weight", (D,)),
        TensorSpec("output.weight", (D, a.n_vocab), optional=True),
        TensorSpec("rope_freqs.weight", (a.n_rot // 2,), optional=True),
    ]
    for i in range(a.n_layer):
        b = f"blk.{i}."
        specs += [
            TensorSpec(b + "attn_norm.weight", (D,)),
            TensorSpec(b + "attn_q.weight", (D, a.n_head * hd)),
            TensorSpec(b + "attn_k.weight", (D, a.n_head_kv * hd)),
            TensorSpec(b + "attn_v.weight", (D, a.n_head_kv * hd)),
            TensorSpec(b + "attn_output.weight", (a.n_head * hd, D)),
            TensorSpec(b + "ffn_norm.weight", (D,)),
            TensorSpec(b + "ffn_gate.weight", (D, a.n_ff)),
            TensorSpec(b + "ffn_up.weight", (D, a.n_ff)),
            TensorSpec(b + "ffn_down.weight", (a.n_ff, D)),
        ]
    return specs


# the forward pass (models/graph.py: the op vocabulary every backend implements) ---------------------------------
EMBED = "token_embd.weight"


def head(a) -> tuple[str, str]:
    """The output norm and the LM head (the embedding, transposed, when the file ties them)."""
    return "output_norm.weight", EMBED if a.tied_output else "output.weight"


def attention(ops, a, x):
    """Grouped-query attention; with a.attn_gate each query head is stored [query, gate] and the output is gated,
    with a.qk_norm query and key heads are RMS-normed before RoPE."""
    qg, k, v = ops.linears(x, "attn_q", "attn_k", "attn_v")
    q, gate = ops.split_gate(qg) if a.attn_gate else (qg, None)
    if a.qk_norm:
        q, k = ops.head_norm(q, "attn_q_norm"), ops.head_norm(k, "attn_k_norm")
    o = ops.attention(q, k, v)
    if gate is not None:
        o = ops.sigmoid_gate(o, gate)
    return ops.linear(o, "attn_output")


def swiglu_ffn(ops, a, x):
    g, u = ops.linears(x, "ffn_gate", "ffn_up")
    return ops.linear(ops.swiglu(g, u), "ffn_down")


def layer(a, i: int) -> tuple[Branch, ...]:
    return Branch("attn_norm", attention, "mixer"), Branch("ffn_norm", swiglu_ffn, "ffn")

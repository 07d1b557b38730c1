"""`qwen35`: Qwen3.5 / 3.6 dense hybrid. Gated DeltaNet layers and gated full-attention layers
(docs/gguf-qwen35.md). `qwen35moe` reuses this module with a MoE FFN in every layer.

Traps handled here (docs/gguf-qwen35.md §8): block_count counts MTP blocks; value heads are tiled so GGUF value
head j reads key head j mod H_k; norms already carry +1 (except ssm_norm); ssm_a is already -exp(A_log).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import GGUFError, TensorShapeError
from ..format.gguf_model import GGUFModel
from .base import Meta, TensorSpec, check_rope_dims, check_tensors, n_vocab_of, require
from .graph import MTP, Branch
from .llama import EMBED, attention, head, swiglu_ffn

ARCH = "qwen35"


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int  # trunk layers only (block_count - nextn_predict_layers)
    n_layer_mtp: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_theta: float
    rope_sections: tuple[int, ...]
    rms_eps: float
    context_length: int
    tied_output: bool
    layer_types: tuple[str, ...]  # "gdn" | "attention" per trunk layer
    # Gated DeltaNet
    ssm_conv_kernel: int  # K
    ssm_d_k: int  # state_size
    ssm_n_k_heads: int  # group_count, H_k
    ssm_n_v_heads: int  # time_step_rank, H_v
    ssm_d_v: int  # inner_size / H_v
    gdn_head_map: str  # "mod" (qwen35*: tiled V heads) | "div" (qwen3next / HF order)
    # FFN
    n_ff: int  # dense width (0 for MoE)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    # K/V cache types (llama.cpp's -ctk / -ctv names): the engine's setting (state_kinds.with_cache_types)
    cache_type_k: str = "f32"
    cache_type_v: str = "f32"
    cache_rotate: bool = True  # llama.cpp's Hadamard rotation of quantized K/V (state_kinds.kv_rotation)
    # the multi-token-prediction block (block n_layer) where the file has it: its head's norm and matrix (GGUF names;
    # nextn.shared_head_* where the converter wrote them, else the main head's), "" without it
    mtp_norm: str = ""
    mtp_out: str = ""

    rope_neox = True
    attn_gate = True
    qk_norm = True

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def has_mtp(self) -> bool:
        return bool(self.mtp_norm)

    @property
    def mtp_layer_types(self) -> tuple[str, ...]:
        """The mixer kinds of the MTP block's state (state_kinds): one attention layer with its own K/V."""
        return ("attention",) if self.has_mtp else ()

    @property
    def ssm_conv_channels(self) -> int:
        return 2 * self.ssm_n_k_heads * self.ssm_d_k + self.ssm_n_v_heads * self.ssm_d_v

    @classmethod
    def from_gguf(cls, gm: GGUFModel, arch: str = ARCH) -> ModelArgs:
        m = Meta(gm, arch)
        block_count = m.int("block_count", lo=1)
        n_mtp = m.int("nextn_predict_layers", 0, lo=0)
        n_layer = block_count - n_mtp
        require(n_layer > 0, gm, f"block_count {block_count} - nextn_predict_layers {n_mtp} <= 0")
        rec = m.ints("attention.recurrent_layers", None)
        if rec is not None:
            require(len(rec) >= n_layer, gm, f"attention.recurrent_layers has {len(rec)} entries for "
                    f"{n_layer} layers")
            is_gdn = [bool(x) for x in rec[:n_layer]]
        else:
            interval = m.int("full_attention_interval", 4, lo=1)
            is_gdn = [(i + 1) % interval != 0 for i in range(n_layer)]
        n_head = m.int("attention.head_count", lo=1)
        head_dim = m.int("attention.key_length", lo=1)
        n_v = m.int("ssm.time_step_rank", lo=1)
        n_k = m.int("ssm.group_count", lo=1)
        inner = m.int("ssm.inner_size", lo=1)
        require(inner % n_v == 0, gm, f"ssm.inner_size {inner} not a multiple of time_step_rank {n_v}")
        require(n_v % n_k == 0, gm, f"ssm.time_step_rank {n_v} not a multiple of group_count {n_k}")
        sections = m.ints("rope.dimension_sections", None)
        moe = arch != "qwen35"
        mtp = f"blk.{n_layer}.nextn."
        # llama.cpp's loader (src/models/qwen35.cpp load_block_mtp, graph_mtp) runs one MTP block; a file whose
        # converter left the tensors out (--no-mtp keeps the key at 0) has none
        has_mtp = n_mtp == 1 and gm.has(mtp + "eh_proj.weight")
        mtp_norm = (mtp + "shared_head_norm.weight" if gm.has(mtp + "shared_head_norm.weight")
                    else "output_norm.weight") if has_mtp else ""
        mtp_out = ""
        if has_mtp:
            mtp_out = (mtp + "shared_head_head.weight" if gm.has(mtp + "shared_head_head.weight")
                       else "output.weight" if gm.has("output.weight") else "token_embd.weight")
        args = cls(
            arch=arch,
            n_vocab=n_vocab_of(gm),
            n_embd=m.int("embedding_length", lo=1),
            n_layer=n_layer,
            n_layer_mtp=n_mtp,
            n_head=n_head,
            n_head_kv=m.int("attention.head_count_kv", lo=1),
            head_dim=head_dim,
            n_rot=m.int("rope.dimension_count", head_dim, lo=2),
            rope_theta=m.float("rope.freq_base", 1e7, positive=True),
            rope_sections=tuple(int(x) for x in sections) if sections is not None else (),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-6, positive=True),
            context_length=m.int("context_length", 262144, lo=1),
            tied_output=not gm.has("output.weight"),
            layer_types=tuple("gdn" if g else "attention" for g in is_gdn),
            ssm_conv_kernel=m.int("ssm.conv_kernel", lo=1),
            ssm_d_k=m.int("ssm.state_size", lo=1),
            ssm_n_k_heads=n_k,
            ssm_n_v_heads=n_v,
            ssm_d_v=inner // n_v,
            gdn_head_map="div" if arch == "qwen3next" else "mod",
            n_ff=0 if moe else m.int("feed_forward_length", lo=1),
            n_expert=m.int("expert_count", lo=1) if moe else 0,
            n_expert_used=m.int("expert_used_count", lo=1) if moe else 0,
            n_ff_exp=m.int("expert_feed_forward_length", lo=1) if moe else 0,
            n_ff_shexp=m.int("expert_shared_feed_forward_length", 0, lo=0) if moe else 0,
            mtp_norm=mtp_norm,
            mtp_out=mtp_out,
        )
        require(n_head % args.n_head_kv == 0, gm, f"head_count {n_head} not a multiple of head_count_kv "
                f"{args.n_head_kv}")
        check_rope_dims(gm, arch, args.n_rot, head_dim)
        if moe:
            _check_experts(gm, args)
        check_tensors(gm, tensor_specs(args))
        return args


def _check_experts(gm: GGUFModel, a: ModelArgs) -> None:
    """The routing counts against each other and against the expert tensors, named by their metadata keys (the
    tensor check alone would only say that some tensor has an unexpected shape)."""
    if a.n_expert_used > a.n_expert:
        raise GGUFError(f"{gm.path!r}: metadata {a.arch}.expert_used_count = {a.n_expert_used} exceeds "
                        f"{a.arch}.expert_count = {a.n_expert}")
    for i in range(a.n_layer):
        t = gm.tensors.get(f"blk.{i}.ffn_gate_exps.weight")
        if t is not None and len(t.ne) == 3 and t.ne[2] != a.n_expert:
            raise TensorShapeError(f"{gm.path!r}: metadata {a.arch}.expert_count = {a.n_expert}, but tensor "
                                   f"{t.name!r} holds {t.ne[2]} experts (shape {list(t.ne)})")
        if t is not None and len(t.ne) == 3 and t.ne[1] != a.n_ff_exp:
            raise TensorShapeError(f"{gm.path!r}: metadata {a.arch}.expert_feed_forward_length = {a.n_ff_exp}, "
                                   f"but tensor {t.name!r} has rows of {t.ne[1]} (shape {list(t.ne)})")


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    D, C = a.n_embd, a.ssm_conv_channels
    vd = a.ssm_n_v_heads * a.ssm_d_v
    specs = [
        TensorSpec("token_embd.weight", (D, a.n_vocab)),
        TensorSpec("output_norm.weight", (D,)),
        TensorSpec("output.weight", (D, a.n_vocab), optional=True),
    ]
    for i, kind in enumerate(a.layer_types):
        b = f"blk.{i}."
        specs += [TensorSpec(b + "attn_norm.weight", (D,)), TensorSpec(b + "post_attention_norm.weight", (D,))]
        if kind == "gdn":
            specs += [
                TensorSpec(b + "attn_qkv.weight", (D, C)),
                TensorSpec(b + "attn_gate.weight", (D, vd)),
                TensorSpec(b + "ssm_beta.weight", (D, a.ssm_n_v_heads)),
                TensorSpec(b + "ssm_alpha.weight", (D, a.ssm_n_v_heads)),
                TensorSpec(b + "ssm_dt.bias", (a.ssm_n_v_heads,)),
                TensorSpec(b + "ssm_a", (a.ssm_n_v_heads,)),
                TensorSpec(b + "ssm_conv1d.weight", (a.ssm_conv_kernel, C)),
                TensorSpec(b + "ssm_norm.weight", (a.ssm_d_v,)),
                TensorSpec(b + "ssm_out.weight", (vd, D)),
            ]
        else:
            specs += attention_specs(a, b)
        specs += ffn_specs(a, b)
    if a.has_mtp:
        specs += mtp_specs(a)
    return specs


def mtp_specs(a: ModelArgs) -> list[TensorSpec]:
    """The MTP block (docs/gguf-qwen35.md §2): a full-attention decoder block with the trunk's FFN kind, plus
    eh_proj over concat(enorm(embedding), hnorm(hidden)), as llama.cpp's load_block_mtp reads it."""
    D, b = a.n_embd, f"blk.{a.n_layer}."
    return [
        TensorSpec(b + "nextn.eh_proj.weight", (2 * D, D)),
        TensorSpec(b + "nextn.enorm.weight", (D,)),
        TensorSpec(b + "nextn.hnorm.weight", (D,)),
        TensorSpec(b + "nextn.shared_head_norm.weight", (D,), optional=True),
        TensorSpec(b + "nextn.shared_head_head.weight", (D, a.n_vocab), optional=True),
        TensorSpec(b + "attn_norm.weight", (D,)),
        TensorSpec(b + "post_attention_norm.weight", (D,)),
        *attention_specs(a, b),
        *ffn_specs(a, b),
    ]


def attention_specs(a: ModelArgs, b: str) -> list[TensorSpec]:
    """A gated full-attention block's tensors under prefix b (the trunk's attention layers and the MTP block)."""
    D, hd = a.n_embd, a.head_dim
    return [
        TensorSpec(b + "attn_q.weight", (D, 2 * a.n_head * hd)),
        TensorSpec(b + "attn_k.weight", (D, a.n_head_kv * hd)),
        TensorSpec(b + "attn_v.weight", (D, a.n_head_kv * hd)),
        TensorSpec(b + "attn_q_norm.weight", (hd,)),
        TensorSpec(b + "attn_k_norm.weight", (hd,)),
        TensorSpec(b + "attn_output.weight", (a.n_head * hd, D)),
    ]


def ffn_specs(a: ModelArgs, b: str) -> list[TensorSpec]:
    D = a.n_embd
    if not a.is_moe:
        return [
            TensorSpec(b + "ffn_gate.weight", (D, a.n_ff)),
            TensorSpec(b + "ffn_up.weight", (D, a.n_ff)),
            TensorSpec(b + "ffn_down.weight", (a.n_ff, D)),
        ]
    E, F = a.n_expert, a.n_ff_exp
    specs = [
        TensorSpec(b + "ffn_gate_inp.weight", (D, E)),
        TensorSpec(b + "ffn_gate_exps.weight", (D, F, E)),
        TensorSpec(b + "ffn_up_exps.weight", (D, F, E)),
        TensorSpec(b + "ffn_down_exps.weight", (F, D, E)),
    ]
    if a.n_ff_shexp:
        S = a.n_ff_shexp
        specs += [
            TensorSpec(b + "ffn_gate_inp_shexp.weight", (D, 1)),
            TensorSpec(b + "ffn_gate_shexp.weight", (D, S)),
            TensorSpec(b + "ffn_up_shexp.weight", (D, S)),
            TensorSpec(b + "ffn_down_shexp.weight", (S, D)),
        ]
    return specs


# the forward pass (models/graph.py); EMBED, head, attention and swiglu_ffn are llama's -------------------------
__all__ = ["EMBED", "head", "attention", "swiglu_ffn", "gdn", "layer", "mtp", "ModelArgs", "tensor_specs"]


def gdn(ops, a, x):
    """Gated DeltaNet (docs/gguf-qwen35.md §3): the projections, the layer between them, the output projection."""
    u, z, beta, alpha = ops.linears(x, "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")
    y = ops.gdn(u, z, beta, alpha, conv="ssm_conv1d", a="ssm_a", dt_bias="ssm_dt.bias", norm="ssm_norm")
    return ops.linear(y, "ssm_out")


def mixer(a, i: int) -> Branch:
    return Branch("attn_norm", gdn if a.layer_types[i] == "gdn" else attention, "mixer")


def layer(a, i: int) -> tuple[Branch, ...]:
    return mixer(a, i), Branch("post_attention_norm", swiglu_ffn, "ffn")


def mtp(a, ffn=swiglu_ffn) -> MTP | None:
    """The MTP block (llama.cpp's graph_mtp): x = eh_proj(concat(enorm(embedding of token t+1), hnorm(h_t))),
    then the attention block over its own K/V and the FFN, then its head: logits of token t+2."""
    if not a.has_mtp:
        return None
    return MTP(a.n_layer, "nextn.enorm", "nextn.hnorm", "nextn.eh_proj",
               (Branch("attn_norm", attention, "mixer"), Branch("post_attention_norm", ffn, "ffn")),
               a.mtp_norm, a.mtp_out)

"""Shapes, tensor lists and per-tensor quantization types for synthetic models (used by `synth.py`).

Everything here is pure bookkeeping: no file is written and no data generated, so the tensor list,
parameter counts and byte totals of a 122B model can be computed in milliseconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ShapeError

T = GGMLQuantizationType
ARCHS = ("qwen35", "qwen35moe", "llama")

# Constants shared by every released Qwen3.5 / Qwen3.6 checkpoint (HF config.json `text_config`):
# head_dim 256, linear_key_head_dim = linear_value_head_dim = 128, linear_conv_kernel_dim 4,
# full_attention_interval 4, partial_rotary_factor 0.25, rope_theta 1e7, rms_norm_eps 1e-6,
# max_position_embeddings 262144, vocab_size 248320, mrope_section [11, 11, 10].
_QWEN = dict(n_vocab=248320, head_dim=256, ssm_d_state=128, ssm_d_conv=4, ssm_n_group=16,
             full_attention_interval=4, rope_frac=0.25, rope_theta=1e7, rms_eps=1e-6,
             context_length=262144, tied=False)

# Published shapes. Sources (all agree where they overlap):
#  [A] p-doom/omegalax omegalax/models/qwen3_5/config.py `_QWEN3_5_SPECS` (a port that loads the HF checkpoints;
#      per size: hidden, layers, heads, kv heads, intermediate, linear value heads, tie_word_embeddings)
#  [B] THUDM/slime scripts/models/qwen3.5-{0.8B,27B,35B-A3B}.sh (Megatron args of the same checkpoints)
#  [C] HF config.json copies quoted in public code (e.g. a simulator's KNOWN_MODEL_METADATA for Qwen/Qwen3.5-35B-A3B,
#      Qwen3.6-35B-A3B, Qwen3.5-397B-A17B; an NPU test script's config for Qwen3.5-122B-A10B; a Qwen3.5-0.8B config)
#  [D] llama.cpp src/models/qwen35*.cpp model-type switch (0.8B/2B: 24 layers, 4B/9B: 32, 27B: 64, 35B-A3B: 40,
#      122B-A10B: 48, 397B-A17B: 60) and model pages (apxml.com) for 122B-A10B (3072 hidden, 32/2 heads).
# Cross-check: HF parameter counts quoted for the checkpoints (0.8B: 852,985,920 incl. the 12-layer vision tower;
# 2B: 2,213,241,664 incl. vision; MTP block sizes 20,452,864 / 60,828,160) match these shapes; so does
# general.parameter_count = 35,505,251,456 of a 35B-A3B GGUF (trunk + 1 MTP block).
SHAPES: dict[str, dict] = {
    # [A][B][C][D]; tied embeddings [A][C]
    "0.8b": dict(arch="qwen35", n_embd=1024, n_layer=24, n_head=8, n_head_kv=2, n_ff=3584,
                 ssm_dt_rank=16, tied=True),
    # [A][D]; n_ff 6144 and 8/2 heads also follow from the HF MTP block size (60,828,160)
    "2b": dict(arch="qwen35", n_embd=2048, n_layer=24, n_head=8, n_head_kv=2, n_ff=6144,
               ssm_dt_rank=16, tied=True),
    # [A][D]; a published Qwen3_5ForCausalLM config with hidden 2560 has the same numbers
    "4b": dict(arch="qwen35", n_embd=2560, n_layer=32, n_head=16, n_head_kv=4, n_ff=9216,
               ssm_dt_rank=32, tied=True),
    # [A][D]; hidden 4096 / intermediate 12288 also in a fine-tune's config.json (ComActor-9B); untied per [A]
    "9b": dict(arch="qwen35", n_embd=4096, n_layer=32, n_head=16, n_head_kv=4, n_ff=12288,
               ssm_dt_rank=32, tied=False),
    # [A][B][C][D]
    "27b": dict(arch="qwen35", n_embd=5120, n_layer=64, n_head=24, n_head_kv=4, n_ff=17408,
                ssm_dt_rank=48, tied=False),
    # [A][B][C][D]; Qwen3.6-35B-A3B has the same config [C]
    "35b-a3b": dict(arch="qwen35moe", n_embd=2048, n_layer=40, n_head=16, n_head_kv=2, ssm_dt_rank=32,
                    n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, tied=False),
    # [A][C][D]
    "122b-a10b": dict(arch="qwen35moe", n_embd=3072, n_layer=48, n_head=32, n_head_kv=2, ssm_dt_rank=64,
                      n_expert=256, n_expert_used=8, n_ff_exp=1024, n_ff_shexp=1024, tied=False),
    # [A][C][D] (not asked for, but cheap)
    "397b-a17b": dict(arch="qwen35moe", n_embd=4096, n_layer=60, n_head=32, n_head_kv=2, ssm_dt_rank=64,
                      n_expert=512, n_expert_used=10, n_ff_exp=1024, n_ff_shexp=1024, tied=False),
}

# Hugging Face config names accepted in custom shapes, mapped to ours.
HF_ALIASES = {
    "vocab_size": "n_vocab", "hidden_size": "n_embd", "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head", "num_key_value_heads": "n_head_kv", "intermediate_size": "n_ff",
    "linear_num_key_heads": "ssm_n_group", "linear_num_value_heads": "ssm_dt_rank",
    "linear_key_head_dim": "ssm_d_state", "linear_value_head_dim": "ssm_d_state",
    "linear_conv_kernel_dim": "ssm_d_conv", "num_experts": "n_expert", "num_experts_per_tok": "n_expert_used",
    "moe_intermediate_size": "n_ff_exp", "shared_expert_intermediate_size": "n_ff_shexp",
    "tie_word_embeddings": "tied", "partial_rotary_factor": "rope_frac", "max_position_embeddings": "context_length",
    "rms_norm_eps": "rms_eps",
}
_COMMON_KEYS = ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "rms_eps", "rope_theta",
                "context_length", "tied")
_KEYS = {
    "llama": _COMMON_KEYS + ("n_ff",),
    "qwen35": _COMMON_KEYS + ("n_ff", "rope_frac", "ssm_d_state", "ssm_d_conv", "ssm_n_group", "ssm_dt_rank",
                              "full_attention_interval"),
    "qwen35moe": _COMMON_KEYS + ("rope_frac", "ssm_d_state", "ssm_d_conv", "ssm_n_group", "ssm_dt_rank",
                                 "full_attention_interval", "n_expert", "n_expert_used", "n_ff_exp", "n_ff_shexp"),
}
_FLOAT_KEYS = ("rms_eps", "rope_theta", "rope_frac")
_MAX_INT_KEY = (1 << 31) - 1
QUANTS = {  # name -> (default ggml type, llama_ftype value written to general.file_type)
    "q4_k_m": (T.Q4_K, 15), "q8_0": (T.Q8_0, 7), "q4_0": (T.Q4_0, 2), "f16": (T.F16, 1), "f32": (T.F32, 0),
}


def list_shapes() -> dict[str, dict]:
    """Published shapes by name: {name: {"arch": ..., hyperparameters...}} with all defaults filled in."""
    return {name: {"arch": s["arch"], **resolve_shape(s["arch"], name)} for name, s in SHAPES.items()}


def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ShapeError(f"unknown synthetic architecture {arch!r}; valid: {', '.join(ARCHS)}")
    return arch


def check_quant(quant: str) -> str:
    q = str(quant).lower()
    if q not in QUANTS:
        raise ShapeError(f"unknown synthetic quantization {quant!r}; valid: {', '.join(QUANTS)}")
    return q


def resolve_shape(arch: str, shape: str | dict) -> dict:
    """Hyperparameters of `shape` (a published name or a custom dict) for `arch`, defaults filled in, validated.

    A custom dict uses the keys of `_KEYS[arch]` (or HF config names, see HF_ALIASES) and may name a published
    shape as {"base": "35b-a3b", ...} to override a few fields (e.g. fewer layers)."""
    check_arch(arch)
    if isinstance(shape, str):
        key = shape.lower().removeprefix("qwen3.5-").removeprefix("qwen3.6-")
        if key not in SHAPES:
            raise ShapeError(f"unknown synthetic shape {shape!r}; valid: {', '.join(SHAPES)} "
                             "(or a dict of hyperparameters)")
        user = {"base": key}
    elif isinstance(shape, dict):
        user = dict(shape)
    else:
        raise ShapeError(f"shape must be a name or a dict, not {type(shape).__name__}")
    hp: dict = dict(_QWEN) if arch != "llama" else dict(n_vocab=32000, rms_eps=1e-5, rope_theta=10000.0,
                                                         context_length=4096, tied=False)
    base = user.pop("base", None)
    if base is not None:
        b = str(base).lower()
        if b not in SHAPES:
            raise ShapeError(f"unknown base shape {base!r}; valid: {', '.join(SHAPES)}")
        if SHAPES[b]["arch"] != arch:
            raise ShapeError(f"shape {b!r} is a {SHAPES[b]['arch']} shape, not {arch}; "
                             f"{arch} shapes: {', '.join(n for n, s in SHAPES.items() if s['arch'] == arch) or 'none'}")
        hp.update({k: v for k, v in SHAPES[b].items() if k != "arch"})
    valid = _KEYS[arch]
    for k, v in user.items():
        k2 = HF_ALIASES.get(k, k)
        if k2 not in valid:
            raise ShapeError(f"unknown {arch} shape key {k!r}; valid: {', '.join(valid)} (or 'base')")
        hp[k2] = v
    return _validate(arch, hp)


def _validate(arch: str, hp: dict) -> dict:
    need = [k for k in ("n_embd", "n_layer", "n_head") if k not in hp]
    need += [k for k in (("n_ff",) if arch != "qwen35moe" else ("n_expert", "n_expert_used", "n_ff_exp"))
             if k not in hp]
    if need:
        raise ShapeError(f"custom {arch} shape lacks {', '.join(need)}")
    hp.setdefault("n_head_kv", hp["n_head"])
    hp.setdefault("head_dim", hp["n_embd"] // hp["n_head"])
    if arch == "qwen35moe":
        hp.setdefault("n_ff_shexp", hp["n_ff_exp"])
    if arch != "llama":
        hp.setdefault("ssm_dt_rank", hp["ssm_n_group"])
    for k in list(hp):
        v = hp[k]
        if k == "tied":  # a real boolean: bool("false") would be True
            if not isinstance(v, bool):
                raise ShapeError(f"shape key 'tied' must be true or false, got {v!r}")
        elif k in _FLOAT_KEYS:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ShapeError(f"shape key {k!r} must be a positive finite number, got {v!r}")
            hp[k] = float(v)
        else:  # at most what the GGUF's 32-bit metadata fields and numpy's indices hold
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v > _MAX_INT_KEY:
                raise ShapeError(f"shape key {k!r} must be a positive integer at most {_MAX_INT_KEY}, got {v!r}")
    if hp.get("rope_frac", 1.0) > 1:
        raise ShapeError(f"shape key 'rope_frac' must be at most 1 (a fraction of head_dim), got {hp['rope_frac']!r}")
    if hp["n_head"] % hp["n_head_kv"]:
        raise ShapeError(f"n_head {hp['n_head']} is not a multiple of n_head_kv {hp['n_head_kv']}")
    if arch != "llama":
        if hp["ssm_dt_rank"] % hp["ssm_n_group"]:
            raise ShapeError(f"ssm_dt_rank (linear value heads) {hp['ssm_dt_rank']} is not a multiple of "
                             f"ssm_n_group (linear key heads) {hp['ssm_n_group']}")
        hp["n_rot"] = int(hp["head_dim"] * hp["rope_frac"])
        if hp["n_rot"] < 2 or hp["n_rot"] % 2:
            raise ShapeError(f"head_dim {hp['head_dim']} x rope_frac {hp['rope_frac']} must give an even n_rot >= 2")
    else:
        hp["n_rot"] = hp["head_dim"]
    if arch == "qwen35moe" and hp["n_expert_used"] > hp["n_expert"]:
        raise ShapeError(f"n_expert_used {hp['n_expert_used']} exceeds n_expert {hp['n_expert']}")
    return hp


def is_gdn(arch: str, hp: dict, il: int) -> bool:
    return arch != "llama" and (il + 1) % hp["full_attention_interval"] != 0


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write. `ne` is ggml order (fastest first). `init` says how its values are made."""

    name: str
    ne: tuple[int, ...]
    init: str  # "weight" | "norm" | "ssm_a" | "ssm_dt" | "conv" | "small"
    layer: int = -1

    @property
    def n_elements(self) -> int:
        n = 1
        for x in self.ne:
            n *= x
        return n


def tensor_specs(arch: str, hp: dict) -> list[TensorSpec]:
    """The tensors of a model of this shape, in writing order (embeddings, blocks 0..n-1, output, then the MTP block
    n where hp["n_mtp"] asks for it)."""
    D, V, hd = hp["n_embd"], hp["n_vocab"], hp["head_dim"]
    H, Hkv = hp["n_head"], hp["n_head_kv"]
    out = [TensorSpec("token_embd.weight", (D, V), "weight")]
    n_mtp = int(hp.get("n_mtp", 0)) if arch != "llama" else 0
    for il in range(hp["n_layer"] + n_mtp):
        p = f"blk.{il}."
        w = lambda n, ne, init="weight", p=p, il=il: out.append(TensorSpec(p + n, ne, init, il))
        mtp = il >= hp["n_layer"]
        if mtp:  # the MTP block (llama.cpp's converter: mtp.fc / pre_fc_norm_* / norm renamed to nextn.*)
            w("nextn.eh_proj.weight", (2 * D, D))
            w("nextn.enorm.weight", (D,), "norm")
            w("nextn.hnorm.weight", (D,), "norm")
            w("nextn.shared_head_norm.weight", (D,), "norm")
        w("attn_norm.weight", (D,), "norm")
        if arch == "llama":
            w("attn_q.weight", (D, H * hd))
            w("attn_k.weight", (D, Hkv * hd))
            w("attn_v.weight", (D, Hkv * hd))
            w("attn_output.weight", (H * hd, D))
            w("ffn_norm.weight", (D,), "norm")
        elif not mtp and is_gdn(arch, hp, il):
            dk, Hk, Hv = hp["ssm_d_state"], hp["ssm_n_group"], hp["ssm_dt_rank"]
            C = 2 * Hk * dk + Hv * dk
            w("attn_qkv.weight", (D, C))
            w("attn_gate.weight", (D, Hv * dk))
            w("ssm_conv1d.weight", (hp["ssm_d_conv"], C), "conv")
            w("ssm_dt.bias", (Hv,), "ssm_dt")
            w("ssm_a", (Hv,), "ssm_a")
            w("ssm_beta.weight", (D, Hv))
            w("ssm_alpha.weight", (D, Hv))
            w("ssm_norm.weight", (dk,), "norm")
            w("ssm_out.weight", (Hv * dk, D))
        else:
            w("attn_q.weight", (D, 2 * H * hd))
            w("attn_k.weight", (D, Hkv * hd))
            w("attn_v.weight", (D, Hkv * hd))
            w("attn_output.weight", (H * hd, D))
            w("attn_q_norm.weight", (hd,), "norm")
            w("attn_k_norm.weight", (hd,), "norm")
        if arch != "llama":
            w("post_attention_norm.weight", (D,), "norm")
        if arch == "qwen35moe":
            E, Fe, Fs = hp["n_expert"], hp["n_ff_exp"], hp["n_ff_shexp"]
            w("ffn_gate_inp.weight", (D, E), "small")
            w("ffn_gate_exps.weight", (D, Fe, E))
            w("ffn_up_exps.weight", (D, Fe, E))
            w("ffn_down_exps.weight", (Fe, D, E))
            w("ffn_gate_inp_shexp.weight", (D,), "small")
            w("ffn_gate_shexp.weight", (D, Fs))
            w("ffn_up_shexp.weight", (D, Fs))
            w("ffn_down_shexp.weight", (Fs, D))
        else:
            w("ffn_gate.weight", (D, hp["n_ff"]))
            w("ffn_up.weight", (D, hp["n_ff"]))
            w("ffn_down.weight", (hp["n_ff"], D))
    out.append(TensorSpec("output_norm.weight", (D,), "norm"))
    if not hp["tied"]:
        out.append(TensorSpec("output.weight", (D, V), "weight"))
    # the MTP block last: the trunk and head draw the same random values with the block as without it
    return [s for s in out if s.layer < hp["n_layer"]] + [s for s in out if s.layer >= hp["n_layer"]]


def param_counts(arch: str, hp: dict) -> tuple[int, int]:
    """(total, active) parameter counts. Active counts `n_expert_used` routed experts per MoE layer."""
    total = active = 0
    for s in tensor_specs(arch, hp):
        n = s.n_elements
        total += n
        active += n * hp["n_expert_used"] // hp["n_expert"] if "_exps." in s.name else n
    return total, active


# ---- per-tensor types: a port of llama.cpp src/llama-quant.cpp (vendored in llama-cpp-python 0.3.36) ----------
# tensor_allows_quantization(): only >= 2-D tensors whose name ends in "weight", minus *_norm.weight,
#   ffn_gate_inp.weight and ssm_conv1d; those keep the converter's type (F32 here).
# llama_tensor_get_type_impl(), the rules a Q4_K_M (default Q4_K) / Q4_0 / Q8_0 file reaches without imatrix:
#   - output.weight (and token_embd.weight when the model has no output.weight): Q8_0 if ne[0] is not a multiple
#     of the default type's block size, else Q6_K unless the default is already Q8_0.
#   - attn_v / attn_qkv (GDN qkv included; category "attn_v-like"): Q4_K_M -> Q6_K when use_more_bits(i, n), with
#     i counting those tensors in llama.cpp's tensor order (by layer number); n_expert == 8 -> Q8_0 (any ftype).
#   - attn_k: n_expert == 8 -> Q8_0.  attn_output: n_expert == 8 and Q4_K_M -> Q5_K.
#   - ffn_down* (also _exps, _shexp): Q4_K_M -> Q6_K when use_more_bits(layer, n_layer).
#   - everything else the default type. F16/F32 files: every quantizable tensor gets the default type.
# tensor_type_fallback(): ne[0] not a multiple of the block size -> Q4_K->Q5_0, Q5_K->Q5_1, Q6_K->Q8_0,
#   and F16 if even that block (32) does not divide ne[0].
# The Qwen3.5 MoE releases have 256 experts, so the n_expert == 8 rules (Q8_0 attention k/v/qkv, Q5_K attention
# output) do NOT apply to them in this llama.cpp version.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def block_size(qtype: int) -> int:
    return GGML_QUANT_SIZES[T(qtype)][0]


def tensor_nbytes(qtype: int, ne: tuple[int, ...]) -> int:
    bs, ts = GGML_QUANT_SIZES[T(qtype)]
    n = 1
    for x in ne:
        n *= x
    return n // bs * ts


def allows_quantization(s: TensorSpec) -> bool:
    n = s.name
    n_dims = max([i + 1 for i, x in enumerate(s.ne) if x > 1], default=1)  # ggml_n_dims
    return (n_dims >= 2 and n.endswith("weight") and "_norm.weight" not in n
            and "ffn_gate_inp.weight" not in n and "ssm_conv1d" not in n)


def _layer_order(s: TensorSpec) -> tuple[int, str]:
    return (s.layer, s.name)  # llama_model_loader::weight_name_comparer: layer number, then name


def check_tensor_types(tensor_types) -> list[tuple[re.Pattern, int]]:
    """llama-quantize's --tensor-type overrides: (regex, type name) pairs, in order, as compiled patterns and ggml
    types; a ShapeError names a bad pattern or a type without synthetic blocks."""
    from ..format.quant import SUPPORTED_TYPES

    out = []
    for item in tensor_types or ():
        try:
            pat, name = item
        except (TypeError, ValueError):
            raise ShapeError(f"a tensor type override is (pattern, type), got {item!r}") from None
        try:
            rx = re.compile(str(pat))
        except re.error as e:
            raise ShapeError(f"bad tensor type pattern {pat!r}: {e}") from None
        t = getattr(T, str(name).upper(), None)
        if t is None or int(t) not in SUPPORTED_TYPES or t in (T.F32, T.F16, T.BF16):
            ok = ", ".join(T(q).name.lower() for q in sorted(SUPPORTED_TYPES) if q not in (T.F32, T.F16, T.BF16))
            raise ShapeError(f"tensor type override {pat}={name}: {name!r} is not a quantized type here ({ok})")
        out.append((rx, int(t)))
    return out


def assign_types(arch: str, hp: dict, quant: str, specs: list[TensorSpec], tensor_types=()) -> dict[str, int]:
    """ggml type per tensor name, as llama.cpp's quantizer picks it from an F32 source for this `quant`, with
    llama-quantize's --tensor-type overrides (`tensor_types`: (regex, type name) pairs; the first pattern found
    in a quantizable tensor's name sets its type, and that tensor then takes no part in the mix's rules)."""
    default, _ = QUANTS[check_quant(quant)]
    quantized = default not in (T.F16, T.F32)  # an F16/F32 file: every quantizable tensor gets the default
    manual = check_tensor_types(tensor_types)
    n_expert = hp.get("n_expert", 0) if arch == "qwen35moe" else 0
    n_layer = hp["n_layer"]
    has_output = any(s.name == "output.weight" for s in specs)
    attn_v_like = lambda n: "attn_v.weight" in n or "attn_qkv.weight" in n
    n_wv = sum(1 for s in specs if attn_v_like(s.name))
    i_wv = i_down = 0
    types: dict[str, int] = {}
    for s in sorted(specs, key=_layer_order):
        name = s.name
        if not allows_quantization(s):
            types[name] = T.F32
            continue
        t = default
        hit = next((q for rx, q in manual if rx.search(name)), None) if quantized else None
        if hit is not None:
            t = hit
        elif quantized:
            if name == "output.weight" or (not has_output and name == "token_embd.weight"):
                if s.ne[0] % block_size(default):
                    t = T.Q8_0
                elif default != T.Q8_0:
                    t = T.Q6_K
            elif name == "token_embd.weight":
                pass
            elif attn_v_like(name):
                if quant == "q4_k_m" and use_more_bits(i_wv, n_wv):
                    t = T.Q6_K
                if n_expert == 8:
                    t = T.Q8_0
                i_wv += 1
            elif "attn_k.weight" in name:
                if n_expert == 8:
                    t = T.Q8_0
            elif "attn_output.weight" in name:
                if n_expert == 8 and quant == "q4_k_m":
                    t = T.Q5_K
            elif "ffn_down" in name:
                il = s.layer if n_expert > 1 else i_down
                if quant == "q4_k_m" and use_more_bits(il, n_layer):
                    t = T.Q6_K
                i_down += 1
        if quantized and s.ne[0] % block_size(t):  # tensor_type_fallback, overrides too
            t = _FALLBACK.get(t, t)
            if s.ne[0] % block_size(t):
                t = T.F16
        types[name] = t
    return types

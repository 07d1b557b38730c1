"""HF (transformers) -> GGUF converter for tiny test models, written from docs/gguf-qwen35.md §1-§2.

Supports `Qwen3_5ForCausalLM` (arch `qwen35`), `Qwen3_5MoeForCausalLM` (`qwen35moe`) and
`LlamaForCausalLM` (`llama`). It produces the same tensors llama.cpp's own converter would:

- qwen35*: `+1` on every `*norm.weight` except `linear_attn.norm.weight`; `ssm_a = -exp(A_log)`;
  `dt_bias -> ssm_dt.bias`; conv1d squeezed to `[C, K]`; value heads reordered from grouped
  (HF head m uses key head m // r) to tiled order (GGUF head j holds HF head (j % H_k)*r + j // H_k)
  in attn_qkv's V rows, attn_gate, ssm_beta, ssm_alpha, ssm_dt.bias, ssm_a, conv1d's V channels and
  ssm_out's input columns; MoE experts stacked `(E, F, D)` with HF's fused gate_up split gate-first;
  the shared-expert gate stays `{D, 1}`.
- llama: q_proj/k_proj rows permuted the way llama.cpp's `LlamaModel.permute` does (HF checkpoints
  rotate halves; llama.cpp's llama graph uses NORM rope, i.e. adjacent pairs, on permuted weights).

No vocabulary is written: `tokenizer.ggml.model = "none"` plus `{arch}.vocab_size`, which makes
llama.cpp create `n_vocab` dummy tokens and take token ids directly.

Output types: `outtype="f32"` writes everything F32; `"f16"` writes 2-D+ matrices F16 except the ones
llama.cpp keeps F32 (norms, ssm_conv1d, ffn_gate_inp, ffn_gate_inp_shexp) and 1-D tensors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["convert_hf", "reorder_v_heads", "llama_permute", "hf_arch_of"]

_ARCH_BY_MODEL_TYPE = {
    "qwen3_5_text": "qwen35",
    "qwen3_5": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_5_moe": "qwen35moe",
    "llama": "llama",
}


# --------------------------------------------------------------------------------------------- helpers


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _text_config(config: Any) -> Any:
    if not isinstance(config, Mapping) and hasattr(config, "get_text_config"):
        return config.get_text_config()
    if isinstance(config, Mapping) and isinstance(config.get("text_config"), Mapping):
        return config["text_config"]
    return config


def _rope_params(config: Any) -> dict:
    rp = dict(_cfg(config, "rope_parameters", None) or {})
    legacy = _cfg(config, "rope_scaling", None) or {}
    for key in ("mrope_section", "mrope_interleaved", "rope_type"):
        if key not in rp and key in legacy:
            rp[key] = legacy[key]
    if "rope_theta" not in rp and _cfg(config, "rope_theta") is not None:
        rp["rope_theta"] = _cfg(config, "rope_theta")
    if "partial_rotary_factor" not in rp and _cfg(config, "partial_rotary_factor") is not None:
        rp["partial_rotary_factor"] = _cfg(config, "partial_rotary_factor")
    return rp


def hf_arch_of(config: Any) -> str:
    """GGUF architecture name for an HF config (object or dict)."""
    mt = _cfg(_text_config(config), "model_type", None)
    if mt not in _ARCH_BY_MODEL_TYPE:
        raise ValueError(f"unsupported HF model_type {mt!r} (supported: {sorted(_ARCH_BY_MODEL_TYPE)})")
    return _ARCH_BY_MODEL_TYPE[mt]


def _to_numpy(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):  # torch tensor, without importing torch
        t = t.detach().cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        t = t.numpy()
    return np.asarray(t, dtype=np.float32)


def _normalize_names(sd: Mapping[str, Any]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, t in sd.items():
        n = name
        if n.startswith("model.language_model."):
            n = "model." + n[len("model.language_model.") :]
        elif n.startswith("language_model.model."):
            n = "model." + n[len("language_model.model.") :]
        elif n.startswith("language_model.lm_head."):
            n = n[len("language_model.") :]
        if n.startswith(("model.visual.", "visual.", "mtp.")) or "rotary_emb" in n:
            continue  # vision tower, MTP head and buffers are not converted
        out[n] = _to_numpy(t)
    return out


def reorder_v_heads(x: np.ndarray, axis: int, n_k: int, n_v: int, head_dim: int) -> np.ndarray:
    """Value heads grouped by key head (HF) -> tiled order (GGUF) along `axis` (n_v*head_dim long).

    GGUF head j = i*n_k + k holds HF head k*r + i (r = n_v // n_k), so GGUF head j uses key head j % n_k.
    """
    r = n_v // n_k
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    assert x.shape[0] == n_v * head_dim, (x.shape, n_v, head_dim)
    y = x.reshape(n_k, r, head_dim, *rest).swapaxes(0, 1).reshape(n_v * head_dim, *rest)
    return np.ascontiguousarray(np.moveaxis(y, 0, axis))


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: per head, rows [x0..x_{h/2-1}, y0..] -> [x0, y0, x1, y1, ...]."""
    y = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(y.reshape(w.shape))


# --------------------------------------------------------------------------------------------- tensor maps


def _qwen35_tensors(sd: dict[str, np.ndarray], cfg: Any, arch: str, reorder: bool) -> list[tuple[str, np.ndarray]]:
    n_layer = int(_cfg(cfg, "num_hidden_layers"))
    n_k = int(_cfg(cfg, "linear_num_key_heads"))
    n_v = int(_cfg(cfg, "linear_num_value_heads"))
    dk = int(_cfg(cfg, "linear_key_head_dim"))
    dv = int(_cfg(cfg, "linear_value_head_dim"))
    do_reorder = reorder and n_k != n_v
    rv = (lambda x, axis, hd: reorder_v_heads(x, axis, n_k, n_v, hd)) if do_reorder else (lambda x, axis, hd: x)

    def norm(name: str) -> np.ndarray:  # zero-centred HF RMSNorm -> plain weight
        return sd.pop(name) + np.float32(1.0)

    out: list[tuple[str, np.ndarray]] = [("token_embd.weight", sd.pop("model.embed_tokens.weight"))]
    out.append(("output_norm.weight", norm("model.norm.weight")))
    tied = bool(_cfg(cfg, "tie_word_embeddings", False))
    if "lm_head.weight" in sd:
        w = sd.pop("lm_head.weight")
        if not tied:
            out.append(("output.weight", w))

    for i in range(n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out.append((b + "attn_norm.weight", norm(p + "input_layernorm.weight")))
        out.append((b + "post_attention_norm.weight", norm(p + "post_attention_layernorm.weight")))
        if p + "linear_attn.in_proj_qkv.weight" in sd:
            la = p + "linear_attn."
            qkv = sd.pop(la + "in_proj_qkv.weight")
            qk = 2 * n_k * dk
            out.append((b + "attn_qkv.weight", np.concatenate([qkv[:qk], rv(qkv[qk:], 0, dv)], axis=0)))
            out.append((b + "attn_gate.weight", rv(sd.pop(la + "in_proj_z.weight"), 0, dv)))
            out.append((b + "ssm_beta.weight", rv(sd.pop(la + "in_proj_b.weight"), 0, 1)))
            out.append((b + "ssm_alpha.weight", rv(sd.pop(la + "in_proj_a.weight"), 0, 1)))
            out.append((b + "ssm_dt.bias", rv(sd.pop(la + "dt_bias"), 0, 1)))
            out.append((b + "ssm_a", rv(-np.exp(sd.pop(la + "A_log")), 0, 1)))
            conv = sd.pop(la + "conv1d.weight")
            conv = conv.reshape(conv.shape[0], conv.shape[-1])  # [C, 1, K] -> [C, K]
            out.append((b + "ssm_conv1d.weight", np.concatenate([conv[:qk], rv(conv[qk:], 0, dv)], axis=0)))
            if la + "conv1d.bias" in sd:
                raise ValueError("conv1d bias is not supported by the qwen35 GGUF layout")
            out.append((b + "ssm_norm.weight", sd.pop(la + "norm.weight")))  # gated norm: no +1
            out.append((b + "ssm_out.weight", rv(sd.pop(la + "out_proj.weight"), 1, dv)))
        else:
            sa = p + "self_attn."
            out.append((b + "attn_q.weight", sd.pop(sa + "q_proj.weight")))  # [q, gate] per head, not permuted
            out.append((b + "attn_k.weight", sd.pop(sa + "k_proj.weight")))
            out.append((b + "attn_v.weight", sd.pop(sa + "v_proj.weight")))
            out.append((b + "attn_output.weight", sd.pop(sa + "o_proj.weight")))
            out.append((b + "attn_q_norm.weight", norm(sa + "q_norm.weight")))
            out.append((b + "attn_k_norm.weight", norm(sa + "k_norm.weight")))
        m = p + "mlp."
        if arch == "qwen35":
            out.append((b + "ffn_gate.weight", sd.pop(m + "gate_proj.weight")))
            out.append((b + "ffn_up.weight", sd.pop(m + "up_proj.weight")))
            out.append((b + "ffn_down.weight", sd.pop(m + "down_proj.weight")))
        else:
            n_exp = int(_cfg(cfg, "num_experts"))
            out.append((b + "ffn_gate_inp.weight", sd.pop(m + "gate.weight")))
            if m + "experts.gate_up_proj" in sd:
                gu = sd.pop(m + "experts.gate_up_proj")  # [E, 2F, D], gate first
                f = gu.shape[1] // 2
                gate, up = gu[:, :f], gu[:, f:]
                down = sd.pop(m + "experts.down_proj")  # [E, D, F]
            else:  # per-expert checkpoints
                gate, up, down = (
                    np.stack([sd.pop(f"{m}experts.{e}.{w}.weight") for e in range(n_exp)])
                    for w in ("gate_proj", "up_proj", "down_proj")
                )
            out.append((b + "ffn_gate_exps.weight", np.ascontiguousarray(gate)))
            out.append((b + "ffn_up_exps.weight", np.ascontiguousarray(up)))
            out.append((b + "ffn_down_exps.weight", np.ascontiguousarray(down)))
            out.append((b + "ffn_gate_inp_shexp.weight", sd.pop(m + "shared_expert_gate.weight")))  # [1, D]
            out.append((b + "ffn_gate_shexp.weight", sd.pop(m + "shared_expert.gate_proj.weight")))
            out.append((b + "ffn_up_shexp.weight", sd.pop(m + "shared_expert.up_proj.weight")))
            out.append((b + "ffn_down_shexp.weight", sd.pop(m + "shared_expert.down_proj.weight")))
    return out


def _llama_tensors(sd: dict[str, np.ndarray], cfg: Any) -> list[tuple[str, np.ndarray]]:
    n_layer = int(_cfg(cfg, "num_hidden_layers"))
    n_head = int(_cfg(cfg, "num_attention_heads"))
    n_kv = int(_cfg(cfg, "num_key_value_heads", None) or n_head)
    out: list[tuple[str, np.ndarray]] = [("token_embd.weight", sd.pop("model.embed_tokens.weight"))]
    out.append(("output_norm.weight", sd.pop("model.norm.weight")))
    if "lm_head.weight" in sd:
        w = sd.pop("lm_head.weight")
        if not bool(_cfg(cfg, "tie_word_embeddings", False)):
            out.append(("output.weight", w))
    for i in range(n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out.append((b + "attn_norm.weight", sd.pop(p + "input_layernorm.weight")))
        out.append((b + "ffn_norm.weight", sd.pop(p + "post_attention_layernorm.weight")))
        out.append((b + "attn_q.weight", llama_permute(sd.pop(p + "self_attn.q_proj.weight"), n_head)))
        out.append((b + "attn_k.weight", llama_permute(sd.pop(p + "self_attn.k_proj.weight"), n_kv)))
        out.append((b + "attn_v.weight", sd.pop(p + "self_attn.v_proj.weight")))
        out.append((b + "attn_output.weight", sd.pop(p + "self_attn.o_proj.weight")))
        out.append((b + "ffn_gate.weight", sd.pop(p + "mlp.gate_proj.weight")))
        out.append((b + "ffn_up.weight", sd.pop(p + "mlp.up_proj.weight")))
        out.append((b + "ffn_down.weight", sd.pop(p + "mlp.down_proj.weight")))
    return out


# --------------------------------------------------------------------------------------------- metadata


def _write_metadata(w: Any, cfg: Any, arch: str, n_vocab: int) -> None:
    n_layer = int(_cfg(cfg, "num_hidden_layers"))
    n_head = int(_cfg(cfg, "num_attention_heads"))
    d = int(_cfg(cfg, "hidden_size"))
    hd = int(_cfg(cfg, "head_dim", None) or d // n_head)
    rp = _rope_params(cfg)
    w.add_name(f"hybridinfer-convert-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(int(_cfg(cfg, "max_position_embeddings", 4096)))
    w.add_embedding_length(d)
    w.add_head_count(n_head)
    w.add_head_count_kv(int(_cfg(cfg, "num_key_value_heads", None) or n_head))
    w.add_layer_norm_rms_eps(float(_cfg(cfg, "rms_norm_eps", 1e-6)))
    w.add_rope_freq_base(float(rp.get("rope_theta", 10000.0)))
    w.add_vocab_size(n_vocab)
    if arch == "llama":
        w.add_feed_forward_length(int(_cfg(cfg, "intermediate_size")))
        w.add_rope_dimension_count(hd)
        w.add_key_length(hd)
        w.add_value_length(hd)
        return
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(int(hd * float(rp.get("partial_rotary_factor", 0.25))))
    sections = list(rp.get("mrope_section") or [11, 11, 10])[:4]
    w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    n_v = int(_cfg(cfg, "linear_num_value_heads"))
    w.add_ssm_conv_kernel(int(_cfg(cfg, "linear_conv_kernel_dim")))
    w.add_ssm_state_size(int(_cfg(cfg, "linear_key_head_dim")))
    w.add_ssm_group_count(int(_cfg(cfg, "linear_num_key_heads")))
    w.add_ssm_time_step_rank(n_v)
    w.add_ssm_inner_size(n_v * int(_cfg(cfg, "linear_value_head_dim")))
    layer_types = _cfg(cfg, "layer_types", None)
    interval = int(_cfg(cfg, "full_attention_interval", None) or 4)
    if layer_types is not None:
        if len(layer_types) != n_layer:
            raise ValueError(f"layer_types has {len(layer_types)} entries, expected {n_layer}")
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in layer_types])
    w.add_full_attention_interval(interval)
    if arch == "qwen35":
        w.add_feed_forward_length(int(_cfg(cfg, "intermediate_size")))
    else:
        w.add_expert_count(int(_cfg(cfg, "num_experts")))
        w.add_expert_used_count(int(_cfg(cfg, "num_experts_per_tok")))
        w.add_expert_feed_forward_length(int(_cfg(cfg, "moe_intermediate_size")))
        w.add_expert_shared_feed_forward_length(int(_cfg(cfg, "shared_expert_intermediate_size")))


_KEEP_F32 = re.compile(r"(norm\.weight|ssm_conv1d\.weight|ffn_gate_inp\.weight|ffn_gate_inp_shexp\.weight)$")


def convert_hf(
    model_or_state_dict: Any,
    config: Any,
    out_path: str | os.PathLike[str],
    *,
    outtype: str = "f32",
    reorder_v_heads: bool = True,
) -> None:
    """Write a GGUF for an HF Qwen3.5 / Qwen3.5-MoE / Llama causal LM (module or state dict).

    `config` may be None for a module (then `model.config` is used). `reorder_v_heads=False` skips the
    qwen35 value-head reorder: a deliberately WRONG file, used only to prove the oracle tests are sensitive to it.
    """
    import gguf

    if outtype not in ("f32", "f16"):
        raise ValueError(f"outtype must be 'f32' or 'f16', got {outtype!r}")
    if hasattr(model_or_state_dict, "state_dict"):
        if config is None:
            config = model_or_state_dict.config
        sd_in = model_or_state_dict.state_dict()
    else:
        sd_in = model_or_state_dict
    if config is None:
        raise ValueError("config is required when converting a bare state dict")
    cfg = _text_config(config)
    arch = hf_arch_of(config)
    sd = _normalize_names(sd_in)
    n_vocab = int(sd["model.embed_tokens.weight"].shape[0])
    if arch == "llama":
        tensors = _llama_tensors(sd, cfg)
    else:
        tensors = _qwen35_tensors(sd, cfg, arch, reorder_v_heads)
    if sd:
        raise ValueError(f"unconverted tensors: {sorted(sd)[:10]}{' ...' if len(sd) > 10 else ''}")

    writer = gguf.GGUFWriter(os.fspath(out_path), arch)
    _write_metadata(writer, cfg, arch, n_vocab)
    ftype = gguf.LlamaFileType.ALL_F32 if outtype == "f32" else gguf.LlamaFileType.MOSTLY_F16
    writer.add_file_type(int(ftype))
    writer.add_tokenizer_model("none")
    for name, data in tensors:
        data = np.ascontiguousarray(data, dtype=np.float32)
        if outtype == "f16" and data.ndim >= 2 and not _KEEP_F32.search(name):
            data = data.astype(np.float16)
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

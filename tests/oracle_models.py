"""Oracle side of the test suite: tiny random HF models, their GGUFs and reference logits.

Not a test file; tests import it (``from oracle_models import ...`` with tests/ on sys.path, which
pytest's rootdir-relative import mode provides, or ``from tests.oracle_models import ...``).

Two sizes per architecture (``qwen35``, ``qwen35moe``, ``llama``):

- ``wide=False`` (default, the F32 oracle): D=64, hd=16, FFN 128 (MoE: 6 experts top-3, F_e=F_s=32),
  GDN H_k=2 < H_v=6 (r=3, d_k=d_v=16), 4 layers G,G,G,A, H=4/H_kv=2, partial rotary 0.5 (n_rot 8),
  interleaved M-RoPE sections [2,1,1]; llama: 2 layers, same attention shape, full rotary.
- ``wide=True`` (used for the quantized variants): every matrix row length (ne[0]) is a multiple of
  256, so llama.cpp's K-quants (256-wide super-blocks) apply instead of falling back to Q5_0/Q8_0/F16.
  D=256, hd=64 (H=4, H*hd=256), partial rotary 0.25 (n_rot 16, sections [3,3,2]), GDN H_k=2 < H_v=8
  (r=4, d_k=d_v=32, value dim 256), FFN 512 (MoE F_e=F_s=256).

Weights are drawn with unit-gain std 1/sqrt(fan_in) (much larger than HF's 0.02 default), norms random
around 1, A_log and dt_bias spread out, the LM head scaled so max |logit| is a few units: the logits
are not flat, and any layout mistake moves them by O(1).

GGUFs: ``make_oracle_gguf`` writes our converter's F32 file (tests/oracles/convert_hf.py) and, for
``quant="q8_0"|"q4_k_m"``, re-quantizes that file with llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize``). Files are cached by name inside ``dir``: pass a per-session
directory (e.g. ``tmp_path_factory.mktemp("oracle")``).

What llama.cpp's quantizer picks for the wide shapes (no fallbacks): q8_0 -> every matrix Q8_0
(token_embd and output included); q4_k_m -> Q4_K, with Q6_K for output.weight, attn_v (qwen35*),
and some layers' attn_qkv / ffn_down(_exps/_shexp) / attn_v (llama). Norms, ssm_a, ssm_dt.bias,
ssm_conv1d, ffn_gate_inp and ffn_gate_inp_shexp stay F32; ssm_alpha/ssm_beta ARE quantized.
Quantized files are far from the F32 logits on these random models (llama.cpp q vs F32, 72 tokens:
rel. rms 0.045 / 0.058 / 0.017 for q8_0 and 0.39 / 0.41 / 0.15 for q4_k_m on qwen35 / qwen35moe /
llama), so compare a quantized file only against llama.cpp on the same file, never against HF.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

ARCHS = ("qwen35", "qwen35moe", "llama")
QUANTS = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
VOCAB = 256
HEAD_GAIN = 1.5  # LM head std = HEAD_GAIN / sqrt(D)


def _layer_types(n: int) -> list[str]:
    """Qwen3.5's pattern (three GDN layers, then full attention), ending on attention when n < 4."""
    return ["full_attention" if (i + 1) % 4 == 0 or (n < 4 and i == n - 1) else "linear_attention"
            for i in range(n)]


def tiny_config(arch: str, *, wide: bool = False, tied: bool = False, layers: int | None = None):
    """transformers config of the tiny (or, with ``wide``, K-quant-compatible) model for ``arch``;
    ``layers`` overrides the depth (default 4 for qwen, 2 for llama)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    d, hd, ffn = (256, 64, 512) if wide else (64, 16, 128)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=d,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hd,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            **common,
            intermediate_size=ffn,
            num_hidden_layers=layers or 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    qwen = dict(
        common,
        num_hidden_layers=layers or 4,
        layer_types=_layer_types(layers or 4),
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=8 if wide else 6,
        linear_key_head_dim=32 if wide else 16,
        linear_value_head_dim=32 if wide else 16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1.0e7,
            "partial_rotary_factor": 0.25 if wide else 0.5,
            "mrope_section": [3, 3, 2] if wide else [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    if arch == "qwen35":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**qwen, intermediate_size=ffn)
    from transformers import Qwen3_5MoeTextConfig

    f_e = 256 if wide else 32
    return Qwen3_5MoeTextConfig(
        **qwen,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=f_e,
        shared_expert_intermediate_size=f_e,
    )


def _randomize(model, arch: str, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    d = model.config.hidden_size
    tied = bool(model.config.tie_word_embeddings)

    def randn(shape):
        return torch.randn(tuple(shape), generator=gen, dtype=torch.float32)

    def unif(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(tuple(shape), generator=gen, dtype=torch.float32)

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            s = p.shape
            if name.endswith("A_log"):
                v = torch.log(unif(s, 0.05, 2.0))
            elif name.endswith("dt_bias"):
                v = unif(s, -1.5, 1.0)
            elif name.endswith("linear_attn.norm.weight") or (arch == "llama" and name.endswith("norm.weight")):
                v = 1.0 + 0.2 * randn(s)  # plain-weight norms
            elif name.endswith("norm.weight"):
                v = 0.2 * randn(s)  # zero-centred Qwen3.5 RMSNorm: scale = 1 + w
            elif name.endswith("conv1d.weight"):
                v = randn(s) / s[-1] ** 0.5
            elif name.endswith("embed_tokens.weight"):
                v = randn(s) * (HEAD_GAIN / d**0.5 if tied else 1.0)
            elif name == "lm_head.weight":
                v = randn(s) * HEAD_GAIN / d**0.5
            elif p.ndim == 3:  # stacked experts [E, out, in]
                v = randn(s) / s[-1] ** 0.5
            elif p.ndim == 2:  # nn.Linear [out, in]; routers get a wider spread so routing is decisive
                gain = 2.0 if name.endswith("mlp.gate.weight") else 1.0
                v = randn(s) * gain / s[-1] ** 0.5
            else:
                v = 0.1 * randn(s)
            p.copy_(v)
    if tied:
        model.tie_weights()


def build_tiny_hf(arch: str, seed: int = 0, *, wide: bool = False, tied: bool = False, layers: int | None = None):
    """Tiny random transformers model (float32, eval mode, eager attention, torch GDN fallback)."""
    import torch
    import transformers

    cfg = tiny_config(arch, wide=wide, tied=tied, layers=layers)
    cls = {
        "qwen35": transformers.Qwen3_5ForCausalLM,
        "qwen35moe": transformers.Qwen3_5MoeForCausalLM,
        "llama": transformers.LlamaForCausalLM,
    }[arch]
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    _randomize(model, arch, seed)
    return model


def hf_logits(model, ids) -> np.ndarray:
    """transformers logits for every position of one sequence: (n, vocab) float32."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().cpu().numpy().astype(np.float32)


def oracle_ids(n: int = 72, seed: int = 1234, vocab: int = VOCAB) -> list[int]:
    """A reproducible random token sequence (default 72 tokens: crosses the 64-token GDN chunk)."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, size=n)]


def gguf_name(arch: str, seed: int, quant: str | None = None, *, wide: bool = False, tied: bool = False,
              layers: int | None = None) -> str:
    depth = f"-L{layers}" if layers else ""
    return f"{arch}{'-wide' if wide else ''}{'-tied' if tied else ''}{depth}-s{seed}-{quant or 'f32'}.gguf"


def quantize_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], quant: str, nthread: int = 2) -> None:
    """Re-quantize a GGUF with llama.cpp's own quantizer (``quant`` in QUANTS)."""
    import ctypes

    import llama_cpp

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {sorted(QUANTS)}, got {quant!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTS[quant])
    params.nthread = nthread
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {quant}) failed with {rc}")


def make_oracle_gguf(
    arch: str,
    dir: str | os.PathLike[str],
    seed: int = 0,
    quant: str | None = None,
    *,
    wide: bool | None = None,
    tied: bool = False,
    layers: int | None = None,
) -> Path:
    """Path of the oracle GGUF for (arch, seed[, quant]), created in ``dir`` unless already there.

    F32: our converter on ``build_tiny_hf(arch, seed, wide=wide, tied=tied)``. Quantized: that F32
    file re-quantized by llama.cpp. ``wide`` defaults to True for quantized variants (K-quants need
    256-wide rows; see the module docstring) and False for F32.
    """
    from oracles.convert_hf import convert_hf

    if wide is None:
        wide = quant is not None
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    out = d / gguf_name(arch, seed, quant, wide=wide, tied=tied, layers=layers)
    if out.exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if quant is None:
        convert_hf(build_tiny_hf(arch, seed, wide=wide, tied=tied, layers=layers), None, tmp, outtype="f32")
    else:
        src = make_oracle_gguf(arch, d, seed, None, wide=wide, tied=tied, layers=layers)
        quantize_gguf(src, tmp, quant)
    os.replace(tmp, out)
    return out


def gguf_tensor_types(path: str | os.PathLike[str]) -> dict[str, str]:
    """{tensor name: ggml type name} of a GGUF file (e.g. to see what llama.cpp's quantizer chose)."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(os.fspath(path)).tensors}


def llama_logits(gguf_path: str | os.PathLike[str], ids, *, batch: bool = True, n_threads: int = 2) -> np.ndarray:
    """llama.cpp logits (via llama-cpp-python) for every position: (n, vocab) float32.

    ``batch=True``: one prefill of all tokens (one ubatch). ``batch=False``: one token per decode
    call. The KV cache is F32 (``type_k``/``type_v``) so only the arithmetic differs from transformers.
    """
    import llama_cpp

    ids = [int(t) for t in ids]
    n = len(ids)
    n_b = max(n, 1) if batch else 1
    llm = llama_cpp.Llama(
        model_path=os.fspath(gguf_path),
        n_ctx=max(64, n + 8),
        n_batch=n_b,
        n_ubatch=n_b,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        seed=0,
        verbose=False,
    )
    try:
        llm.eval(ids)
        scores = np.array(llm.scores[:n], dtype=np.float32, copy=True)
    finally:
        llm.close()
    return scores


def llama_greedy(llm, ids, n: int, stop_ids) -> list[int]:
    """llama.cpp's greedy continuation of `ids` (up to `n` tokens, ending before a stop id) on a llama_cpp.Llama made
    with F32 K/V (type_k=type_v=0, as this engine keeps them)."""
    llm.reset()
    out: list[int] = []
    for t in llm.generate(list(ids), temp=0.0, top_k=1, reset=True):
        if t in stop_ids or len(out) == n:
            break
        out.append(int(t))
    return out

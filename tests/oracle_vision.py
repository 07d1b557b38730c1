"""A tiny random-weight `Qwen3_5ForConditionalGeneration` (transformers) and its GGUFs, for the vision tower's
oracle tests: the mmproj written by llama.cpp's own converter (`convert_hf_to_gguf.py --mmproj`, F32) from a
checkpoint folder saved at test time (safetensors, config.json, preprocessor_config.json), and the text model by
tests/oracles/convert_hf.py (F32, no vocabulary: llama.cpp's converter would need a real tokenizer, and the text
side is that converter's twin, tested in test_oracle_convert.py).

`LlamaCppRounding` puts llama.cpp's F16 roundings (docs/vision.md, Traps) into a tower's ops: an option of the
oracle tests, so they can hold this engine's tower to llama.cpp's mtmd; the engine's own path follows transformers.

Not a test file. Weights are unit-gain (std 1/sqrt(fan_in)), norms and biases random, so a layout mistake moves
the embeddings by O(1)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # unequal per channel


def converter_path() -> str | None:
    """The llama.cpp tree holding convert_hf_to_gguf.py: the installed llama-cpp-python's source distribution
    (llama_src.source_dir), or HYBRIDINFER_LLAMA_CPP_SRC."""
    from llama_src import source_dir

    return source_dir()


def tiny_vl_config(out_hidden: int = 64, depth: int = 2, hidden: int = 32, heads: int = 2, pos_side: int = 8):
    from transformers import Qwen3_5Config

    text = dict(vocab_size=256, hidden_size=out_hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=depth, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=heads, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=out_hidden,
                  num_position_embeddings=pos_side * pos_side)
    return Qwen3_5Config(text_config=text, vision_config=vision)


def build_tiny_vl(seed: int = 0, **kw):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(tiny_vl_config(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias") or "pos_embed" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    return model


def make_vl_files(d: str | os.PathLike[str], seed: int = 0, **kw) -> dict:
    """{'model': HF model, 'mmproj': path, 'text': path} in folder d (made once: files already there are reused)."""
    d = Path(d)
    tag = f"s{seed}" + "".join(f"_{k}{v}" for k, v in sorted(kw.items()))
    model = build_tiny_vl(seed, **kw)
    mmproj, text, ck = d / f"mmproj-{tag}.gguf", d / f"text-{tag}.gguf", d / f"ck-{tag}"
    if not mmproj.exists():
        model.save_pretrained(ck, safe_serialization=True)
        (ck / "preprocessor_config.json").write_text(json.dumps(
            {"image_mean": list(MEAN), "image_std": list(STD), "patch_size": 16, "temporal_patch_size": 2,
             "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}))
        src = converter_path()
        if src is None:
            raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py is not here (HYBRIDINFER_LLAMA_CPP_SRC)")
        from llama_src import convert

        tmp = mmproj.with_suffix(".part")
        convert(src, str(ck), str(tmp), "f32", "--mmproj")
        tmp.rename(mmproj)
    if not text.exists():
        from oracles.convert_hf import convert_hf

        convert_hf(model, None, text.with_suffix(".part"), outtype="f32")
        text.with_suffix(".part").rename(text)
    return {"model": model, "mmproj": str(mmproj), "text": str(text)}


def hf_processor(min_pixels: int, max_pixels: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=list(MEAN),
                                    image_std=list(STD), min_pixels=min_pixels, max_pixels=max_pixels)


def hf_embeddings(model, pixel_values: np.ndarray, grid_thw) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(pixel_values), grid_thw=torch.tensor([list(grid_thw)]))
    return out.pooler_output.float().numpy()


def sample_image(w: int, h: int, seed: int = 0):
    """A smooth random RGB image (gradients plus noise), so resampling has real work."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx / max(w - 1, 1), yy / max(h - 1, 1), (xx + yy) / max(w + h - 2, 1)], -1) * 200
    img = np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(img, "RGB")


# ---- llama.cpp's roundings (an option of the test path only: the engine follows transformers) -------------------

def f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def ggml_gelu(x: np.ndarray) -> np.ndarray:
    """ggml's CPU GELU on F32 (ggml-cpu/vec.h, GGML_GELU_FP16): 0 at x <= -10, x at x >= 10, else the input
    rounded to F16 and looked up in a table of F16 values of the tanh form, whose entries are computed in float32
    with `1 + a·x·x` contracted to an FMA (as the compiler builds ggml_gelu_f32: the plain order misses entries at
    F16 rounding ties) and tanhf correctly rounded."""
    x = np.asarray(x, np.float32)
    xi = f16(x)
    ax = np.float32(0.044715) * xi
    inner = (ax.astype(np.float64) * xi + 1.0).astype(np.float32)  # fma(a·x, x, 1): one rounding
    arg = (np.float32(0.79788456080286535587989211986876) * xi) * inner
    th = np.tanh(arg.astype(np.float64)).astype(np.float32)
    y = f16((np.float32(0.5) * xi) * (np.float32(1) + th))
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, y)).astype(np.float32)


class LlamaCppRounding:
    """A tower's ops (backends/vision.RefVisionOps or a subclass) with llama.cpp's F16 roundings on the CPU
    (docs/vision.md, Traps): the patch embedding's Conv2D goes through ggml_im2col into F16 (ggml_conv_2d asks for
    F16 unless the kernel is BF16, whatever the kernel's type), so the product sees the pixels and the kernel both
    rounded to F16; every GELU (the blocks' and the merger's) is ggml's tanh form through its F16 table.

    forced_gelus: llama.cpp's own GELU outputs, in the tower's order (blocks, then the merger), returned instead of
    computing them. An F16 rounding turns a float32 difference of ~1e-7 (another summation order) at an input lying
    at a rounding tie into a whole F16 step (5e-4 relative); with llama.cpp's outputs at those steps what is left to
    compare is the continuous arithmetic between them."""

    def __init__(self, ops, forced_gelus=None):
        self._ops = ops
        self._patch_w = None
        self._forced = list(forced_gelus) if forced_gelus is not None else None

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        if name != "v.patch_embd":
            return self._ops.linear(x, name)
        if self._patch_w is None:
            self._patch_w = f16(self._ops.matrix(name))
        return f16(x) @ self._patch_w.T + self._ops.vector(name + ".bias")

    def gelu_tanh(self, x: np.ndarray) -> np.ndarray:
        if self._forced is None:
            return ggml_gelu(x)
        y = self._forced.pop(0).reshape(x.shape)
        return y.astype(np.float32)

    gelu_erf = gelu_tanh

    def linear_gelu(self, x: np.ndarray, name: str, kind: str) -> np.ndarray:
        # the ops' fused product and GELU, taken apart so that the GELU is llama.cpp's (tanh for both kinds)
        return self.gelu_tanh(self.linear(x, name))


def with_llama_cpp_rounding(encoder, forced_gelus=None):
    """encoder (backends/vision.VisionEncoder, or the engine's CachedImageEncoder around one) computing with
    LlamaCppRounding from now on."""
    enc = getattr(encoder, "encoder", encoder)
    enc.ops = LlamaCppRounding(getattr(enc.ops, "_ops", enc.ops), forced_gelus)
    return encoder


def gelu_names(n_layer: int) -> list[str]:
    """clip.cpp's names of the tower's GELU outputs in order: each block's, then the merger's."""
    return [f"ffn_gelu-{i}" for i in range(n_layer)] + ["ffn_gelu"]

"""A synthetic `qwen3vl_merger` mmproj (the layout llama.cpp's converter writes for Qwen3.5, docs/vision.md) with
random weights, for timing the vision tower without a download; and a tiny text model of a chosen width with a
vocabulary, which llama.cpp's libmtmd needs beside an mmproj.

Qwen3.5's published vision shape (every released size: depth 27, width 1152, 16 heads, MLP 4304, patch 16,
merge 2, a 48 x 48 position table) is `QWEN35_VISION`; only the projector's output width follows the text model.
Weights are unit-gain normal (std 1/sqrt(fan_in)) so activations stay finite at depth; norms near 1."""

from __future__ import annotations

import os

import numpy as np

from ..errors import ShapeError

QWEN35_VISION = {"depth": 27, "hidden": 1152, "heads": 16, "ff": 4304, "patch": 16, "merge": 2, "pos_side": 48}
MEAN_STD = [0.5, 0.5, 0.5]  # Qwen3.5's preprocessor_config.json


def synth_mmproj(path: str | os.PathLike[str], out_dim: int, shape: dict | None = None, dtype: str = "f16",
                 seed: int = 0) -> dict:
    """Write the mmproj; `shape` overrides keys of QWEN35_VISION; dtype "f16" (matrices F16, as released mmproj
    files are), "f32", or "q8_0" (2-D matrices whose rows are whole Q8_0 blocks quantized, as llama.cpp's converter
    writes with --outtype q8_0; the rest F16). Returns the shape written."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    hp = {**QWEN35_VISION, **(shape or {})}
    if dtype not in ("f16", "f32", "q8_0"):
        raise ShapeError(f"mmproj dtype must be f16, f32 or q8_0, got {dtype!r}")
    c, f, p, m, side = hp["hidden"], hp["ff"], hp["patch"], hp["merge"], hp["pos_side"]
    if out_dim < 1 or c % hp["heads"] or (c // hp["heads"]) % 4:
        raise ShapeError(f"vision shape {hp} / out_dim {out_dim} is not valid")
    rng = np.random.default_rng(seed)
    mdt = np.float32 if dtype == "f32" else np.float16
    w = gguf.GGUFWriter(os.fspath(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7}[dtype])
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_uint32("clip.vision.projection_dim", out_dim)
    w.add_uint32("clip.vision.image_size", side * p)
    w.add_uint32("clip.vision.patch_size", p)
    w.add_uint32("clip.vision.embedding_length", c)
    w.add_uint32("clip.vision.feed_forward_length", f)
    w.add_uint32("clip.vision.block_count", hp["depth"])
    w.add_uint32("clip.vision.attention.head_count", hp["heads"])
    w.add_array("clip.vision.image_mean", MEAN_STD)
    w.add_array("clip.vision.image_std", MEAN_STD)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.spatial_merge_size", m)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.is_deepstack_layers", [False] * hp["depth"])

    def mat(name, out, inp, *extra):  # numpy shape [out, inp] (or the conv's [C, 3, p, p])
        shp = (out, *extra) if extra else (out, inp)
        x = rng.standard_normal(shp, dtype=np.float32) / np.sqrt(inp)
        if dtype == "q8_0" and not extra and inp % 32 == 0:
            w.add_tensor(name, quantize(x, Q.Q8_0), raw_shape=quantize(x, Q.Q8_0).shape, raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, x.astype(mdt))

    def vec(name, n, around=0.0, spread=0.1):
        w.add_tensor(name, (around + spread * rng.standard_normal(n)).astype(np.float32))

    for i in range(hp["depth"]):
        b = f"v.blk.{i}."
        mat(b + "attn_qkv.weight", 3 * c, c)
        vec(b + "attn_qkv.bias", 3 * c)
        mat(b + "attn_out.weight", c, c)
        vec(b + "attn_out.bias", c)
        mat(b + "ffn_up.weight", f, c)
        vec(b + "ffn_up.bias", f)
        mat(b + "ffn_down.weight", c, f)
        vec(b + "ffn_down.bias", c)
        for ln in ("ln1", "ln2"):
            vec(b + ln + ".weight", c, 1.0)
            vec(b + ln + ".bias", c)
    mc = c * m * m
    mat("mm.0.weight", mc, mc)
    vec("mm.0.bias", mc)
    mat("mm.2.weight", out_dim, mc)
    vec("mm.2.bias", out_dim)
    vec("v.post_ln.weight", c, 1.0)
    vec("v.post_ln.bias", c)
    vec("v.patch_embd.bias", c)
    mat("v.patch_embd.weight", c, 3 * p * p * 2, 3, p, p)
    mat("v.patch_embd.weight.1", c, 3 * p * p * 2, 3, p, p)
    w.add_tensor("v.position_embd.weight", (0.5 * rng.standard_normal((side * side, c))).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hp


def synth_text_of_width(path: str | os.PathLike[str], n_embd: int) -> None:
    """A 4-layer qwen35 text model of width n_embd with a byte-level vocabulary: what libmtmd loads beside an
    mmproj (it tokenizes the image's marker text); its weights are never used by the tower."""
    from .synth import synth_model

    heads = 4 if n_embd % 256 == 0 else 2
    synth_model(path, "qwen35", {"n_embd": n_embd, "n_layer": 4, "n_head": heads, "n_head_kv": 2,
                                 "head_dim": 64 if n_embd >= 256 else 16, "n_ff": 2 * n_embd, "n_vocab": 512,
                                 "ssm_d_state": 16, "ssm_n_group": 2, "ssm_dt_rank": 4}, quant="f32")

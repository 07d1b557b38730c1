"""Synthetic GGUF models: the published Qwen3.5/3.6 shapes (or any custom shape) filled with random but valid data.

Shapes, not values, decide speed, so a file with the exact published tensor shapes and the per-tensor type mix of
llama.cpp's Q4_K_M benchmarks honestly. Values are random: quantized blocks (`quant.random_blocks`) carry random
quants with sane fp16 scales (weights of std ~0.02), norms are near 1, `ssm_a` is negative, so a forward pass gives
finite logits.
Routing over random weights is close to uniform (the worst case for expert caching).

Such a model is chaotic at depth: the token embeddings (std 0.02) are tiny next to what each layer adds, so every
layer's output is dominated by its own branch, and a last-bit difference (a flipped activation rounding, a different
expert picked) grows through 40 layers until two correct engines disagree on most top-1 tokens. `residual_scale=S`
makes the file behave like a trained, depth-scaled network instead (GPT-2 / DeepNet initialisation): token
embeddings of unit std (the residual stream starts at RMS ~1), every other matrix and router at unit gain (std
1/sqrt(fan_in)), except the matrices that end a residual branch (attn_output, ssm_out, ffn_down, ffn_down_exps,
ffn_down_shexp) at S/sqrt(fan_in), so each layer only nudges the stream; a tied model's final norm takes the
1/sqrt(n_embd) its head's weights would have had. `depth_scale(n_layer)` = 1/sqrt(2 n_layer) is the usual S
(`synth --residual-scale auto`): the layers then add about as much to the stream as the embedding holds.

The file is streamed: header, metadata and tensor infos first, then each tensor's bytes, generated from a small
per-type pool of random blocks read at random offsets. Memory stays bounded (a few tens of MB) for any size.

    synth_model("/tmp/q35.gguf", "qwen35moe", "35b-a3b", quant="q4_k_m")
    synth_model(p, "qwen35", {"n_embd": 256, "n_layer": 4, "n_head": 4, "n_head_kv": 2, "head_dim": 64,
                              "n_ff": 512, "n_vocab": 512, "ssm_d_state": 64, "ssm_n_group": 2, "ssm_dt_rank": 4})
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from struct import error as struct_error

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, TokenType

from ..errors import ShapeError
from ..format.quant import random_blocks
from ..format.tokenizer import bytes_to_unicode
from .synth_shapes import (
    QUANTS,
    SHAPES,
    TensorSpec,
    assign_types,
    check_arch,
    check_quant,
    param_counts,
    resolve_shape,
    tensor_nbytes,
    tensor_specs,
)
from .synth_shapes import list_shapes as list_shapes  # re-exported for the CLI

T = GGMLQuantizationType
SIGMA = 0.02  # target std of every weight matrix's values
POOL_BYTES = 8 << 20  # random data kept per ggml type; tensors are windows into it at random offsets

EMBED_STD = 1.0  # token embeddings' std with residual_scale: a unit-RMS residual stream
# the matrices that end a residual branch (their output is added to the stream)
_BRANCH_OUT = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
               "ffn_down_shexp.weight")

__all__ = ["synth_model", "list_shapes", "plan_model", "depth_scale", "SHAPES", "QUANTS"]


def depth_scale(n_layer: int) -> float:
    """The residual-branch scale of GPT-2 / DeepNet-style initialisation: 1/sqrt(2 n_layer) (two branches a
    layer), so the stream's variance grows by a bounded total over the whole depth."""
    return 1.0 / math.sqrt(2 * n_layer)


def check_residual_scale(s) -> float | None:
    if s is None:
        return None
    if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or not 0 < s <= 1:
        raise ShapeError(f"residual_scale must be a number in (0, 1], got {s!r}")
    return float(s)


def weight_std(s: TensorSpec, residual_scale: float | None) -> float:
    """Target std of a weight matrix's values (module docstring); ne[0] is the fan-in."""
    if residual_scale is None:
        return SIGMA
    if s.name == "token_embd.weight":
        return EMBED_STD
    gain = residual_scale if s.layer >= 0 and s.name.split(".", 2)[2] in _BRANCH_OUT else 1.0
    return gain / math.sqrt(s.ne[0])


def _small_gain(s: TensorSpec, hp: dict, residual_scale: float | None) -> float:
    """Factor on _small_values' draws: routers and the shared-expert gate at unit gain, and a tied head's final
    norm scaled as its head would have been, when depth-scaled."""
    if residual_scale is None:
        return 1.0
    if s.init == "small":
        return 1.0 / (math.sqrt(s.ne[0]) * SIGMA)
    if s.name == "output_norm.weight" and hp["tied"]:
        return 1.0 / (math.sqrt(hp["n_embd"]) * EMBED_STD)
    return 1.0


# Qwen3.5 special tokens at their real ids (docs/gguf-qwen35.md §6); tiny vocabularies put them at the end instead.
_SPECIALS = [("<|endoftext|>", 248044, TokenType.CONTROL), ("<|im_start|>", 248045, TokenType.CONTROL),
             ("<|im_end|>", 248046, TokenType.CONTROL), ("<think>", 248068, TokenType.USER_DEFINED),
             ("</think>", 248069, TokenType.USER_DEFINED)]
# the vision tokens an image-text prompt holds (`<|vision_start|>`, one `<|image_pad|>` per image token,
# `<|vision_end|>`): at their Qwen3.5 ids; tiny vocabularies put them just below the others (which keep their ids)
_VISION = [("<|vision_start|>", 248053, TokenType.CONTROL), ("<|vision_end|>", 248054, TokenType.CONTROL),
           ("<|image_pad|>", 248056, TokenType.CONTROL)]
_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
           "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}")


def plan_model(arch: str, shape: str | dict, quant: str = "q4_k_m", n_vocab: int | None = None,
               tensor_types=(), mtp: bool = False) -> dict:
    """Everything about the file except its data: hyperparameters, tensors with types and sizes, counts.
    tensor_types: llama-quantize's --tensor-type overrides, (regex, type name) pairs (synth_shapes.assign_types).
    mtp: also the multi-token-prediction block (qwen35 / qwen35moe: hp["n_mtp"] = 1, block n_layer, the layout
    llama.cpp's converter writes; docs/gguf-qwen35.md §2).

    Returns {"hp", "tensors": [(TensorSpec, qtype, nbytes)], "params", "active_params", "data_bytes",
    "types": {type name: count}, "type_bytes": {type name: bytes}}."""
    check_arch(arch)
    quant = check_quant(quant)
    hp = resolve_shape(arch, shape)
    if n_vocab is not None:
        hp["n_vocab"] = int(n_vocab)
    hp["n_mtp"] = 1 if mtp and arch != "llama" else 0
    specs = tensor_specs(arch, hp)
    types = assign_types(arch, hp, quant, specs, tensor_types)
    tensors = [(s, types[s.name], tensor_nbytes(types[s.name], s.ne)) for s in specs]
    total, active = param_counts(arch, hp)
    counts: Counter = Counter()
    tbytes: Counter = Counter()
    for _, t, nb in tensors:
        counts[T(t).name] += 1
        tbytes[T(t).name] += nb
    return {"hp": hp, "tensors": tensors, "params": total, "active_params": active,
            "data_bytes": sum(nb for _, _, nb in tensors), "types": dict(counts), "type_bytes": dict(tbytes)}


# ---- random data ---------------------------------------------------------------------------------------------

class _Pool:
    """A few MB of random data of one ggml type, stored twice in a row so any window of up to `units` units
    starting anywhere in the first copy is one contiguous slice."""

    def __init__(self, qtype: int, rng: np.random.Generator, std: float = SIGMA):
        self.unit_bytes = GGML_QUANT_SIZES[T(qtype)][1]
        self.units = max(1, POOL_BYTES // self.unit_bytes)
        data = np.ascontiguousarray(random_blocks(qtype, self.units, rng, std=std), dtype=np.uint8).reshape(-1)
        self.buf = memoryview(np.concatenate([data, data]))

    def write(self, f, nbytes: int, rng: np.random.Generator, bar=None) -> None:
        left = nbytes // self.unit_bytes
        while left:
            n = min(left, self.units)
            off = int(rng.integers(0, self.units)) * self.unit_bytes
            f.write(self.buf[off:off + n * self.unit_bytes])
            left -= n
            if bar is not None:
                bar.update(n * self.unit_bytes)


def _write_zeros(f, nbytes: int, bar=None) -> None:
    """nbytes zero bytes, a pool's size at a time (the writer's memory stays bounded)."""
    zeros = memoryview(bytes(min(nbytes, POOL_BYTES)))
    while nbytes > 0:
        n = min(nbytes, len(zeros))
        f.write(zeros[:n])
        nbytes -= n
        if bar is not None:
            bar.update(n)


def _small_values(s: TensorSpec, rng: np.random.Generator, gain: float = 1.0) -> np.ndarray:
    n = s.n_elements
    if s.init == "norm":  # RMSNorm weights (GGUF norms already include the +1): positive, near 1
        x = rng.uniform(0.9, 1.1, n)
    elif s.init == "ssm_a":  # -exp(A_log): negative
        x = -np.exp(rng.uniform(-1.0, 0.5, n))
    elif s.init == "ssm_dt":
        x = rng.uniform(-0.5, 0.5, n)
    elif s.init == "conv":
        x = rng.normal(0.0, 0.2, n)
    else:  # "small": router weights, shared-expert gate vector
        x = rng.normal(0.0, SIGMA, n)
    return (x * gain if gain != 1.0 else x).astype(np.float32)


# ---- vocabulary ----------------------------------------------------------------------------------------------

def _synthetic_vocab(n_vocab: int) -> dict:
    """Byte-level BPE: the 256 byte tokens, one merge ('Ġ Ġ'), the Qwen special tokens, unique fillers."""
    if n_vocab < 256 + 1 + len(_SPECIALS) + len(_VISION):
        raise ShapeError(f"n_vocab {n_vocab} is too small for a synthetic byte-level vocabulary "
                         f"(at least {256 + 1 + len(_SPECIALS) + len(_VISION)})")
    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + ["ĠĠ"]
    types = [int(TokenType.NORMAL)] * n_vocab
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    ids = {}
    for j, (text, real_id, ttype) in enumerate(_SPECIALS):
        i = real_id if n_vocab > _SPECIALS[-1][1] else n_vocab - len(_SPECIALS) + j
        tokens[i], types[i], ids[text] = text, int(ttype), i
    for j, (text, real_id, ttype) in enumerate(_VISION):
        i = real_id if n_vocab > _SPECIALS[-1][1] else n_vocab - len(_SPECIALS) - len(_VISION) + j
        tokens[i], types[i] = text, int(ttype)
    return {"model": "gpt2", "pre": "qwen35", "tokens": tokens, "token_type": types, "merges": ["Ġ Ġ"],
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "padding_token_id": ids["<|endoftext|>"], "add_bos_token": False, "chat_template": _CHATML}


_BORROW_KEYS = ("model", "pre", "tokens", "token_type", "merges", "scores", "bos_token_id", "eos_token_id",
                "eot_token_id", "eom_token_id", "unknown_token_id", "seperator_token_id", "padding_token_id",
                "add_bos_token", "add_eos_token", "add_space_prefix")


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _read_kv(path: str, prefixes: tuple[str, ...]) -> dict:
    """The metadata of a GGUF whose key starts with one of `prefixes` (a fast reader: gguf.GGUFReader needs
    ~25 s for a 248k-token vocabulary, this ~1 s)."""
    import mmap
    import struct

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise ShapeError(f"vocab_from {path!r} is not a GGUF file")
        n_kv = struct.unpack_from("<Q", mm, 16)[0]
        pos = 24

        def string() -> str:
            nonlocal pos
            n = struct.unpack_from("<Q", mm, pos)[0]
            pos += 8 + n
            return mm[pos - n:pos].decode("utf-8", errors="replace")

        def value(vt: int):
            nonlocal pos
            if vt == 8:
                return string()
            if vt == 9:
                it, n = struct.unpack_from("<IQ", mm, pos)
                pos += 12
                if it == 8:
                    return [string() for _ in range(n)]
                if it in _SCALAR:
                    dt = np.dtype(_SCALAR[it])
                    arr = np.frombuffer(mm, dtype=dt, count=n, offset=pos)
                    pos += n * dt.itemsize
                    return arr.tolist()
                return [value(it) for _ in range(n)]
            fmt = _SCALAR[vt]
            x = struct.unpack_from(fmt, mm, pos)[0]
            pos += struct.calcsize(fmt)
            return x

        out = {}
        for _ in range(n_kv):
            key = string()
            vt = struct.unpack_from("<I", mm, pos)[0]
            pos += 4
            val = value(vt)
            if key.startswith(prefixes):
                out[key] = val
        return out


def _borrowed_vocab(path: str, n_vocab: int | None) -> dict:
    """The tokenizer of another GGUF, padded with unique unused `[PAD{i}]` tokens up to n_vocab."""
    try:
        kv = _read_kv(path, ("tokenizer.",))
    except (OSError, ValueError, struct_error) as e:
        raise ShapeError(f"vocab_from {path!r} is not a readable GGUF: {e}") from e
    v: dict = {k: kv["tokenizer.ggml." + k] for k in _BORROW_KEYS if "tokenizer.ggml." + k in kv}
    if "tokenizer.chat_template" in kv:
        v["chat_template"] = kv["tokenizer.chat_template"]
    if "tokens" not in v:
        raise ShapeError(f"vocab_from {path!r} has no tokenizer.ggml.tokens")
    v.setdefault("pre", "qwen35")
    n = len(v["tokens"])
    n_vocab = n if n_vocab is None else n_vocab
    if n > n_vocab:
        raise ShapeError(f"vocab_from {path!r} has {n} tokens, more than the shape's n_vocab {n_vocab}")
    seen = set(v["tokens"])
    v.setdefault("token_type", [int(TokenType.NORMAL)] * n)
    for i in range(n, n_vocab):
        t = f"[PAD{i}]"
        while t in seen:
            t += "_"
        v["tokens"].append(t)
        v["token_type"].append(int(TokenType.UNUSED))
    if "scores" in v:
        v["scores"] += [0.0] * (n_vocab - n)
    return v


def _add_vocab(w: GGUFWriter, v: dict) -> None:
    for k, val in v.items():
        key = "tokenizer.chat_template" if k == "chat_template" else "tokenizer.ggml." + k
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif k == "scores":
            w.add_key_value(key, [float(x) for x in val], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
        elif k == "token_type":
            w.add_key_value(key, [int(x) for x in val], GGUFValueType.ARRAY, GGUFValueType.INT32)
        elif val:
            w.add_key_value(key, list(val), GGUFValueType.ARRAY, GGUFValueType.STRING)


# ---- metadata ------------------------------------------------------------------------------------------------

def _rope_sections(n_rot: int) -> list[int]:
    t = n_rot // 2  # frequency slots, split T/H/W like [11, 11, 10] for 32
    return [t // 3 + (i < t % 3) for i in range(3)] + [0]


def _add_hparams(w: GGUFWriter, arch: str, hp: dict, name: str, ftype: int) -> None:
    a = arch + "."
    u32 = lambda k, x: w.add_uint32(a + k, int(x))
    w.add_name(name)
    w.add_uint32("general.file_type", ftype)
    w.add_uint32("general.quantization_version", 2)
    u32("block_count", hp["n_layer"] + hp.get("n_mtp", 0))
    u32("context_length", hp["context_length"])
    u32("embedding_length", hp["n_embd"])
    u32("attention.head_count", hp["n_head"])
    u32("attention.head_count_kv", hp["n_head_kv"])
    u32("attention.key_length", hp["head_dim"])
    u32("attention.value_length", hp["head_dim"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", hp["rms_eps"])
    w.add_float32(a + "rope.freq_base", hp["rope_theta"])
    u32("rope.dimension_count", hp["n_rot"])
    u32("vocab_size", hp["n_vocab"])
    if arch != "qwen35moe":
        u32("feed_forward_length", hp["n_ff"])
    if arch == "llama":
        return
    w.add_key_value(a + "rope.dimension_sections", _rope_sections(hp["n_rot"]), GGUFValueType.ARRAY,
                    GGUFValueType.INT32)
    u32("nextn_predict_layers", hp.get("n_mtp", 0))
    u32("full_attention_interval", hp["full_attention_interval"])
    w.add_key_value(a + "attention.recurrent_layers",
                    [(i + 1) % hp["full_attention_interval"] != 0 for i in range(hp["n_layer"])]
                    + [False] * hp.get("n_mtp", 0),  # the MTP block is an attention block
                    GGUFValueType.ARRAY, GGUFValueType.BOOL)
    u32("ssm.conv_kernel", hp["ssm_d_conv"])
    u32("ssm.state_size", hp["ssm_d_state"])
    u32("ssm.group_count", hp["ssm_n_group"])
    u32("ssm.time_step_rank", hp["ssm_dt_rank"])
    u32("ssm.inner_size", hp["ssm_dt_rank"] * hp["ssm_d_state"])
    if arch == "qwen35moe":
        u32("expert_count", hp["n_expert"])
        u32("expert_used_count", hp["n_expert_used"])
        u32("expert_feed_forward_length", hp["n_ff_exp"])
        u32("expert_shared_feed_forward_length", hp["n_ff_shexp"])


# ---- the writer ----------------------------------------------------------------------------------------------

def synth_model(out_path: str | os.PathLike[str], arch: str, shape: str | dict, quant: str = "q4_k_m",
                seed: int = 0, vocab_from: str | None = None, progress: bool = False, tensor_types=(),
                residual_scale: float | None = None, mtp: bool = False, quiet_pads: bool = False) -> dict:
    """Write a synthetic GGUF of `arch` ("qwen35", "qwen35moe", "llama") with `shape` (a published name, see
    list_shapes(), or a dict of hyperparameters) and the per-tensor type mix llama.cpp gives `quant`
    ("q4_k_m", "q8_0", "q4_0", "f16", "f32"). With `vocab_from`, the tokenizer of that GGUF is copied (padded
    with `[PAD{i}]` tokens to the shape's vocabulary size); otherwise a byte-level BPE vocabulary is made.
    `tensor_types`: llama-quantize's --tensor-type overrides, (regex, type name) pairs, the first match wins.
    `residual_scale`: None (default) for the plain random file, chaotic at depth; a number S in (0, 1] for a
    depth-scaled one (module docstring; `depth_scale(n_layer)` is the usual S). `mtp`: with the
    multi-token-prediction block (qwen35 / qwen35moe; ignored for llama), as llama.cpp's converter writes it.
    `quiet_pads` (with `vocab_from`): the padding tokens' rows of the output head and the token embedding are
    zero, so their logits are 0 and greedy output never picks them (the largest of the real tokens' random logits
    is above 0), as a trained model never emits its unused tokens. Without it a random model picks them about as
    often as their share of the vocabulary, and they are no text: a stream's text deltas then each hold several
    tokens (what a serving benchmark's inter-token latency measures between).

    Streams to disk with bounded memory. Returns a summary: path, bytes written, tensor count, type histogram
    (count and bytes per type), parameter counts, seconds and MB/s."""
    t0 = time.perf_counter()
    check_arch(arch)
    quant = check_quant(quant)
    residual_scale = check_residual_scale(residual_scale)
    n_vocab = None
    vocab = None
    if vocab_from is not None:
        user_sets_vocab = not isinstance(shape, dict) or any(k in shape for k in ("n_vocab", "vocab_size", "base"))
        pre = resolve_shape(arch, shape)["n_vocab"] if user_sets_vocab else None
        vocab = _borrowed_vocab(os.fspath(vocab_from), pre)
        n_vocab = len(vocab["tokens"])
    plan = plan_model(arch, shape, quant, n_vocab=n_vocab, tensor_types=tensor_types, mtp=mtp)
    hp = plan["hp"]
    n_real = None
    if vocab is None:
        vocab = _synthetic_vocab(hp["n_vocab"])
    elif quiet_pads:
        types = vocab["token_type"]
        n_real = len(types)
        while n_real and types[n_real - 1] == int(TokenType.UNUSED):  # the padding is the unused tail
            n_real -= 1
    shape_name = shape if isinstance(shape, str) else "custom"
    out_path = os.fspath(out_path)

    w = GGUFWriter(out_path, arch, use_temp_file=False)
    _add_hparams(w, arch, hp, f"synthetic {arch} {shape_name} {quant}", QUANTS[quant][1])
    _add_vocab(w, vocab)
    for s, qt, nb in plan["tensors"]:
        w.add_tensor_info(s.name, tuple(reversed(s.ne)), np.dtype(np.float32), nb, raw_dtype=T(qt))
    rng = np.random.default_rng(seed)
    pools: dict[tuple[int, float], _Pool] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=plan["data_bytes"], unit="B", unit_scale=True, desc=os.path.basename(out_path))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        w.write_padding(f, f.tell())
        for s, qt, nb in plan["tensors"]:
            if s.init == "weight":
                key = (qt, weight_std(s, residual_scale))
                if key not in pools:
                    pools[key] = _Pool(qt, rng, key[1])
                real = nb
                if n_real is not None and s.name in ("output.weight", "token_embd.weight"):
                    real = nb // s.ne[1] * n_real  # rows of the real tokens; the padding's rows stay zero
                pools[key].write(f, real, rng, bar)
                _write_zeros(f, nb - real, bar)
            else:
                if qt != T.F32:
                    raise AssertionError(f"{s.name} should be F32, planned {T(qt).name}")
                f.write(_small_values(s, rng, _small_gain(s, hp, residual_scale)).tobytes())
                if bar is not None:
                    bar.update(nb)
            w.write_padding(f, nb)
        f.flush()
    except BaseException:
        w.close()
        if os.path.exists(out_path):
            os.remove(out_path)
        raise
    finally:
        if bar is not None:
            bar.close()
    w.close()
    dt = time.perf_counter() - t0
    size = os.path.getsize(out_path)
    return {"path": out_path, "arch": arch, "shape": shape_name, "quant": quant, "bytes": size,
            "n_tensors": len(plan["tensors"]), "types": plan["types"], "type_bytes": plan["type_bytes"],
            "params": plan["params"], "active_params": plan["active_params"], "n_vocab": hp["n_vocab"],
            "residual_scale": residual_scale, "mtp": bool(hp["n_mtp"]),
            "seconds": dt, "mb_per_s": size / 1e6 / dt if dt > 0 else float("inf")}

"""hybridinfer.format.gguf_model on valid and malformed files: typed errors whose messages name the bad value.

Every malformed file is made at test time: a small valid GGUF written with gguf.GGUFWriter, then cut or
patched byte by byte.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gq

from hybridinfer.errors import (
    GGUFError,
    MissingMetadataError,
    MissingTensorError,
    NotGGUFError,
    TensorShapeError,
    TruncatedGGUFError,
    UnsupportedTensorTypeError,
)
from hybridinfer.format.gguf_model import GGUFModel
from hybridinfer.format.quant import random_blocks

T = GGMLQuantizationType
F32_DATA = (np.arange(24, dtype=np.float32).reshape(3, 8) - 12) / 7
TOKENS = ["<s>", "hello", "wörld", "日本"]


def _q8_data(rows: int = 4, cols: int = 64) -> np.ndarray:
    return random_blocks(T.Q8_0, rows * cols // 32, np.random.default_rng(0)).reshape(rows, cols // 32 * 34)


def write_gguf(path: Path, *, f32: np.ndarray = F32_DATA, f32_type: str = "F32",
               extra: dict[str, tuple[np.ndarray, int]] | None = None, meta: bool = True) -> Path:
    """A small valid GGUF: metadata of every common kind, an F32 tensor and a Q8_0 one (plus `extra`
    raw tensors: name -> (bytes of shape (rows, row bytes), ggml type))."""
    w = GGUFWriter(str(path), arch="llama")
    if meta:
        w.add_string("general.name", "tiny test")
        w.add_uint32("llama.block_count", 2)
        w.add_int32("test.int32", -5)
        w.add_uint64("test.uint64", 2**40 + 3)
        w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        w.add_float64("test.float64", 0.1)
        w.add_bool("test.bool", True)
        w.add_array("tokenizer.ggml.tokens", TOKENS)
        w.add_array("test.ints", [1, -2, 3])
        w.add_array("test.floats", [0.5, 1.5])
    w.add_tensor("f32.weight", f32.astype(np.float16) if f32_type == "F16" else f32)
    w.add_tensor("q8.weight", _q8_data(), raw_dtype=T.Q8_0)
    for name, (data, qtype) in (extra or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def valid(tmp_path) -> Path:
    return write_gguf(tmp_path / "valid.gguf")


def _cut(src: Path, dst: Path, n: int) -> Path:
    dst.write_bytes(src.read_bytes()[:n])
    return dst


def _string_pos(data: bytes, s: str) -> int:
    """Offset of the GGUF string `s` (8-byte length, then bytes) in the file."""
    b = s.encode()
    i = data.find(struct.pack("<Q", len(b)) + b)
    assert i >= 0, s
    return i


def _patch(src: Path, dst: Path, off: int, new: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[off:off + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def _tensor_info_pos(data: bytes, name: str) -> dict[str, int]:
    """Offsets of the fields of a tensor info: its name, n_dims, type and data offset."""
    i = _string_pos(data, name)
    n_dims_at = i + 8 + len(name.encode())
    (n_dims,) = struct.unpack_from("<I", data, n_dims_at)
    type_at = n_dims_at + 4 + 8 * n_dims
    return {"name": i, "n_dims": n_dims_at, "type": type_at, "offset": type_at + 4, "end": type_at + 12}


# --- valid files ---------------------------------------------------------------------------------------

def test_valid_metadata_values_are_python_values(valid):
    gm = GGUFModel(valid)
    m = gm.metadata
    assert gm.arch == "llama"
    assert m["general.name"] == "tiny test" and isinstance(m["general.name"], str)
    for key, want in [("llama.block_count", 2), ("test.int32", -5), ("test.uint64", 2**40 + 3)]:
        assert m[key] == want and type(m[key]) is int, key
    eps = m["llama.attention.layer_norm_rms_epsilon"]
    assert type(eps) is float and eps == float(np.float32(1e-5))
    assert type(m["test.float64"]) is float and m["test.float64"] == 0.1
    assert m["test.bool"] is True
    assert m["tokenizer.ggml.tokens"] == TOKENS
    assert m["test.ints"] == [1, -2, 3] and all(type(x) is int for x in m["test.ints"])
    assert m["test.floats"] == [0.5, 1.5] and all(type(x) is float for x in m["test.floats"])
    assert gm.meta("test.int32") == -5
    assert gm.meta("no.such.key", 7) == 7
    assert gm.alignment == 32
    assert gm.file_size == valid.stat().st_size


def test_valid_tensors_dequantize(valid):
    gm = GGUFModel(valid)
    assert set(gm.tensors) == {"f32.weight", "q8.weight"}
    t = gm.tensor("f32.weight", ne=(8, 3))
    assert t.type_name == "F32" and t.ne == (8, 3) and t.shape == (3, 8) and t.n_elements == 24
    assert t.offset % gm.alignment == 0 and t.nbytes == 96
    w = gm.dequant("f32.weight")
    assert w.dtype == np.float32 and np.array_equal(w, F32_DATA)
    q = gm.tensor("q8.weight", ne=(64, 4))
    assert q.type_name == "Q8_0" and q.nbytes == 4 * 2 * 34
    assert np.array_equal(q.raw(), _q8_data().reshape(-1))
    w8 = gm.dequant("q8.weight")
    ref = gq.dequantize(_q8_data().reshape(-1), T.Q8_0).reshape(4, 64).astype(np.float32)
    assert w8.dtype == np.float32 and w8.shape == (4, 64) and np.array_equal(w8, ref)
    assert gm.has("q8.weight") and not gm.has("nope")
    # a {D, 1} tensor may be asked for as {D}
    assert gm.tensor("q8.weight", ne=(64, 4, 1)).name == "q8.weight"


def test_f16_tensor_dequantizes(tmp_path):
    gm = GGUFModel(write_gguf(tmp_path / "f16.gguf", f32_type="F16"))
    assert gm.tensor("f32.weight").type_name == "F16"
    assert np.array_equal(gm.dequant("f32.weight"), F32_DATA.astype(np.float16).astype(np.float32))


def test_fingerprint_stable_and_sensitive(tmp_path, valid):
    fp = GGUFModel(valid).fingerprint()
    assert fp == GGUFModel(valid).fingerprint()
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(valid.read_bytes())
    assert GGUFModel(copy).fingerprint() == fp
    other_shape = write_gguf(tmp_path / "shape.gguf", f32=np.zeros((4, 8), np.float32))
    other_type = write_gguf(tmp_path / "type.gguf", f32_type="F16")
    fps = {fp, GGUFModel(other_shape).fingerprint(), GGUFModel(other_type).fingerprint()}
    assert len(fps) == 3


# --- not a GGUF ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"", b"hello, this is text\n", b"GGML\x00\x00\x00\x00", b"GGU", b"\x00" * 64])
def test_not_gguf(tmp_path, content):
    p = tmp_path / "x.gguf"
    p.write_bytes(content)
    with pytest.raises(NotGGUFError, match=re.escape(repr(content[:4]))) as ei:
        GGUFModel(p)
    assert "not a GGUF" in str(ei.value) and str(p) in str(ei.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(GGUFError, match="nonexistent.gguf"):
        GGUFModel(tmp_path / "nonexistent.gguf")
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFModel(tmp_path)


# --- truncated -----------------------------------------------------------------------------------------

def _cut_points(valid: Path) -> list[tuple[str, int, str]]:
    """(where, cut length, text the message must contain)."""
    data = valid.read_bytes()
    gm = GGUFModel(valid)
    tok = _string_pos(data, "tokenizer.ggml.tokens")
    eps = _string_pos(data, "llama.attention.layer_norm_rms_epsilon")
    t0 = _tensor_info_pos(data, "f32.weight")
    t1 = _tensor_info_pos(data, "q8.weight")
    q8 = gm.tensors["q8.weight"]
    f32 = gm.tensors["f32.weight"]
    return [
        ("magic only", 4, "header"),
        ("inside version", 6, "header"),
        ("inside counts", 13, "header"),
        ("end of counts", 24, "metadata entry #0"),
        ("inside a key", eps + 12, "metadata entry #"),
        ("inside a float value", eps + 8 + len("llama.attention.layer_norm_rms_epsilon") + 4 + 2,
         "'llama.attention.layer_norm_rms_epsilon'"),
        ("inside a string array", tok + 8 + len("tokenizer.ggml.tokens") + 4 + 8 + 10, "'tokenizer.ggml.tokens'"),
        ("inside a tensor name", t0["name"] + 10, "tensor info #0"),
        ("inside tensor dims", t0["n_dims"] + 6, "'f32.weight'"),
        ("inside the last tensor offset", t1["end"] - 3, "'q8.weight'"),
        ("start of tensor data", gm.data_offset, "'f32.weight'"),
        ("inside the first tensor", f32.offset + 5, "'f32.weight'"),
        ("inside the last tensor", q8.offset + q8.nbytes // 2, "'q8.weight'"),
        ("last byte of data missing", q8.offset + q8.nbytes - 1, "'q8.weight'"),
    ]


def test_truncated_everywhere(tmp_path, valid):
    for where, n, names in _cut_points(valid):
        p = _cut(valid, tmp_path / f"cut{n}.gguf", n)
        with pytest.raises(TruncatedGGUFError) as ei:
            GGUFModel(p)
        msg = str(ei.value)
        assert "truncated" in msg and f"the file has {n}" in msg, (where, msg)
        assert names in msg, (where, msg)


def test_file_exactly_to_the_end_of_data_opens(tmp_path, valid):
    q8 = GGUFModel(valid).tensors["q8.weight"]
    gm = GGUFModel(_cut(valid, tmp_path / "tight.gguf", q8.offset + q8.nbytes))
    assert np.array_equal(gm.tensor("q8.weight").raw(), _q8_data().reshape(-1))


def test_lengths_and_offsets_past_the_end(tmp_path, valid):
    data = valid.read_bytes()
    tok = _string_pos(data, "tokenizer.ggml.tokens")
    count_at = tok + 8 + len("tokenizer.ggml.tokens") + 4 + 4
    cases = [
        (_string_pos(data, "general.name") + 8 + len("general.name") + 4, struct.pack("<Q", 2**40), "'general.name'"),
        (count_at, struct.pack("<Q", 2**61), "'tokenizer.ggml.tokens'"),
        (_tensor_info_pos(data, "q8.weight")["offset"], struct.pack("<Q", 1 << 30), "'q8.weight'"),
    ]
    for i, (off, new, name) in enumerate(cases):
        with pytest.raises(TruncatedGGUFError, match=name):
            GGUFModel(_patch(valid, tmp_path / f"p{i}.gguf", off, new))


# --- bad types and values ------------------------------------------------------------------------------

@pytest.mark.parametrize("type_id", [99, 4, 0xFFFFFFFF])
def test_unknown_tensor_type_id(tmp_path, valid, type_id):
    data = valid.read_bytes()
    p = _patch(valid, tmp_path / "t.gguf", _tensor_info_pos(data, "q8.weight")["type"], struct.pack("<I", type_id))
    with pytest.raises(UnsupportedTensorTypeError) as ei:
        GGUFModel(p)
    msg = str(ei.value)
    assert "'q8.weight'" in msg and f"type#{type_id}" in msg and str(type_id) in msg


def test_q2_k_tensor_opens_but_cannot_be_read(tmp_path):
    q2 = np.random.default_rng(0).integers(0, 256, (2, 84), dtype=np.uint8)
    gm = GGUFModel(write_gguf(tmp_path / "q2.gguf", extra={"q2.weight": (q2, T.Q2_K)}))
    t = gm.tensors["q2.weight"]
    assert t.type_name == "Q2_K" and t.ne == (256, 2) and t.nbytes == 168
    for call in (lambda: gm.tensor("q2.weight"), lambda: gm.dequant("q2.weight")):
        with pytest.raises(UnsupportedTensorTypeError) as ei:
            call()
        assert "'q2.weight'" in str(ei.value) and "Q2_K" in str(ei.value)
    assert np.array_equal(gm.dequant("f32.weight"), F32_DATA)  # the rest stays usable


def test_missing_tensor_shape_and_metadata(valid):
    gm = GGUFModel(valid)
    with pytest.raises(MissingTensorError, match="'blk.0.attn_q.weight'"):
        gm.tensor("blk.0.attn_q.weight")
    with pytest.raises(MissingTensorError, match="'output.weight'"):
        gm.dequant("output.weight")
    with pytest.raises(TensorShapeError) as ei:
        gm.tensor("f32.weight", ne=(8, 4))
    msg = str(ei.value)
    assert "'f32.weight'" in msg and "[8, 3]" in msg and "[8, 4]" in msg
    with pytest.raises(TensorShapeError, match=r"\[64, 4\].*\[4, 64\]"):
        gm.dequant("q8.weight", ne=(4, 64))
    with pytest.raises(MissingMetadataError, match="'llama.context_length'"):
        gm.meta("llama.context_length")


def test_missing_architecture_key(tmp_path, valid):
    p = _patch(valid, tmp_path / "noarch.gguf", _string_pos(valid.read_bytes(), "general.architecture") + 8,
               b"general.architecturX")
    gm = GGUFModel(p)
    assert gm.meta("general.architecturX") == "llama"
    with pytest.raises(MissingMetadataError, match="'general.architecture'"):
        _ = gm.arch


def test_bad_version_and_alignment(tmp_path, valid):
    with pytest.raises(GGUFError, match="version 7"):
        GGUFModel(_patch(valid, tmp_path / "v.gguf", 4, struct.pack("<I", 7)))
    p = tmp_path / "align.gguf"
    w = GGUFWriter(str(p), arch="llama")
    w.add_uint32("general.alignment", 24)
    w.add_tensor("x", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="alignment.*24"):
        GGUFModel(p)


def test_row_not_whole_blocks(tmp_path, valid):
    data = valid.read_bytes()
    ne0_at = _tensor_info_pos(data, "q8.weight")["n_dims"] + 4
    p = _patch(valid, tmp_path / "row.gguf", ne0_at, struct.pack("<Q", 48))
    with pytest.raises(GGUFError, match=r"'q8.weight'.*Q8_0.*48"):
        GGUFModel(p)


# --- malformed hyperparameters: typed errors naming the key and the value ------------------------------------------

_MOE = dict(n_embd=64, n_layer=4, n_head=2, n_head_kv=1, head_dim=32, n_vocab=300, ssm_d_state=32, ssm_n_group=1,
            ssm_dt_rank=2, n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64)
_LLAMA = dict(n_embd=64, n_layer=2, n_head=2, n_ff=64, n_vocab=300)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model

    d = tmp_path_factory.mktemp("tiny")
    return {"qwen35moe": str(synth_model(d / "moe.gguf", "qwen35moe", _MOE, quant="q8_0")["path"]),
            "llama": str(synth_model(d / "llama.gguf", "llama", _LLAMA, quant="q8_0")["path"])}


M = "qwen35moe."


@pytest.mark.parametrize(
    ("arch", "meta", "error", "pattern"),
    [
        ("qwen35moe", {M + "expert_used_count": 5}, GGUFError, r"expert_used_count = 5 exceeds .*expert_count = 4"),
        ("qwen35moe", {M + "expert_used_count": 0}, GGUFError, r"expert_used_count = 0 must be >= 1"),
        ("qwen35moe", {M + "expert_count": 0}, GGUFError, r"expert_count = 0 must be >= 1"),
        ("qwen35moe", {M + "expert_count": 8, M + "expert_used_count": 2}, TensorShapeError,
         r"expert_count = 8, but tensor 'blk.0.ffn_gate_exps.weight' holds 4 experts"),
        ("qwen35moe", {M + "expert_feed_forward_length": 32}, TensorShapeError,
         r"expert_feed_forward_length = 32, but tensor 'blk.0.ffn_gate_exps.weight'"),
        ("qwen35moe", {M + "attention.head_count": 0}, GGUFError, r"attention.head_count = 0 must be >= 1"),
        ("qwen35moe", {M + "attention.head_count_kv": 0}, GGUFError, r"attention.head_count_kv = 0 must be >= 1"),
        ("qwen35moe", {M + "attention.head_count_kv": 3}, TensorShapeError,
         r"head_count 2 not a multiple of head_count_kv 3"),
        ("qwen35moe", {M + "ssm.time_step_rank": 0}, GGUFError, r"ssm.time_step_rank = 0 must be >= 1"),
        ("qwen35moe", {M + "ssm.group_count": 0}, GGUFError, r"ssm.group_count = 0 must be >= 1"),
        ("qwen35moe", {M + "attention.recurrent_layers": None, M + "full_attention_interval": 0}, GGUFError,
         r"full_attention_interval = 0 must be >= 1"),
        ("qwen35moe", {M + "block_count": "four"}, GGUFError, r"block_count = 'four' is not an integer"),
        ("qwen35moe", {M + "attention.layer_norm_rms_epsilon": -1.0}, GGUFError,
         r"layer_norm_rms_epsilon = -1.0 must be > 0"),
        ("qwen35moe", {M + "rope.freq_base": float("nan")}, GGUFError, r"freq_base = nan is not a finite number"),
        ("qwen35moe", {M + "rope.dimension_count": 7}, GGUFError, r"dimension_count = 7 must be even"),
        ("qwen35moe", {M + "rope.dimension_sections": "2,1,1"}, GGUFError,
         r"dimension_sections = '2,1,1' is not an array of integers"),
        ("llama", {"llama.attention.head_count": 0}, GGUFError, r"llama.attention.head_count = 0 must be >= 1"),
        ("llama", {"llama.attention.head_count_kv": 0}, GGUFError, r"head_count_kv = 0 must be >= 1"),
        ("llama", {"llama.feed_forward_length": 0}, GGUFError, r"feed_forward_length = 0 must be >= 1"),
    ],
)
def test_malformed_hyperparameters(tmp_path, tiny_models, arch, meta, error, pattern):
    from gguf_edit import rewrite

    from hybridinfer.errors import HybridInferError
    from hybridinfer.models import model_args

    p = tmp_path / "bad.gguf"
    rewrite(tiny_models[arch], str(p), meta=meta)
    with pytest.raises(error, match=pattern) as ei:
        model_args(GGUFModel(p))
    assert isinstance(ei.value, HybridInferError) and str(p) in str(ei.value)


def test_tiny_models_are_valid(tiny_models):
    from hybridinfer.models import model_args

    a = model_args(GGUFModel(tiny_models["qwen35moe"]))
    assert (a.n_expert, a.n_expert_used, a.n_ff_exp) == (4, 2, 64)
    assert model_args(GGUFModel(tiny_models["llama"])).n_head == 2


def test_cpu_backend_refuses_more_experts_per_token_than_its_kernels_take(tmp_path):
    """A valid file the native MoE calls cannot run (more than 64 experts a token): a typed error at load, not a
    ValueError in the first forward."""
    from hybridinfer.engine.api import Engine
    from hybridinfer.errors import BackendNotAvailableError
    from hybridinfer.tools.synth import synth_model

    shape = dict(_MOE, n_layer=1, n_expert=66, n_expert_used=65, n_ff_exp=32, n_ff_shexp=32)
    p = str(synth_model(tmp_path / "wide.gguf", "qwen35moe", shape, quant="q8_0")["path"])
    with pytest.raises(BackendNotAvailableError, match="expert_used_count=65"):
        Engine.load(p, backend="cpu", n_ctx=16)
    assert Engine.load(p, backend="reference", n_ctx=16).logits([1, 2]).shape == (2, 300)

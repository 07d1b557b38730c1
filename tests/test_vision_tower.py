"""The Qwen3.5 vision tower (format/image_prep, models/qwen3vl_vision, backends/vision, engine/images) against
transformers' image processor and vision model and llama.cpp's libmtmd, on a tiny random-weight
Qwen3_5ForConditionalGeneration converted at test time by llama.cpp's own converter (tests/oracle_vision.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("PIL")

# the processor's limits for the tiny model: 4 to 64 merged tokens, so a 640x480 image is scaled down
MIN_PX, MAX_PX = 4 * 1024, 64 * 1024


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def simd():
    from hybridinfer.backends.cpu.simd import SimdLib

    lib = SimdLib(os.environ.get("HYBRIDINFER_ISA"), n_threads=2)  # CI's per-level runs: the fused attention or not
    yield lib
    lib.close()


# ---- preprocessing ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hw", [(480, 640), (1, 1), (33, 7), (5000, 300), (40000, 30000), (224, 224), (20, 30)])
def test_smart_resize_equals_transformers(hw):
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf

    from hybridinfer.format.image_prep import QWEN_MAX_PIXELS, QWEN_MIN_PIXELS, smart_resize

    for lo, hi in ((QWEN_MIN_PIXELS, QWEN_MAX_PIXELS), (MIN_PX, MAX_PX)):
        assert smart_resize(*hw, 32, lo, hi) == hf(*hw, factor=32, min_pixels=lo, max_pixels=hi)


def test_aspect_ratio_over_200_is_a_typed_error():
    from hybridinfer.errors import ParameterError
    from hybridinfer.format.image_prep import smart_resize

    with pytest.raises(ParameterError, match="aspect ratio of 1000x4"):
        smart_resize(4, 1000, 32, MIN_PX, MAX_PX)


@pytest.mark.oracle
@pytest.mark.parametrize("wh,limits,grid", [
    ((64, 64), (MIN_PX, MAX_PX), (1, 4, 4)),  # already a multiple: no change of size
    ((100, 75), (MIN_PX, MAX_PX), (1, 4, 6)),  # rounded to multiples of 32
    ((640, 480), (MIN_PX, MAX_PX), (1, 12, 18)),  # beyond max_pixels: scaled down, not refused
    ((30, 20), (65536, 16777216), (1, 14, 20)),  # Qwen3.5's defaults: a tiny image scaled up to min_pixels
])
def test_pixels_equal_transformers_processor(wh, limits, grid):
    pytest.importorskip("transformers")
    from oracle_vision import MEAN, STD, hf_processor, sample_image

    from hybridinfer.format.image_prep import PrepConfig, prepare

    img = sample_image(*wh)
    r = hf_processor(*limits)(images=[img])
    p = prepare(img, PrepConfig(image_mean=MEAN, image_std=STD, min_pixels=limits[0], max_pixels=limits[1]))
    assert p.grid == tuple(int(x) for x in r["image_grid_thw"][0]) == grid
    assert p.patches.dtype == np.float32
    assert np.array_equal(p.patches, r["pixel_values"])  # bit for bit
    assert prepare(img, PrepConfig(image_mean=MEAN, image_std=STD, min_pixels=limits[0],
                                   max_pixels=limits[1])).digest == p.digest
    assert prepare(sample_image(*wh, seed=1), PrepConfig(min_pixels=limits[0], max_pixels=limits[1])).digest != p.digest


# ---- the tower ------------------------------------------------------------------------------------------------

@pytest.mark.oracle
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_tower_equals_transformers(vl, simd, backend):
    """Merged embeddings from the same pixel values as transformers' processor makes, against
    model.visual(...).pooler_output: within 1e-4 relative (measured ~1e-6)."""
    from oracle_vision import hf_embeddings, hf_processor, sample_image

    from hybridinfer.backends.vision import load_image_encoder

    enc = load_image_encoder(vl["mmproj"], 64, simd if backend == "cpu" else None, MIN_PX, MAX_PX)
    for wh in ((100, 75), (640, 480)):
        img = sample_image(*wh, seed=3)
        r = hf_processor(MIN_PX, MAX_PX)(images=[img])
        want = hf_embeddings(vl["model"], r["pixel_values"], r["image_grid_thw"][0])
        got = enc.encode(img)
        t, h, w = (int(x) for x in r["image_grid_thw"][0])
        assert got.grid == (t, h // 2, w // 2) and got.n_tokens == want.shape[0]
        assert _rel(got.rows, want) <= 1e-4
    enc.close()


@pytest.fixture(scope="module")
def mtmd(vl):
    """llama.cpp's libmtmd on the oracle's mmproj (F32, flash attention off), its token limits 1..4096, keeping the
    patch embedding and each GELU's input and output (clip.cpp's tensor names)."""
    pytest.importorskip("llama_cpp")
    from oracle_vision import gelu_names

    from hybridinfer.tools.benchmarks.vision_mtmd import MtmdEncoder

    names = ["patch_bias", *gelu_names(2), *(n.replace("gelu", "up_b") for n in gelu_names(2))]
    mt = MtmdEncoder(vl["mmproj"], vl["vocab_text"], n_threads=2, min_tokens=1, max_tokens=4096, capture=names)
    yield mt
    mt.close()


# images already multiples of patch·merge inside both sides' limits: mtmd resizes with its own bicubic, and these
# are not resized by either side, so both see identical pixels
MTMD_SIZES = ((64, 64), (128, 192))


@pytest.mark.oracle
def test_tower_close_to_llama_cpp_mtmd(vl, mtmd):
    """The engine's tower (transformers' arithmetic) against llama.cpp's on the same file: 4-7e-4 relative, from
    llama.cpp's F16 roundings (the next test); the bound is 2e-3, far below what a layout mistake gives (O(1))."""
    from oracle_vision import sample_image

    from hybridinfer.backends.vision import load_image_encoder

    enc = load_image_encoder(vl["mmproj"], 64, None, 1024, 1 << 22)
    for wh in MTMD_SIZES:
        img = sample_image(*wh, seed=5)
        ours, theirs = enc.encode(img).rows, mtmd.encode_rgb(np.asarray(img))
        assert 1e-4 < _rel(theirs, ours) <= 2e-3
    enc.close()


@pytest.mark.oracle
def test_tower_gap_to_llama_cpp_is_its_f16_rounding(vl, mtmd):
    """The whole gap to llama.cpp is its F16 roundings (oracle_vision.LlamaCppRounding, docs/vision.md Traps):
    - the patch embedding: ggml_conv_2d's im2col is F16 (even for this F32 kernel), so the pixels and the kernel
      are rounded to F16: 3-5e-4 from llama.cpp's without that, ~4e-7 with it;
    - each GELU is ggml's tanh form through an F16 table: given llama.cpp's inputs, ggml_gelu gives its outputs
      bit for bit (transformers' GELUs, which the engine uses, are 3-5e-4 away);
    - with both, and llama.cpp's own GELU outputs in place of ours (an F16 rounding makes a float32 summation
      difference of ~1e-7 at a rounding tie a whole F16 step; without them the rows are 3e-7..2.2e-4 from
      llama.cpp's over 18 images), the rows are ~1e-6 from llama.cpp's."""
    from oracle_vision import LlamaCppRounding, gelu_names, ggml_gelu, sample_image, with_llama_cpp_rounding

    from hybridinfer.backends.vision import load_image_encoder

    enc = load_image_encoder(vl["mmproj"], 64, None, 1024, 1 << 22)
    ops, n_layer = enc.ops, enc.args.n_layer
    for wh in MTMD_SIZES:
        img = sample_image(*wh, seed=5)
        theirs = mtmd.encode_rgb(np.asarray(img))
        cap = dict(mtmd.captured)
        patches = enc.prepare(img).patches
        embd = cap["patch_bias"]
        assert _rel(ops.linear(patches, "v.patch_embd"), embd) > 1e-4
        assert _rel(LlamaCppRounding(ops).linear(patches, "v.patch_embd"), embd) <= 2e-6
        for k, name in enumerate(gelu_names(n_layer)):
            x, y = cap[name.replace("gelu", "up_b")], cap[name]
            assert np.array_equal(ggml_gelu(x), y), name
            ours = ops.gelu_erf(x) if k == n_layer else ops.gelu_tanh(x)
            assert _rel(ours, y) > 1e-4, name
        with_llama_cpp_rounding(enc, [cap[n] for n in gelu_names(n_layer)])
        got = enc.encode(img).rows
        print(f"{wh}: llama.cpp's roundings, its GELU outputs: {_rel(got, theirs):.1e}")
        assert _rel(got, theirs) <= 1e-5
        enc.ops = ops
    enc.close()


# ---- the engine -----------------------------------------------------------------------------------------------

@pytest.mark.oracle
def test_engine_encodes_images_once(vl, tmp_path):
    from oracle_vision import sample_image

    from hybridinfer.engine.api import Engine
    from hybridinfer.errors import ParameterError

    path = tmp_path / "img.png"
    sample_image(96, 64, seed=7).save(path)
    with Engine.load(vl["text"], backend="cpu", n_ctx=256, n_threads=2, mmproj=vl["mmproj"]) as eng:
        assert eng.image_encoder.n_embd == eng.args.n_embd == 64
        rows = eng.encode_image(str(path))  # Qwen3.5's min_pixels (65536) scales 96x64 up to 320x224
        assert rows.shape == (10 * 7, 64) and rows.dtype == np.float32 and np.isfinite(rows).all()
        again = eng.encode_image(sample_image(96, 64, seed=7))  # the same pixels as a PIL image: a cache hit
        assert again is rows and eng.image_store.encoded == 1
        other = eng.encode_image(sample_image(96, 64, seed=8))
        assert eng.image_store.encoded == 2 and not np.array_equal(other, rows)
    with Engine.load(vl["text"], backend="cpu", n_ctx=256, n_threads=2) as eng:
        assert eng.image_encoder is None
        with pytest.raises(ParameterError, match="mmproj"):
            eng.encode_image(str(path))


@pytest.mark.oracle
def test_engine_image_token_limits(vl):
    """llama.cpp's --image-min/max-tokens: a 640x480 image under at most 16 tokens is scaled down (to 4x3 merged
    tokens), a 64x64 one under at least 30 scaled up; limits that cannot hold are refused by name."""
    from oracle_vision import sample_image

    from hybridinfer.backends.vision import load_image_encoder
    from hybridinfer.engine.api import Engine
    from hybridinfer.errors import ParameterError

    with Engine.load(vl["text"], backend="reference", n_ctx=256, mmproj=vl["mmproj"], image_min_tokens=1,
                     image_max_tokens=16) as eng:
        assert eng.encode_image(sample_image(640, 480)).shape == (12, 64)
    enc = load_image_encoder(vl["mmproj"], 64, min_tokens=30)
    assert enc.encode(sample_image(64, 64)).grid == (1, 6, 6)
    with pytest.raises(ParameterError, match=r"min tokens \(9\) must not exceed max tokens \(8\)"):
        load_image_encoder(vl["mmproj"], 64, min_tokens=9, max_tokens=8)
    with pytest.raises(ParameterError, match="max_tokens must be a positive integer, got 0"):
        load_image_encoder(vl["mmproj"], 64, max_tokens=0)


def test_mmproj_of_another_width_is_refused(tmp_path, oracle_gguf):
    from hybridinfer.engine.api import Engine
    from hybridinfer.models.qwen3vl_vision import MMProjWidthError
    from hybridinfer.tools.synth_vision import synth_mmproj

    mm = tmp_path / "mm48.gguf"
    synth_mmproj(mm, 48, {"depth": 1, "hidden": 32, "heads": 2, "ff": 64, "pos_side": 4}, dtype="f32")
    with pytest.raises(MMProjWidthError, match="width 48.*width is 64"):
        Engine.load(oracle_gguf("qwen35"), backend="reference", n_ctx=256, mmproj=str(mm))


def test_text_model_as_mmproj_is_refused(oracle_gguf, tmp_path):
    from hybridinfer.backends.vision import load_image_encoder
    from hybridinfer.errors import ParameterError, UnsupportedArchitectureError

    with pytest.raises(ParameterError, match="mmproj .*nope.gguf.*no such file"):
        load_image_encoder(tmp_path / "nope.gguf", 64)

    with pytest.raises(UnsupportedArchitectureError, match="not an mmproj.*'qwen35'"):
        load_image_encoder(oracle_gguf("qwen35"), 64)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_synth_mmproj_cpu_matches_reference(tmp_path, simd, dtype):
    """The synthetic file (bench vision --synth) loads; the CPU's products agree with the reference's (float
    matrices through BLAS; Q8_0 ones through the SIMD library, activations rounded to Q8_0 as llama.cpp does)."""
    from oracle_vision import sample_image

    from hybridinfer.backends.vision import load_image_encoder
    from hybridinfer.tools.synth_vision import synth_mmproj

    mm = tmp_path / "mm.gguf"
    synth_mmproj(mm, 40, {"depth": 2, "hidden": 64, "heads": 4, "ff": 128, "pos_side": 6}, dtype=dtype)
    img = sample_image(70, 50, seed=2)
    ref = load_image_encoder(mm, 40, None, MIN_PX, MAX_PX).encode(img)
    cpu = load_image_encoder(mm, 40, simd, MIN_PX, MAX_PX).encode(img)
    assert ref.grid == cpu.grid == (1, 2, 2) and ref.digest == cpu.digest
    assert _rel(cpu.rows, ref.rows) <= {"f32": 1e-5, "f16": 1e-5, "q8_0": 2e-2}[dtype]
    assert dtype != "q8_0" or _rel(cpu.rows, ref.rows) > 0  # the SIMD path (its own rounding) really ran


def test_embedding_lru_evicts_least_recent_by_bytes():
    from hybridinfer.engine.image_encoder import EmbeddingLRU
    from hybridinfer.models.vision_types import ImageEmbedding

    def emb(d):
        return ImageEmbedding(np.zeros((4, 8), np.float32), (1, 2, 2), d)  # 128 bytes

    lru = EmbeddingLRU(300)
    lru.put(emb("a"))
    lru.put(emb("b"))
    assert lru.get("a") is not None  # a is now the most recent
    lru.put(emb("c"))  # 384 bytes > 300: b goes
    assert lru.get("b") is None and lru.get("a") is not None and lru.get("c") is not None
    assert lru.bytes == 256 and len(lru) == 2


def test_bench_vision(tmp_path, capsys):
    """`bench vision` end to end on a small synthetic mmproj: the table has one row per size with the tower's token
    count, llama.cpp's beside it (same tokens, close rows) where llama-cpp-python is installed."""
    import importlib.util
    import json

    from md_tables import md_rows

    from hybridinfer.cli import main
    from hybridinfer.tools.synth_vision import synth_mmproj

    mm = tmp_path / "mm.gguf"
    synth_mmproj(mm, 64, {"depth": 1, "hidden": 32, "heads": 2, "ff": 64, "pos_side": 8}, dtype="f32")
    llama = importlib.util.find_spec("llama_cpp") is not None
    args = ["bench", "vision", "--mmproj", str(mm), "--sizes", "256x256,320x256",
            "-r", "1", "-t", "2", "--out-dir", str(tmp_path)] + ([] if llama else ["--no-llama"])
    assert main(args) == 0
    rows = md_rows(capsys.readouterr().out, "| size |")
    assert [r[:2] for r in rows] == [["256x256", "64"], ["320x256", "80"]]  # inside both sides' pixel limits
    res = json.loads((tmp_path / "vision-mm-t2.json").read_text())
    assert res["out_width"] == 64
    for r in res["rows"]:
        assert r["ms"] > 0
        if llama:
            assert r["llama_tokens"] == r["tokens"] and r["rel_diff"] < 2e-3


def test_bench_vision_bad_flags():
    from hybridinfer.cli import main

    assert main(["bench", "vision"]) == 2  # neither --mmproj nor --synth
    assert main(["bench", "vision", "--synth", "--sizes", "64by64"]) == 2
    assert main(["bench", "vision", "--mmproj", "/nonexistent/mm.gguf"]) == 2


def test_bench_vision_against_llama_mtmd_cli(tmp_path, capsys):
    """--llama-mtmd-cli: the CLI's own encode report is llama.cpp's time, one run a timed encode (here a stand-in
    executable that checks what it is given and reports a fixed time); a CLI that reports none is an error."""
    import json
    import stat

    from md_tables import md_rows

    from hybridinfer.cli import main
    from hybridinfer.tools.synth_vision import synth_mmproj

    mm = tmp_path / "mm.gguf"
    synth_mmproj(mm, 64, {"depth": 1, "hidden": 32, "heads": 2, "ff": 64, "pos_side": 8}, dtype="f32")
    log = tmp_path / "calls.txt"
    exe = tmp_path / "llama-mtmd-cli"
    exe.write_text("#!/bin/sh\n"
                   f'echo "$@" >> {log}\n'
                   'while [ $# -gt 0 ]; do [ "$1" = --image ] && [ -s "$2" ] && ok=1; shift; done\n'
                   '[ -n "$ok" ] || exit 3\n'
                   'echo "encoding mtmd batch, n_chunks = 1" >&2; echo "mtmd batch encoding done in 40 ms" >&2\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    assert main(["bench", "vision", "--mmproj", str(mm), "--sizes", "256x256", "-r", "2", "-t", "3",
                 "--llama-mtmd-cli", str(exe), "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "llama-mtmd-cli's encode time" in out
    (row,) = md_rows(out, "| size |")
    assert row[0] == "256x256" and float(row[4]) == 40.0
    res = json.loads((tmp_path / "vision-mm-t3.json").read_text())
    assert res["rows"][0]["llama_ms"] == 40.0 and "rel_diff" not in res["rows"][0]
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and all(f"--mmproj {mm}" in c and "-t 3" in c for c in calls)
    exe.write_text("#!/bin/sh\necho 'failed to load' >&2\nexit 1\n")
    assert main(["bench", "vision", "--mmproj", str(mm), "--sizes", "256x256", "-r", "1",
                 "--llama-mtmd-cli", str(exe), "--out-dir", str(tmp_path)]) == 2
    assert "exited 1 without an encode time: failed to load" in capsys.readouterr().err


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni", "ssse3"])
def test_cpu_tower_attention_fused_or_not_matches_reference(tmp_path, isa):
    """The CPU tower's attention: the library's fused kernel on the AVX2 and AVX-512 units (an online softmax, its
    own float order), the blocks of products below; either close to the reference at 256 patch rows (a
    whole block of keys)."""
    from oracle_vision import sample_image

    from hybridinfer.backends.cpu.simd import SimdLib, supported_isas
    from hybridinfer.backends.vision import load_image_encoder
    from hybridinfer.tools.synth_vision import synth_mmproj

    if isa not in supported_isas():
        pytest.skip(f"this CPU does not run the {isa} unit")
    mm = tmp_path / "mm.gguf"
    synth_mmproj(mm, 40, {"depth": 2, "hidden": 96, "heads": 2, "ff": 128, "pos_side": 16}, dtype="f32")
    img = sample_image(256, 256, seed=4)
    ref = load_image_encoder(mm, 40, None, MIN_PX, MAX_PX).encode(img)
    lib = SimdLib(isa, n_threads=2)
    try:
        enc = load_image_encoder(mm, 40, lib, MIN_PX, MAX_PX)
        assert enc.ops._fused == (isa != "ssse3")
        cpu = enc.encode(img)
    finally:
        lib.close()
    assert ref.grid == cpu.grid == (1, 8, 8)  # merged 2x2: 256 patch rows
    assert _rel(cpu.rows, ref.rows) <= 1e-5

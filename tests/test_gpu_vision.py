"""The whole vision tower on the card (backends/gpu/vision.py: gemm.cu's products, elementwise.cu's LayerNorm,
epilogues and rotary split, attention.cu's attn_full) against the reference and the CPU, on small synthetic mmproj
files whose row lengths are not multiples of 32 (the padding path), at a grid of 24 patches and one of 140 (neither
fills a product's or the attention's tiles). Run once as is and once with --card-profile fermi (the r63 kernels and
tiles). No image decoding here (the GPU machine may lack Pillow): random patch rows go straight into the forward."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SHAPE = {"depth": 2, "hidden": 48, "heads": 4, "ff": 72, "pos_side": 6}  # K = 48, 72, 192: padded to 64, 96, 192
GRIDS = [(1, 4, 6), (1, 10, 14)]


def _rel(a, b) -> float:
    assert a.shape == b.shape
    return float(np.abs(a - b).max() / np.abs(b).max())


def _patches(enc, grid):
    return np.random.default_rng(3).standard_normal((grid[1] * grid[2], enc.args.prep.patch_dim), dtype=np.float32)


def _rows(path, which: str, grid, simd=None):
    from hybridinfer.backends.vision import load_image_encoder

    enc = load_image_encoder(path, 40, simd, gpu=which == "gpu")
    try:
        rows = enc.rows(_patches(enc, grid), grid)
        if which == "gpu":  # the card ran it: one encode, every product timed
            assert enc.ops.encodes == 1 and len(enc.ops.by_product) == 7 and enc.ops.product_s > 0
        return rows
    finally:
        enc.close()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    from hybridinfer.tools.synth_vision import synth_mmproj

    d = tmp_path_factory.mktemp("gpu_vision")
    out = {}
    for dtype in ("f32", "f16"):
        out[dtype] = d / f"mm-{dtype}.gguf"
        synth_mmproj(out[dtype], 40, SHAPE, dtype=dtype)
    return out


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_gpu_tower_matches_reference_and_cpu(mmproj, dtype, grid):
    from hybridinfer.backends.cpu.simd import SimdLib

    mm = mmproj[dtype]
    gpu, ref = _rows(mm, "gpu", grid), _rows(mm, "reference", grid)
    assert np.isfinite(gpu).all() and gpu.shape == (grid[1] * grid[2] // 4, 40)
    # the card multiplies F16 weights by float32 rows, as the reference does: only the summation order differs
    assert _rel(gpu, ref) <= 1e-4
    lib = SimdLib(n_threads=2)
    try:
        cpu = _rows(mm, "cpu", grid, lib)
    finally:
        lib.close()
    # the CPU rounds the activations to fp16 for F16 weights (llama.cpp's MUL_MAT)
    assert _rel(gpu, cpu) <= (1e-4 if dtype == "f32" else 2e-2)


def test_gpu_tower_streamed_equals_resident(mmproj):
    """The same kernels on the same rows: the streamed tower's rows are the resident one's bits, and it frees its
    weights after each stage."""
    from hybridinfer.backends.gpu.vision import GPUVisionOps
    from hybridinfer.backends.vision import load_image_encoder

    enc = load_image_encoder(mmproj["f16"], 40, gpu=True)
    grid = GRIDS[1]
    x = _patches(enc, grid)
    streamed = GPUVisionOps(enc.gm, enc.args, enc.tower, mode="streamed")
    try:
        want = enc.rows(x, grid)
        got = streamed.forward(x, grid)
        assert np.array_equal(got, want)
        assert not streamed._dev and streamed.peak_bytes < enc.ops.peak_bytes
    finally:
        streamed.close()
        enc.close()


def test_bench_vision_gpu_reports_the_products():
    """`bench vision --gpu` (no llama.cpp side): the products' rate against the card's peak, each product's rate."""
    pytest.importorskip("PIL", reason="the bench makes its images with Pillow")
    from gpu_profile import PROFILE

    from hybridinfer.tools.benchmarks.vision import markdown, run

    res = run(None, None, 2, ((64, 64),), reps=1, llama=False, synth_width=64, synth_depth=2, gpu=True,
              card_profile=PROFILE)
    (row,) = res["rows"]
    assert row["tokens"] >= 1 and 0 < row["product_peak_frac"] < 1 and row["product_tflops"] > 0
    assert set(row["products"]) == {"v.patch_embd", "mm.0", "mm.2"} | {
        f"v.blk.*.{p}" for p in ("attn_qkv", "attn_out", "ffn_up", "ffn_down")}
    assert all(p["seconds"] > 0 for p in row["products"].values())
    assert "% of peak" in markdown(res)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_gpu_tower_under_every_card_profile(mmproj, dtype):
    """The tower on the card compiled and tiled for each card profile (fermi, kepler, maxwell, pascal) and for the
    card itself, in one run: the kernels of both classes with each profile's tile choices, against the reference.
    The session's profile is put back after."""
    from gpu_profile import PROFILE

    from hybridinfer.backends.gpu import cards, loader

    grid = GRIDS[1]
    ref = _rows(mmproj[dtype], "reference", grid)
    try:
        for profile in (None, *cards.PROFILES):
            loader.configure(profile)
            gpu = _rows(mmproj[dtype], "gpu", grid)
            assert np.isfinite(gpu).all() and _rel(gpu, ref) <= 1e-4, profile
    finally:
        loader.configure(PROFILE)

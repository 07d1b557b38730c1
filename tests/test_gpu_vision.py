"""The vision tower's products on the card (backends/gpu/vision.py, gemm.cu) against the reference and the CPU, on
small synthetic mmproj files whose row lengths are not multiples of 32 (the padding path). No image decoding here
(the GPU machine may lack Pillow): random patch rows go straight into the forward."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SHAPE = {"depth": 2, "hidden": 48, "heads": 4, "ff": 72, "pos_side": 6}  # K = 48, 72, 192: padded to 64, 96, 192


def _rel(a, b) -> float:
    assert a.shape == b.shape
    return float(np.abs(a - b).max() / np.abs(b).max())


def _rows(path, which: str, simd=None):
    from hybridinfer.backends.vision import load_image_encoder

    enc = load_image_encoder(path, 40, simd, gpu=which == "gpu")
    a = enc.args
    grid = (1, 4, 6)
    patches = np.random.default_rng(3).standard_normal((4 * 6, a.prep.patch_dim), dtype=np.float32)
    try:
        return enc.tower.forward(a, enc.ops, patches, grid)
    finally:
        enc.close()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_gpu_tower_matches_reference_and_cpu(tmp_path, dtype):
    from hybridinfer.backends.cpu.simd import SimdLib
    from hybridinfer.tools.synth_vision import synth_mmproj

    mm = tmp_path / f"mm-{dtype}.gguf"
    synth_mmproj(mm, 40, SHAPE, dtype=dtype)
    gpu, ref = _rows(mm, "gpu"), _rows(mm, "reference")
    assert np.isfinite(gpu).all() and gpu.shape == (6, 40)
    # the card multiplies F16 weights by float32 rows, as the reference does: only the summation order differs
    assert _rel(gpu, ref) <= 1e-4
    lib = SimdLib(n_threads=2)
    try:
        cpu = _rows(mm, "cpu", lib)
    finally:
        lib.close()
    # the CPU rounds the activations to fp16 for F16 weights (llama.cpp's MUL_MAT)
    assert _rel(gpu, cpu) <= (1e-4 if dtype == "f32" else 2e-2)

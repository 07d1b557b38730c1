"""The card's vision tower (backends/gpu/vision.py) run here with pycuda and its launchers stood in for by numpy
(tests/fake_cuda.py): its forward wires buffers, views, padding and epilogues as the reference's forward does, at a
grid whose rows fill no tile and widths (48, 72, 4 x 48) that are not multiples of 32; streamed, it holds one stage's
weights at a time; and the engine's encoder takes the card's tower, streamed, or the CPU's as the room allows."""

from __future__ import annotations

import types

import fake_cuda
import numpy as np
import pytest

SHAPE = {"depth": 3, "hidden": 48, "heads": 4, "ff": 72, "pos_side": 6}


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    from hybridinfer.tools.synth_vision import synth_mmproj

    d = tmp_path_factory.mktemp("vision_wiring")
    out = {}
    for dtype in ("f32", "f16"):
        out[dtype] = str(d / f"mm-{dtype}.gguf")
        synth_mmproj(out[dtype], 40, SHAPE, dtype=dtype)
    return out


def _patches(enc, grid):
    return np.random.default_rng(5).standard_normal((grid[1] * grid[2], enc.args.prep.patch_dim), dtype=np.float32)


def _rel(a, b) -> float:
    assert a.shape == b.shape
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_card_forward_wiring_equals_reference(monkeypatch, mmproj, dtype, mode):
    from hybridinfer.backends.gpu.vision import GPUVisionOps
    from hybridinfer.backends.vision import load_image_encoder

    fake_cuda.install(monkeypatch)
    ref = load_image_encoder(mmproj[dtype], 40)
    gpu = GPUVisionOps(ref.gm, ref.args, ref.tower, mode=mode)
    grid = (1, 10, 14)  # 140 patches, 35 merged rows
    x = _patches(ref, grid)
    want = ref.rows(x, grid)
    got = gpu.forward(x, grid)
    assert np.isfinite(got).all() and got.shape == (35, 40)
    assert _rel(got, want) <= 1e-5
    assert gpu.encodes == 1 and gpu.held_bytes == sum(v.nbytes for v in gpu._dvec.values()) + sum(
        w.data.nbytes for w in gpu._dev.values())  # the activations freed
    # every product timed once a use: 1 + 4 a block + 2
    assert sum(1 for _ in gpu.by_product) == 7 and gpu.product_flops > 0 and gpu.product_s > 0
    assert gpu.by_product["v.blk.*.attn_qkv"][0] == 3 * 2 * 140 * 144 * 48
    if mode == "streamed":
        assert not gpu._dev  # every stage's weights freed
    ref.close()


def test_streamed_holds_one_stage(monkeypatch, mmproj):
    from hybridinfer.backends.gpu.vision import GPUVisionOps, itemsize_of
    from hybridinfer.backends.gpu.vision_plan import activation_bytes, matrix_bytes, stages
    from hybridinfer.backends.vision import load_image_encoder

    fake_cuda.install(monkeypatch)
    ref = load_image_encoder(mmproj["f16"], 40)
    grid = (1, 4, 6)
    x = _patches(ref, grid)
    peaks = {}
    for mode in ("resident", "streamed"):
        ops = GPUVisionOps(ref.gm, ref.args, ref.tower, mode=mode)
        ops.forward(x, grid)
        peaks[mode] = ops.peak_bytes
    mb = matrix_bytes(ref.args, itemsize_of(ref.gm))
    act = activation_bytes(ref.args, 24)
    vec = sum(v.nbytes for v in ops._dvec.values())
    assert peaks["resident"] == sum(mb.values()) + act + vec
    assert peaks["streamed"] <= max(sum(mb[n] for n in st) for st in stages(ref.args)) + act + vec
    assert peaks["streamed"] < peaks["resident"]
    ref.close()


class _Card:
    """What load_encoder reads of a one-card GPU backend."""

    def __init__(self, room: int):
        self.tower_room, self.aside = room, 0

    def set_aside(self, n: int) -> None:
        self.aside += n


@pytest.mark.parametrize("room", ["resident", "streamed", "cpu"])
def test_engine_encoder_on_the_card_as_the_room_allows(monkeypatch, mmproj, room):
    from hybridinfer.backends.gpu.vision import itemsize_of
    from hybridinfer.backends.gpu.vision_plan import tower_plan
    from hybridinfer.backends.vision import load_image_encoder
    from hybridinfer.engine.image_encoder import load_encoder

    fake_cuda.install(monkeypatch)
    probe = load_image_encoder(mmproj["f16"], 40, min_tokens=4, max_tokens=16)
    a, size = probe.args, itemsize_of(probe.gm)
    probe.close()
    big = tower_plan(a, size, 1 << 40).reserve  # resident
    small = tower_plan(a, size, big - 1).reserve  # streamed
    card = _Card({"resident": big, "streamed": big - 1, "cpu": small - 1}[room])
    enc = load_encoder(mmproj["f16"], 40, types.SimpleNamespace(gpu=card), min_tokens=4,
                       max_tokens=16)
    ops = enc.encoder.ops
    if room == "cpu":
        assert type(ops).__name__ == "RefVisionOps" and card.aside == 0  # no SimdLib on this fake backend
    else:
        assert ops.mode == room and card.aside == ops.plan.reserve == (big if room == "resident" else small)
        assert ops.plan.reserve <= card.tower_room
        grid = (1, 8, 8)  # 16 merged tokens: the largest image max_tokens allows
        x = _patches(enc.encoder, grid)
        got = enc.encoder.rows(x, grid)
        assert ops.encodes == 1 and ops.peak_bytes <= ops.plan.reserve
        from hybridinfer.backends.vision import RefVisionOps

        ref = RefVisionOps(enc.encoder.gm, a, enc.encoder.tower)
        assert _rel(got, enc.encoder.tower.forward(a, ref, x, grid)) <= 1e-5
    enc.close()

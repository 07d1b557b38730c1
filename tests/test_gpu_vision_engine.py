"""The engine's vision tower on the card (engine/image_encoder.load_encoder): with backend="gpu" and an mmproj the
tower runs there (its encode counter moves) and an image prompt gives the CPU engine's greedy tokens on an F32
synth; a VRAM budget that leaves too little beside the text model for the tower's resident weights streams them
stage by stage and keeps the card within the budget."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_profile import PROFILE

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.gpu
TEXT = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512, ssm_d_state=64,
            ssm_n_group=2, ssm_dt_rank=4)
TOWER = {"depth": 4, "hidden": 256, "heads": 4, "ff": 512, "pos_side": 8}  # ~15 MB of F32 weights, ~5 MB a stage
TOKENS = dict(image_min_tokens=4, image_max_tokens=64)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model
    from hybridinfer.tools.synth_vision import synth_mmproj

    d = tmp_path_factory.mktemp("gpu_vision_engine")
    text, mm = str(d / "q.gguf"), str(d / "mm.gguf")
    synth_model(text, "qwen35", TEXT, "f32", seed=3)  # F32: the two backends agree to float order
    synth_mmproj(mm, TEXT["n_embd"], TOWER, dtype="f32", seed=4)
    return text, mm


def _image():
    pytest.importorskip("PIL", reason="the image prompts are made with Pillow")
    from fake_vision import png

    return png(160, 96, seed=9)  # 3 x 5 merged tokens


def _chat(img):
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "what is it?"}]}]


def test_gpu_engine_encodes_on_the_card(files):
    import io

    from hybridinfer.backends.cpu.vision import CPUVisionOps
    from hybridinfer.backends.gpu.vision import GPUVisionOps

    text, mm = files
    img = _image()
    g = Engine.load(text, backend="gpu", n_ctx=256, card_profile=PROFILE, mmproj=mm, **TOKENS)
    c = Engine.load(text, backend="cpu", n_ctx=256, n_threads=2, mmproj=mm, **TOKENS)
    try:
        ops = g.image_encoder.encoder.ops
        assert isinstance(ops, GPUVisionOps) and ops.mode == "resident"
        assert isinstance(c.image_encoder.encoder.ops, CPUVisionOps)
        gpu = g.generate(_chat(img), max_tokens=4, temperature=0)
        assert ops.encodes == 1  # the prompt's image went through the card's tower
        cpu = c.generate(_chat(img), max_tokens=4, temperature=0)
        assert gpu.tokens == cpu.tokens
        from PIL import Image

        pic = Image.open(io.BytesIO(img)).convert("RGB")
        eg, ec = g.image_encoder.encode(pic), c.image_encoder.encode(pic)
        assert ops.encodes == 2 and eg.grid == ec.grid == (1, 3, 5)
        assert float(np.abs(eg.rows - ec.rows).max()) <= 1e-4 * float(np.abs(ec.rows).max())
    finally:
        g.close()
        c.close()


def test_small_budget_streams_the_tower_within_it(files):
    from hybridinfer.backends.gpu.vision import itemsize_of
    from hybridinfer.backends.gpu.vision_plan import tower_plan
    from hybridinfer.backends.vision import load_image_encoder

    text, mm = files
    probe = load_image_encoder(mm, TEXT["n_embd"], min_tokens=TOKENS["image_min_tokens"],
                               max_tokens=TOKENS["image_max_tokens"])
    resident = tower_plan(probe.args, itemsize_of(probe.gm), 1 << 40)
    streamed = tower_plan(probe.args, itemsize_of(probe.gm), resident.reserve - 1)
    probe.close()
    assert resident.mode == "resident" and streamed.mode == "streamed"
    assert resident.reserve - streamed.reserve > 8 << 20  # room to land between the two
    t = Engine.load(text, backend="gpu", n_ctx=256, card_profile=PROFILE)
    beside = t.backend.gpu.allocated_bytes  # the text model's plan, without a tower
    t.close()
    budget = beside + (resident.reserve + streamed.reserve) // 2
    g = Engine.load(text, backend="gpu", n_ctx=256, card_profile=PROFILE, mmproj=mm, vram_budget=budget, **TOKENS)
    try:
        card, ops = g.backend.gpu, g.image_encoder.encoder.ops
        assert ops.mode == "streamed" and ops.plan.reserve == streamed.reserve
        assert card.allocated_bytes <= budget  # the text model's plan and the tower's share
        gen = g.generate(_chat(_image()), max_tokens=2, temperature=0)
        assert ops.encodes == 1 and len(gen.tokens) == 2
        assert 0 < ops.peak_bytes <= ops.plan.reserve and not ops._dev  # a stage at a time, freed after
        assert ops.held_bytes < streamed.reserve - streamed.activations + 1  # the image's buffers freed too
    finally:
        g.close()

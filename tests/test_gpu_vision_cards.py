"""The engine's vision tower beside a prefill over two cards (devices=[0, 1]), in each split mode: the tower runs on
the card with the most room under its budget (multi_card.tower_card, card 0 on a tie) in that card's context, its
bytes kept apart in that card's budget, and its rows are the CPU tower's within test_gpu_vision_engine's tolerance,
from the test's thread and through an image prompt on the scheduler's. Needs two GPUs (skipped with fewer)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from gpu_profile import PROFILE
from test_gpu_cards import _need
from test_gpu_vision_engine import TEXT, TOKENS, TOWER, _chat, _image

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.gpu
MOE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=4, n_expert_used=2,
           n_ff_exp=256, n_ff_shexp=256, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model
    from hybridinfer.tools.synth_vision import synth_mmproj

    d = tmp_path_factory.mktemp("gpu_vision_cards")
    out = {"layer": str(d / "q.gguf"), "expert": str(d / "moe.gguf"), "mmproj": str(d / "mm.gguf")}
    synth_model(out["layer"], "qwen35", TEXT, "f32", seed=3)
    synth_model(out["expert"], "qwen35moe", MOE, "q8_0", seed=5)  # the expert split needs routed experts
    synth_mmproj(out["mmproj"], TEXT["n_embd"], TOWER, dtype="f32", seed=4)
    return out


@pytest.mark.parametrize("split", ["layer", "expert"])
def test_two_cards_encode_on_the_roomiest_card(files, split):
    from PIL import Image

    from hybridinfer.backends.cpu.vision import CPUVisionOps
    from hybridinfer.backends.gpu.multi_card import tower_card
    from hybridinfer.backends.gpu.vision import GPUVisionOps

    _need([0, 1])
    img = _image()
    g = Engine.load(files[split], backend="gpu", devices=[0, 1], split_mode=split, n_ctx=256, card_profile=PROFILE,
                    mmproj=files["mmproj"], **TOKENS)
    c = Engine.load(files[split], backend="cpu", n_ctx=256, n_threads=2, mmproj=files["mmproj"], **TOKENS)
    try:
        gm, ops = g.backend.gpu, g.image_encoder.encoder.ops
        assert len(gm.cards) == 2 and [x.device for x in gm.cards] == [0, 1]
        assert isinstance(ops, GPUVisionOps) and ops.mode == "resident"  # the card's tower, not the CPU's
        assert isinstance(c.image_encoder.encoder.ops, CPUVisionOps)
        assert ops.ctx is gm.tower_context is gm.tower.ctx
        # the card with the most room before the tower's bytes were set aside there took it
        before = [x.m.tower_room + (ops.plan.reserve if x is gm.tower else 0) for x in gm.cards]
        assert gm.tower is gm.cards[tower_card(before)]
        assert all(x.m.allocated_bytes <= x.m.vram_budget for x in gm.cards)
        gen = g.generate(_chat(img), max_tokens=2, temperature=0)  # encoded on the scheduler's thread
        assert ops.encodes == 1 and len(gen.tokens) == 2
        pic = Image.open(io.BytesIO(img)).convert("RGB")
        eg, ec = g.image_encoder.encode(pic), c.image_encoder.encode(pic)  # a cache miss: the test's own thread
        assert ops.encodes == 2 and eg.grid == ec.grid == (1, 3, 5)
        assert float(np.abs(eg.rows - ec.rows).max()) <= 1e-4 * float(np.abs(ec.rows).max())
    finally:
        g.close()
        c.close()

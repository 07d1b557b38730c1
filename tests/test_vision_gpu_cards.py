"""The vision tower beside a multi-card prefill, without a card (tests/fake_cuda.py): the choice of card
(multi_card.tower_card: the most room under its budget, the first on a tie), the room, set-aside and context the
multi-card backends (layer split and expert split) show of that card, and the engine's encoder taking that card's
tower with every product and buffer made in its context and the tower's bytes kept apart in its budget alone."""

from __future__ import annotations

import types

import fake_cuda
import numpy as np
import pytest
from test_vision_gpu_wiring import SHAPE, _patches, _rel

from hybridinfer.errors import ParameterError


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    from hybridinfer.tools.synth_vision import synth_mmproj

    path = str(tmp_path_factory.mktemp("vision_cards") / "mm.gguf")
    synth_mmproj(path, 40, SHAPE, dtype="f16")
    return path


def test_tower_card_most_room_first_on_tie():
    from hybridinfer.backends.gpu.multi_card import tower_card

    assert tower_card([5, 9, 3]) == 1
    assert tower_card([7, 2, 7]) == 0 and tower_card([4, 8, 8]) == 1  # a tie: the first of them
    assert tower_card([0, 0]) == 0 and tower_card([12]) == 0
    assert tower_card([1 << 40, (1 << 40) + 1]) == 1
    with pytest.raises(ParameterError, match="no cards"):
        tower_card([])


def _multi(cls, rooms, budget=1 << 30):
    """A `cls` (MultiGPUModel or ExpertParallelModel) over cards whose GPUModels leave `rooms` bytes of their budgets
    (their own tower_room and set_aside; no card behind them), card k in context f"ctx{k}"."""
    from hybridinfer.backends.gpu.backend import GPUModel
    from hybridinfer.backends.gpu.multi_gpu import CardRunner

    m = cls.__new__(cls)
    m.cards = []
    for k, room in enumerate(rooms):
        g = GPUModel.__new__(GPUModel)
        g.vram_budget, g.reserved = budget, 1000 * (k + 1)
        g.streamer = types.SimpleNamespace(device_bytes=budget - room - g.reserved)
        assert g.tower_room == room
        m.cards.append(CardRunner(k, f"ctx{k}", g, "stand-in"))
    return m


def _classes():
    from hybridinfer.backends.gpu.expert_gpu import ExpertParallelModel
    from hybridinfer.backends.gpu.multi_gpu import MultiGPUModel

    return [MultiGPUModel, ExpertParallelModel]


@pytest.mark.parametrize("split", ["layer", "expert"])
def test_multi_card_backend_shows_the_chosen_card(split):
    cls = _classes()[split == "expert"]
    m = _multi(cls, [100, 300, 200])
    assert m.tower_room == 300 and m.tower_context == "ctx1" and m.tower is m.cards[1]
    before = [c.m.reserved for c in m.cards]
    m.set_aside(250)
    assert [c.m.reserved - b for c, b in zip(m.cards, before, strict=True)] == [0, 250, 0]
    assert [c.m.tower_room for c in m.cards] == [100, 50, 200]
    # the choice is kept: the room read, the bytes set aside and the context are one card's
    assert m.tower_room == 50 and m.tower_context == "ctx1"
    tie = _multi(cls, [300, 300])
    assert tie.tower_room == 300 and tie.tower_context == "ctx0"


def _tower_sizes(path):
    from hybridinfer.backends.gpu.vision import itemsize_of
    from hybridinfer.backends.gpu.vision_plan import tower_plan
    from hybridinfer.backends.vision import load_image_encoder

    probe = load_image_encoder(path, 40, min_tokens=4, max_tokens=16)
    a, size = probe.args, itemsize_of(probe.gm)
    probe.close()
    big = tower_plan(a, size, 1 << 40).reserve  # resident
    return big, tower_plan(a, size, big - 1).reserve  # and streamed


@pytest.mark.parametrize("split", ["layer", "expert"])
def test_engine_encoder_runs_on_the_roomiest_card(monkeypatch, mmproj, split):
    from hybridinfer.backends.gpu.vision import GPUVisionOps
    from hybridinfer.backends.vision import RefVisionOps
    from hybridinfer.engine.image_encoder import load_encoder

    fake_cuda.install(monkeypatch)
    big, _ = _tower_sizes(mmproj)
    # card 0 would stream the tower, card 1 holds it resident: the card with more room takes it
    m = _multi(_classes()[split == "expert"], [big - 1, big + 4096])
    before = [c.m.reserved for c in m.cards]
    enc = load_encoder(mmproj, 40, types.SimpleNamespace(gpu=m), min_tokens=4, max_tokens=16)
    ops = enc.encoder.ops
    assert isinstance(ops, GPUVisionOps) and ops.mode == "resident" and ops.ctx == "ctx1"
    assert [c.m.reserved - b for c, b in zip(m.cards, before, strict=True)] == [0, big]  # card 1's budget alone
    assert m.cards[1].m.tower_room == 4096
    grid = (1, 8, 8)
    x = _patches(enc.encoder, grid)
    fake_cuda.LAUNCHES.clear()
    got = enc.encoder.rows(x, grid)
    assert ops.encodes == 1 and len(fake_cuda.LAUNCHES) > 7
    assert set(fake_cuda.LAUNCHES) == {"ctx1"}  # every upload, buffer and product in card 1's context
    assert not fake_cuda.CURRENT  # and the context left after
    ref = RefVisionOps(enc.encoder.gm, enc.encoder.args, enc.encoder.tower)
    assert _rel(got, enc.encoder.tower.forward(enc.encoder.args, ref, x, grid)) <= 1e-5
    enc.close()


def test_engine_encoder_on_the_cpu_where_no_card_has_room(monkeypatch, mmproj):
    from hybridinfer.backends.gpu.multi_gpu import MultiGPUModel
    from hybridinfer.engine.image_encoder import load_encoder

    fake_cuda.install(monkeypatch)
    _, small = _tower_sizes(mmproj)
    m = _multi(MultiGPUModel, [small - 1, small - 2])
    before = [c.m.reserved for c in m.cards]
    enc = load_encoder(mmproj, 40, types.SimpleNamespace(gpu=m), min_tokens=4, max_tokens=16)
    assert type(enc.encoder.ops).__name__ == "RefVisionOps"  # no SimdLib on this stand-in backend
    assert [c.m.reserved for c in m.cards] == before  # nothing set aside on any card
    x = _patches(enc.encoder, (1, 4, 4))
    assert np.isfinite(enc.encoder.rows(x, (1, 4, 4))).all() and not fake_cuda.LAUNCHES
    enc.close()

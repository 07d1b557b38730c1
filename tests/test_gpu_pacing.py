"""On the card: the bus pacing keeps a host-to-device upload within 10% of the asked rate (alone and beside a
kernel that fills every multiprocessor for longer than the upload), and the GPU backend's own count of FLOPs and
streamed bytes equals the pure count the time model uses (gpu/work.prefill_work, Placement.stream_bytes_per_pass);
pacing changes no result."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
_GDN = dict(ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)
TINY = {
    "qwen35": dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512, **_GDN),
    "qwen35moe": dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=8,
                      n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, **_GDN),
    "llama": dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512),
}


def _rate(upload, stream, nbytes) -> float:
    import pycuda.driver as drv

    start, end = drv.Event(), drv.Event()
    start.record(stream)
    upload()
    end.record(stream)
    end.synchronize()
    return nbytes / (end.time_since(start) / 1e3)


@pytest.mark.parametrize("gb_s", [6, 12])
@pytest.mark.parametrize("busy", [False, True])
def test_paced_upload_keeps_to_the_asked_rate(gb_s, busy):
    import pycuda.driver as drv
    from pycuda import gpuarray

    from hybridinfer.backends.gpu import loader
    from hybridinfer.backends.gpu.k_pace import Pacer

    loader.init()
    n = 768 << 20
    host = drv.pagelocked_empty(n, np.uint8)
    host[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
    dev = gpuarray.zeros(n, np.uint8)
    stream = drv.Stream()
    native = _rate(lambda: drv.memcpy_htod_async(dev.gpudata, host, stream), stream, n)
    asked = gb_s * 1e9
    if native < 1.25 * asked:
        pytest.skip(f"this card's own bus ({native / 1e9:.1f} GB/s) is not faster than {gb_s} GB/s")
    dev.fill(0)
    pacer = Pacer(asked)
    half = n // 2 + 4096  # two copies of unequal size, several pieces each
    copies = [(int(dev.gpudata), host[:half]), (int(dev.gpudata) + half, host[half:])]
    if busy:  # a kernel filling every SM on another stream, as the compute stream's GEMMs do
        other = drv.Stream()
        sms = drv.Context.get_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        out = gpuarray.empty(sms * 16 * 256, np.float32)
        loader.launch("peak", "fma_peak", (sms * 16,), (256,),
                      [out.gpudata, np.int32(1 << 20), np.float32(0.9999), np.float32(1e-4)], stream=other)
    got = _rate(lambda: pacer.upload(copies, stream), stream, n)
    print(f"asked {gb_s} GB/s, got {got / 1e9:.2f} GB/s (native {native / 1e9:.1f}; busy card: {busy})")
    assert abs(got / asked - 1) <= 0.10
    assert np.array_equal(dev.get(), host)
    if busy:
        other.synchronize()


def _model(tmp_path, arch):
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args
    from hybridinfer.tools.synth import synth_model

    p = tmp_path / f"{arch}.gguf"
    synth_model(p, arch, TINY[arch], "q4_k_m", seed=3)
    gm = GGUFModel(p)
    return gm, model_args(gm)


def _budget(gm, a, chunk, n_ctx) -> int:
    """Buffers, vectors and double staging of the largest layer, and a quarter of the weights resident."""
    from hybridinfer.backends.gpu.backend import Buffers
    from hybridinfer.backends.gpu.placement import weights_of
    from hybridinfer.tools.card_plan import vector_bytes

    per_layer: dict = {}
    for w in weights_of(gm, a, matrices_only=True):
        per_layer[w.layer] = per_layer.get(w.layer, 0) + w.nbytes + 256
    return (Buffers.nbytes(a, chunk, n_ctx) + vector_bytes(gm, a) + 2 * max(per_layer.values())
            + sum(per_layer.values()) // 4)


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen35", "llama"])
def test_engine_counts_equal_the_pure_count(arch, tmp_path):
    from hybridinfer.backends.gpu.backend import GPUModel
    from hybridinfer.backends.gpu.work import prefill_work

    gm, a = _model(tmp_path, arch)
    m = GPUModel(gm, a, 256, vram_budget=_budget(gm, a, 32, 256), chunk=32)
    assert m.placement.stream_bytes_per_pass > 0
    ids = [int(x) for x in np.random.default_rng(1).integers(0, a.n_vocab, 72)]
    st = m.new_state(256)
    m.forward(ids, st, all_logits=True)  # 72 tokens: three chunks in every layer
    t = m.last_timing
    assert t["work"] == prefill_work(gm, a, 72, logit_rows=72).as_dict()
    assert t["bytes_h2d"] == m.placement.stream_bytes_per_pass
    m.forward(ids[:20], st, all_logits=False)  # continuing: attention over the 72 cached positions too
    assert m.last_timing["work"] == prefill_work(gm, a, 20, pos0=72, logit_rows=1).as_dict()
    if a.is_moe:  # the grouped products' count comes from the routing's real per-expert counts
        assert m.last_timing["work"]["moe"] == 20 * a.n_expert_used * sum(
            2 * gm.tensor(f"blk.0.ffn_{k}_exps.weight").ne[0] * gm.tensor(f"blk.0.ffn_{k}_exps.weight").ne[1]
            for k in ("gate", "up", "down")) * a.n_layer


@pytest.mark.parametrize("arch", ["qwen35moe"])
def test_paced_stream_gives_the_same_logits_no_faster_than_asked(arch, tmp_path):
    from hybridinfer.backends.gpu.backend import GPUModel

    gm, a = _model(tmp_path, arch)
    budget = _budget(gm, a, 32, 256)
    ids = [int(x) for x in np.random.default_rng(2).integers(0, a.n_vocab, 72)]
    free = GPUModel(gm, a, 256, vram_budget=budget, chunk=32)
    want = free.forward(ids, free.new_state(256), all_logits=True)
    del free
    bw = 2e9
    m = GPUModel(gm, a, 256, vram_budget=budget, chunk=32, bus_bw=bw)
    got = m.forward(ids, m.new_state(256), all_logits=True)
    t = m.last_timing
    print(f"paced: {t['bytes_h2d'] / 1e6:.1f} MB in {t['copy_s'] * 1e3:.2f} ms on the copy stream "
          f"({t['bytes_h2d'] / t['copy_s'] / 1e9:.2f} GB/s, asked {bw / 1e9:.1f})")
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert t["bytes_h2d"] == m.placement.stream_bytes_per_pass > 0
    assert t["copy_s"] >= 0.99 * t["bytes_h2d"] / bw


def test_card_profile_paces_to_its_class_bus(tmp_path):
    """--card-profile fermi paces the stream to PCIe 2.0 x16 (cards.py), kepler and later to PCIe 3.0 x16; an
    explicit bus_bw wins."""
    from hybridinfer.backends.gpu.backend import GPUModel
    from hybridinfer.backends.gpu.cards import PCIE2_X16, PCIE3_X16

    gm, a = _model(tmp_path, "qwen35moe")
    budget = _budget(gm, a, 32, 256)
    for profile, bw in (("fermi", PCIE2_X16), ("kepler", PCIE3_X16), (None, None)):
        m = GPUModel(gm, a, 256, vram_budget=budget, chunk=32, card_profile=profile)
        assert m.bus_bw == bw and (m.streamer.pacer is None) == (bw is None)
    m = GPUModel(gm, a, 256, vram_budget=budget, chunk=32, card_profile="fermi", bus_bw=3e9)
    assert m.bus_bw == 3e9

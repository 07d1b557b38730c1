"""Prefill over several cards (gpu/multi_gpu.py) against one card: the same logits and states within the single-card
GPU tests' tolerance, resident and streamed, fresh and continued states, several prompts together. `[0, 0]` runs the
multi-card path on one GPU (two cards sharing its context); `[0, 1]` needs two GPUs and is skipped with fewer."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_profile import PROFILE
from test_gpu_prefill import _close, _ids, _streaming_budget

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.gpu
N = 72  # three micro-batches of 24 rows; chunks of 32 rows inside a layer cut them differently


def _need(devices) -> None:
    import pycuda.driver as drv

    drv.init()
    n = drv.Device.count()
    if max(devices) >= n:
        pytest.skip(f"devices {devices} need {max(devices) + 1} CUDA devices, {n} visible (run on a two-GPU host)")


def _load(path, budget, **kw):
    return Engine.load(str(path), backend="gpu", n_ctx=256, vram_budget=budget, gpu_chunk=32, card_profile=PROFILE,
                       **kw)


def _same_states(a, b, rows):
    assert a.pos == b.pos and np.array_equal(a.tokens[: a.pos], b.tokens[: b.pos])
    for name in ("conv", "ssm", "k", "v"):
        for x, y in zip(a.arrays[name], b.arrays[name], strict=True):
            if x is not None:
                x, y = (x[:rows], y[:rows]) if name in ("k", "v") else (x, y)
                assert np.abs(x.astype(np.float32) - y.astype(np.float32)).max() <= 2e-3 * max(
                    1.0, float(np.abs(y.astype(np.float32)).max())), name


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_cards_match_one_card(devices, arch, mode, oracle_gguf):
    _need(devices)
    # streamed: 8 layers, so a card's share (4) is more than its staging slots (2) and the 1/16 resident: every card
    # streams (with 4 layers, 2 a card, a card's share fits in what staging alone takes)
    path = oracle_gguf(arch, "q8_0", layers=8 if mode == "streamed" else None)
    budget = _streaming_budget(path, frac=16) if mode == "streamed" else None
    one = _load(path, budget)
    many = _load(path, [budget] * len(devices) if budget else None, devices=devices, micro_batch=24)
    gm = many.backend.gpu
    assert [(c.m.first, c.m.end) for c in gm.cards][0][0] == 0 and gm.cards[-1].m.end == many.args.n_layer + 1
    assert all(a.m.end == b.m.first for a, b in zip(gm.cards, gm.cards[1:], strict=False))  # contiguous ranges
    for c in gm.cards:
        assert c.m.allocated_bytes <= c.m.vram_budget
        if mode == "streamed":
            assert c.m.placement.stream_bytes_per_pass > 0
    ids = _ids(many.args.n_vocab, N)
    for p0 in (0, 20):  # a fresh state, and one continuing 20 tokens the cards prefilled
        sa, sb = one.new_state(), many.new_state()
        if p0:
            one.prefill(ids[:p0], sa, all_logits=False)
            many.prefill(ids[:p0], sb, all_logits=False)
        want = one.prefill(ids[p0:], sa, all_logits=True)
        got = many.prefill(ids[p0:], sb, all_logits=True)
        _close(got, want, f"{len(devices)} cards {devices} vs one [{arch} {mode} from {p0}]")
        _same_states(sb, sa, N)
    t = gm.last_timing
    assert t["micro_batches"] == 3 and t["tokens"] == N - 20
    if mode == "streamed":
        assert t["bytes_h2d"] == sum(c.m.placement.stream_bytes_per_pass * c.totals["passes"] for c in gm.cards)
    # CPU decode goes on from the cards' state as from one card's
    ta, tb = one.backend.decode_batch([ids[0]], [sa]), many.backend.decode_batch([ids[0]], [sb])
    _close(tb, ta, "decode after the cards' prefill")
    many.close()
    one.close()


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]])
def test_several_prompts_through_the_cards(devices, oracle_gguf):
    _need(devices)
    path = oracle_gguf("qwen35moe", "q8_0")
    one = _load(path, None)
    many = _load(path, None, devices=devices, micro_batch=16)
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(0, many.args.n_vocab, n)] for n in (40, 5, 33)]
    sa, sb = [one.new_state() for _ in prompts], [many.new_state() for _ in prompts]
    want = one.backend.prefill_many([(p, s, (), None) for p, s in zip(prompts, sa, strict=True)])
    got = many.backend.prefill_many([(p, s, (), None) for p, s in zip(prompts, sb, strict=True)])
    for w, g, a, b in zip(want, got, sa, sb, strict=True):
        _close(g, w, f"several prompts on cards {devices}")
        _same_states(b, a, 40)
    many.close()
    one.close()


def test_repeating_a_device_splits_its_free_memory(oracle_gguf):
    path = oracle_gguf("qwen35", "q8_0")
    many = _load(path, None, devices=[0, 0])
    gm = many.backend.gpu
    a, b = (c.m.vram_budget for c in gm.cards)
    assert abs(a - b) <= 64 << 20 and gm.allocated_bytes <= a + b  # half the free memory each (less the contexts')
    assert gm.cards[1].label == f"device 0 ({gm.cards[0].name})"
    many.close()


def test_bench_prefill_rows_for_one_card_and_for_the_cards(oracle_gguf):
    from hybridinfer.backends.gpu.backend import DEFAULT_CHUNK, Buffers
    from hybridinfer.tools.benchmarks import prefill

    path = oracle_gguf("qwen35moe", "q4_k_m")
    args = Engine.load(str(path), backend="reference").args
    budget = _streaming_budget(path) + Buffers.nbytes(args, DEFAULT_CHUNK, 200)
    res = prefill.run(str(path), prompts=(40, 160), budget=budget, resident=False, threads=2, card_profile=PROFILE,
                      devices=[0, 0])
    print(prefill.markdown(res))
    rows = [r for r in res["rows"] if r["engine"] == "hybridinfer"]
    ones = [r for r in rows if r["config"].startswith("1 GPU(s), --devices 0,")]
    twos = [r for r in rows if r["config"].startswith("2 GPU(s), --devices 0,0")]
    assert [r["tokens"] for r in ones] == [r["tokens"] for r in twos] == [40, 160]
    assert all(r["tok_s"] > 0 and r["counts_agree"] and r["flops"] > 0 for r in ones + twos)
    # each row against its floor, FLOP/s and bus filled in (prefill_cards.card_figures; no bus where the cards'
    # summed budgets keep every weight resident)
    assert all(r["floor_ratio"] > 0 and r["gemm_tflops"] > 0 and r["vram_peak_gib"] > 0 for r in ones + twos)
    assert all((r["h2d_gb_s"] > 0) == (r["h2d_bytes"] > 0) for r in ones + twos)
    assert [c["layers"] for c in res["configs"] if c["config"].startswith("2 GPU")][0][0][0] == 0

"""backend="gpu" end to end on tiny models: whole-prompt prefill logits and states against the numpy reference,
resident and streamed under a small VRAM budget, chunked inside layers; GPU prefill then CPU decode; in-pass
GDN snapshots for the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_profile import PROFILE

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.gpu
N = 72


def _ids(n_vocab, n=N, seed=7):
    return [int(x) for x in np.random.default_rng(seed).integers(0, n_vocab, n)]


def _gpu(path, budget=None, chunk=512, **kw):
    return Engine.load(str(path), backend="gpu", n_ctx=256, vram_budget=budget, gpu_chunk=chunk,
                       card_profile=PROFILE, **kw)


def _streaming_budget(path, frac: int = 4) -> int:
    """A budget that holds the buffers and double staging but not the whole model: 1/frac of its weights resident."""
    from hybridinfer.backends.gpu.backend import Buffers
    from hybridinfer.backends.gpu.placement import weights_of
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args

    gm = GGUFModel(str(path))
    a = model_args(gm)
    ws = weights_of(gm, a, matrices_only=True)
    per_layer: dict = {}
    for w in ws:
        per_layer[w.layer] = per_layer.get(w.layer, 0) + w.nbytes + 256
    vec = sum(4 * int(np.prod(t.ne)) for n, t in gm.tensors.items() if len(t.ne) < 2 or n.endswith("ssm_conv1d.weight"))
    return Buffers.nbytes(a, 32, 256) + vec + 2 * max(per_layer.values()) + sum(per_layer.values()) // frac


def _close(got, want, what):
    d = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    print(f"{what}: max|d| {d:.3g} of {scale:.3g}, top-1 {agree:.1%}")
    assert d <= 2e-3 * scale and agree >= 0.97, what


@pytest.mark.parametrize("arch,quant", [("llama", "q8_0"), ("qwen35", "q8_0"), ("qwen35moe", "q8_0"),
                                        ("qwen35moe", "q4_k_m")])
@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_gpu_prefill_matches_reference(arch, quant, mode, oracle_gguf):
    path = oracle_gguf(arch, quant)
    ref = Engine.load(str(path), backend="reference", n_ctx=256)
    ids = _ids(ref.args.n_vocab)
    want_st = ref.new_state()
    want = ref.prefill(ids, want_st, all_logits=True)
    budget = _streaming_budget(path) if mode == "streamed" else None
    eng = _gpu(path, budget, chunk=32)  # 72 tokens: three chunks inside every layer
    gm = eng.backend.gpu
    if mode == "streamed":
        assert gm.placement.stream_bytes_per_pass > 0 and gm.allocated_bytes <= budget
    else:
        assert gm.placement.stream_bytes_per_pass == 0
    st = eng.new_state()
    got = eng.prefill(ids, st, all_logits=True)
    _close(got, want, f"gpu {mode} vs reference [{arch} {quant}]")
    if mode == "streamed":
        t = gm.last_timing
        print(f"  streamed {t['bytes_h2d'] / 1e6:.1f} MB in {t['copy_s'] * 1e3:.2f} ms; gpu {t['gpu_s'] * 1e3:.1f} ms")
        assert t["bytes_h2d"] == gm.placement.stream_bytes_per_pass
    assert st.pos == want_st.pos
    for x, y in zip((*st.conv, *st.ssm, *st.k, *st.v), (*want_st.conv, *want_st.ssm, *want_st.k, *want_st.v),
                    strict=True):
        if x is not None:
            assert np.abs(x[:N] - y[:N]).max() <= 2e-3 * max(1.0, float(np.abs(y[:N]).max()))


@pytest.mark.parametrize("arch", ["qwen35moe", "llama"])
def test_gpu_prefill_then_cpu_decode(arch, oracle_gguf):
    path = oracle_gguf(arch, "q8_0")
    ref = Engine.load(str(path), backend="reference", n_ctx=256)
    eng = _gpu(path)
    ids = _ids(ref.args.n_vocab, 40, seed=9)
    rs, gs = ref.new_state(), eng.new_state()
    rl, gl = ref.prefill(ids, rs)[-1], eng.prefill(ids, gs)[-1]
    for step in range(8):  # feed the reference's greedy token to both
        t = int(np.argmax(rl))
        assert int(np.argmax(gl)) == t, f"step {step}"
        rl = ref.backend.forward([t], rs, all_logits=False)[-1]
        gl = eng.backend.forward([t], gs, all_logits=False)[-1]
    assert gs.pos == rs.pos == 48


def test_gpu_snapshots_in_one_pass(oracle_gguf):
    path = oracle_gguf("qwen35moe", "q8_0")
    eng = _gpu(path, prefix_cache={"block_size": 16}, snapshot_stride=16)
    ids = _ids(eng.args.n_vocab, 70, seed=3)
    lg, s = eng.start(ids, eng.new_state())
    assert s["prefilled_tokens"] == 70
    assert eng.backend.gpu.last_timing["tokens"] == 70  # one pass, not one per snapshot
    # each stride snapshot equals a cold GPU prefill to that position
    for p in (16, 48, 64):
        cold = _gpu(path).prefill(ids[:p], st := eng.new_state())
        warm_st = eng.new_state()
        hit = eng.prefix_cache.lookup(ids[:p], max_pos=p)
        assert hit is not None and hit.pos == p
        eng.prefix_cache.restore(hit, warm_st)
        for x, y in zip((*warm_st.ssm, *warm_st.conv), (*st.ssm, *st.conv), strict=True):
            if x is not None:
                assert np.abs(x - y).max() <= 1e-4 * max(1.0, float(np.abs(y).max()))
        assert cold is not None
    # and a warm start continues to the same logits
    lg2, s2 = eng.start(ids + [1, 2, 3], eng.new_state())
    assert s2["reused_tokens"] == 70
    want = _gpu(path).prefill(ids + [1, 2, 3], eng.new_state())[-1]
    assert np.abs(np.asarray(lg2) - want).max() <= 2e-3 * float(np.abs(want).max())


def test_gpu_buffers_accounting_matches_allocation(oracle_gguf):
    from hybridinfer.backends.gpu.backend import Buffers

    for arch in ("llama", "qwen35", "qwen35moe"):
        eng = _gpu(oracle_gguf(arch, "q8_0"), chunk=48)
        b = eng.backend.gpu.buf
        arrays = []
        for v in vars(b).values():
            arrays += list(v.values()) if isinstance(v, dict) else [v] if hasattr(v, "gpudata") else []
        assert sum(x.nbytes for x in arrays) == Buffers.nbytes(eng.args, 48, 256), arch


def test_expert_counts_and_replan(oracle_gguf):
    """Routed tokens are counted per (layer, expert); replan() pins the most used ones and results stay right."""
    path = oracle_gguf("qwen35moe", "q8_0")
    ref = Engine.load(str(path), backend="reference", n_ctx=256)
    ids = _ids(ref.args.n_vocab)
    want = ref.prefill(ids, ref.new_state(), all_logits=True)
    budget = _streaming_budget(path)
    eng = _gpu(path, budget, chunk=32)
    gm = eng.backend.gpu
    eng.prefill(ids, eng.new_state())
    a = eng.args
    assert sum(gm.expert_counts.values()) == a.n_layer * len(ids) * a.n_expert_used
    gm.replan()
    p = gm.placement
    pinned = {(int(n.split(".")[1]), e) for n, es in p.pinned_experts.items() for e in es}
    pinned |= {(int(n.split(".")[1]), e) for n in p.resident if "_exps" in n for e in range(a.n_expert)}
    if pinned and len(pinned) < a.n_layer * a.n_expert:  # the pinned ones are the most used of their layer
        for (lay, e) in pinned:
            others = [gm.expert_counts.get((lay, x), 0) for x in range(a.n_expert) if (lay, x) not in pinned]
            assert not others or gm.expert_counts.get((lay, e), 0) >= min(others)
    assert gm.allocated_bytes <= budget
    _close(eng.prefill(ids, eng.new_state(), all_logits=True), want, "after replan")


def test_bench_prefill_runs(oracle_gguf, tmp_path):
    from hybridinfer.backends.gpu.backend import DEFAULT_CHUNK, Buffers
    from hybridinfer.tools.benchmarks import prefill

    path = oracle_gguf("qwen35moe", "q4_k_m")
    eng = Engine.load(str(path), backend="reference")
    budget = _streaming_budget(path) + Buffers.nbytes(eng.args, DEFAULT_CHUNK, 48)
    res = prefill.run(str(path), prompts=(16, 40), budget=budget, resident=True, threads=2, card_profile=PROFILE)
    print(prefill.markdown(res))
    assert res["pinned_h2d_gb_s"] > 1 and res["fma_peak_tflops"] > 0.1
    rows = [r for r in res["rows"] if r["engine"] == "hybridinfer"]
    assert len(rows) == 4 and all(r["tok_s"] > 0 and r["floor_ratio"] >= 1.0 for r in rows)
    assert all(r["counts_agree"] and r["flops"] > 0 and r["floor_ratio"] < 1e4 for r in rows)
    assert set(res["efficiency"]) == {16, 40} and all(0 < e["compute"] <= 1 for e in res["efficiency"].values())
    assert prefill.plot(res, str(tmp_path / "p.png"))
    phases = res["configs"][0]["phases_s"][40]
    assert {"gdn", "attention", "moe"} <= set(phases) and all(v > 0 for v in phases.values())


def test_gpu_load_shows_a_progress_bar(oracle_gguf, capsys):
    """Engine.load(progress=True) on the GPU backend draws a bar of the bytes put on the card or staged on the host
    (beside the CPU copy's); without progress, no bar."""
    path = oracle_gguf("qwen35", "q8_0")
    Engine.load(str(path), backend="gpu", n_ctx=128, gpu_chunk=32, vram_budget=_streaming_budget(path),
                progress=True).close()
    err = capsys.readouterr().err
    assert "loading weights (card 0)" in err, err[-2000:]
    Engine.load(str(path), backend="gpu", n_ctx=128, gpu_chunk=32, vram_budget=_streaming_budget(path)).close()
    assert "loading weights" not in capsys.readouterr().err

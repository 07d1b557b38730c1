"""GPU prefill then CPU decode at full depth, on a depth-scaled synthetic file (synth residual_scale), against the
CPU backend's prefill and decode of the same tokens (issue 23, item 6). A plain random file of this depth is
chaotic (tests/test_synth_depth.py), so only a depth-scaled one can hold engines to a tolerance at 40 layers."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.engine.api import Engine
from hybridinfer.tools.synth import depth_scale, synth_model

pytestmark = pytest.mark.gpu
DEEP = {"n_embd": 512, "n_layer": 40, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_vocab": 4096,
        "ssm_d_state": 64, "ssm_n_group": 2, "ssm_dt_rank": 4, "n_expert": 16, "n_expert_used": 4,
        "n_ff_exp": 256, "n_ff_shexp": 256, "tied": False}


def _teacher_forced(eng, ids, n_prefill) -> np.ndarray:
    st = eng.new_state()
    rows = [np.asarray(eng.prefill(ids[:n_prefill], st, all_logits=True), np.float32)]
    rows += [np.asarray(eng.backend.forward([t], st, all_logits=False)[-1:], np.float32) for t in ids[n_prefill:]]
    return np.concatenate(rows)


def test_gpu_prefill_then_cpu_decode_at_depth(tmp_path):
    path = str(tmp_path / "tame40.gguf")
    synth_model(path, "qwen35moe", DEEP, "q4_k_m", seed=1, residual_scale=depth_scale(DEEP["n_layer"]))
    ids = [int(x) for x in np.random.default_rng(5).integers(0, DEEP["n_vocab"], 96)]
    cpu = _teacher_forced(Engine.load(path, backend="cpu", n_ctx=128), ids, 48)
    gpu = _teacher_forced(Engine.load(path, backend="gpu", n_ctx=128), ids, 48)
    d, scale = float(np.abs(gpu - cpu).max()), float(np.abs(cpu).max())
    agree = float(np.mean(gpu.argmax(-1) == cpu.argmax(-1)))
    print(f"40-layer depth-scaled qwen35moe q4_k_m, gpu prefill + cpu decode vs cpu: top-1 {agree:.1%}, "
          f"max|d| {d:.3g} of {scale:.3g}")
    assert agree >= 0.9 and d <= 0.1 * scale

"""This engine's rotated low-bit K/V types lm3 / lm4: the codebook is docs/numerics.md's, the blocks the CPU writes
are the reference's bit for bit on every ISA unit, their attention matches the reference's over the same rows, they
are always rotated, and on a depth-scaled 12-layer synthetic model their logit error against F32 K/V is bounded and
printed beside q8_0's and q4_0's."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from hybridinfer.backends import reference_ops as op
from hybridinfer.engine.api import Engine
from hybridinfer.errors import ParameterError
from hybridinfer.format.quant_types import CACHE_TYPES, LLOYD_MAX, LM3, LM4, cache_row, cache_type
from hybridinfer.models.state_kinds import kv_rotation, with_cache_types

NO_FREQS = np.zeros(0, np.float32)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "numerics.md"


def test_codebook_is_the_documented_lloyd_max_levels():
    """Max (1960)'s levels of a unit Gaussian, as docs/numerics.md names them and the C header holds them; each is
    the centroid of its cell to three decimals (the Lloyd-Max condition)."""
    from math import erf, exp, pi, sqrt

    text = DOCS.read_text()
    assert "±0.2451, ±0.7560, ±1.3439, ±2.1520" in text and "±0.1284 ... ±2.7326" in text
    header = (Path(__file__).resolve().parents[1] / "native" / "simd" / "hi_internal.h").read_text()
    for t, name in ((LM3, "hi_lm3_levels"), (LM4, "hi_lm4_levels")):
        lv = LLOYD_MAX[t]
        c = re.search(name + r"\[\d+\] = \{([^}]*)\}", header).group(1)
        assert [float(x.strip().rstrip("f")) for x in c.split(",")] == list(lv)
        assert list(lv) == sorted(lv) and all(abs(a + b) < 1e-9 for a, b in zip(lv, lv[::-1], strict=True))
        edges = [-np.inf] + [(a + b) / 2 for a, b in zip(lv[:-1], lv[1:], strict=True)] + [np.inf]
        for i, level in enumerate(lv):  # centroid of N(0, 1) over [edges[i], edges[i+1]]
            lo, hi = edges[i], edges[i + 1]
            pdf = [0.0 if not np.isfinite(x) else exp(-x * x / 2) / sqrt(2 * pi) for x in (lo, hi)]
            cdf = [0.0 if lo == -np.inf else 0.5 * (1 + erf(lo / sqrt(2))), 1.0 if hi == np.inf else
                   0.5 * (1 + erf(hi / sqrt(2)))]
            assert abs((pdf[0] - pdf[1]) / (cdf[1] - cdf[0]) - level) < 2e-3, (t, i)
    assert cache_type("lm3").nbytes * 8 / 32 == 3.5 and cache_type("lm4").nbytes == 18
    assert {"lm3", "lm4"} <= set(CACHE_TYPES)


@pytest.mark.parametrize("t", ["lm3", "lm4"])
def test_cpu_writes_the_references_blocks_and_attends_as_it(libs, t):
    """attn_step on every ISA unit: the V rows it keeps (rotated in chunks of 64, then coded) are the reference's
    lm_encode bytes, and its outputs match the reference's attention over the same rows."""
    rng = np.random.default_rng(4)
    H, Hkv, hd, n = 4, 2, 128, 40
    tid = cache_type(t).id
    for lib in libs.values():
        kd, kr = cache_row(tid, hd)
        kc, vc = np.zeros((n, Hkv, kr), kd), np.zeros((n, Hkv, kr), kd)
        scratch = np.zeros(lib.attention_scratch_size(n, hd, H // Hkv), np.float32)
        for p in range(n):
            q = rng.standard_normal((1, H, hd)).astype(np.float32)
            k, v = (rng.standard_normal((1, Hkv, hd)).astype(np.float32) for _ in range(2))
            out = np.zeros((1, H * hd), np.float32)
            # theta so large that the rope leaves q and k as they are (cos 1, sin 0 beyond the first pair)
            lib.attn_step(q, k, v, kc, vc, p, out, scratch, 2, 1e30, True, NO_FREQS, 1, tid, tid, 128, 64)
            vr = op.hadamard(v, 64)
            assert np.array_equal(vc[p], op.lm_encode(vr, t)[0]), (lib.isa, p)
        # the last step's output: the reference over the kept rows, q rotated as K, the output rotated back
        want = op.hadamard(op.causal_attention(q, op.kv_decode(kc, t, hd), op.kv_decode(vc, t, hd), n - 1), 64)
        assert np.abs(out.reshape(want.shape) - want).max() <= 1e-5 * np.abs(want).max(), lib.isa


def test_lm_types_are_always_rotated_and_need_heads_of_64(smollm_path):
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args

    a = model_args(GGUFModel(smollm_path))  # SmolLM2-135M: heads of 64
    assert kv_rotation(with_cache_types(a, "lm3", "lm4", rotate=False)) == (64, 64)
    assert kv_rotation(with_cache_types(a, "q8_0", "q4_0", rotate=False)) == (0, 0)
    assert kv_rotation(with_cache_types(a, "q8_0", "f16")) == (64, 0)
    from dataclasses import replace

    with pytest.raises(ParameterError, match="lm3"):
        with_cache_types(replace(a, head_dim=96), "lm3", "f32")


@pytest.fixture(scope="module")
def depth_model(tmp_path_factory):
    from hybridinfer.tools.synth import depth_scale, synth_model

    shape = {"n_embd": 256, "n_layer": 12, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_vocab": 1024,
             "ssm_d_state": 64, "ssm_n_group": 2, "ssm_dt_rank": 4, "n_ff": 512}
    p = tmp_path_factory.mktemp("lm") / "deep.gguf"
    synth_model(p, "qwen35", shape, "q8_0", seed=3, residual_scale=depth_scale(12))
    return str(p)


def test_logit_error_on_a_depth_scaled_model(depth_model):
    """Logits of a 200-token prompt at each type against F32 K/V (the same backend and ISA, so the K/V type is the
    only difference): printed for the note; lm4 within 1.5x of q4_0's error (the same bytes), lm3 within 4x of
    q4_0's (22% fewer bytes), q8_0 below q4_0, and top-1 agreement at least 90% for every type."""
    ids = [int(x) for x in np.random.default_rng(9).integers(0, 1024, 200)]
    base = Engine.load(depth_model, backend="cpu", n_ctx=256).logits(ids)
    err = {}
    for t in ("q8_0", "q4_0", "lm4", "lm3"):
        got = Engine.load(depth_model, backend="cpu", n_ctx=256, cache_type_k=t, cache_type_v=t).logits(ids)
        err[t] = float(np.sqrt(np.mean((got - base) ** 2)))
        agree = float(np.mean(got.argmax(-1) == base.argmax(-1)))
        print(f"{t}: rms logit error {err[t]:.4f} (logit std {base.std():.3f}), top-1 {agree:.1%}")
        assert agree >= 0.9, t
    assert err["q8_0"] < err["q4_0"]
    assert err["lm4"] <= 1.5 * err["q4_0"] and err["lm3"] <= 4 * err["q4_0"]

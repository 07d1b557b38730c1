"""Images on the GPU backend (issue 33): the rope kernel's multimodal positions (IMROPE sections) against the reference,
its plain path unchanged, and a prompt with an image prefilled on the card (one prompt, and two in one pass) against
the CPU backend, then decoded on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
from fake_vision import FakeEncoder, png
from gpu_profile import PROFILE

from hybridinfer.backends.reference_ops import rope as ref_rope
from hybridinfer.engine.api import Engine
from hybridinfer.models import mrope
from hybridinfer.models.mrope import ImageSpan

pytestmark = pytest.mark.gpu
SECTIONS = (11, 11, 10, 0)
SHAPE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512, ssm_d_state=64,
             ssm_n_group=2, ssm_dt_rank=4)


def chat(img, text="what is this?"):
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def gpu():
    from pycuda import gpuarray

    from hybridinfer.backends.gpu import k_elementwise, loader

    loader.init()
    return gpuarray, k_elementwise


@pytest.mark.parametrize("T", [1, 9, 70])
def test_rope_sections_equal_reference(gpu, T):
    gpuarray, ke = gpu
    x = np.random.default_rng(T).standard_normal((T, 3, 128)).astype(np.float32)
    span = ImageSpan(2, (1, 4, 5), "d", np.zeros((20, 8), np.float32))
    _, p4 = mrope.positions((span,), 0, T) if T > 2 else (0, np.repeat(np.arange(T)[:, None], 4, 1).astype(np.int32))
    p4 = np.ascontiguousarray(p4, dtype=np.int32)
    xg = gpuarray.to_gpu(x)
    ke.rope_neox(xg, gpuarray.to_gpu(p4), 64, 1e7, sections=SECTIONS)
    want = ref_rope(x, p4, 64, 1e7, True, None, mrope.imrope_streams(SECTIONS, 32))
    got = xg.get()
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max())) + 2e-6
    assert np.array_equal(got[..., 64:], x[..., 64:])
    # rows whose four positions are equal: the plain kernel's bits
    rows = np.arange(100, 100 + T, dtype=np.int32)
    a, b = gpuarray.to_gpu(x), gpuarray.to_gpu(x)
    ke.rope_neox(a, gpuarray.to_gpu(rows), 64, 1e7)
    ke.rope_neox(b, gpuarray.to_gpu(np.ascontiguousarray(np.repeat(rows[:, None], 4, 1))), 64, 1e7,
                 sections=SECTIONS)
    assert np.array_equal(a.get(), b.get())


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    pytest.importorskip("PIL", reason="the image prompts are made with Pillow")
    from hybridinfer.tools.synth import synth_model

    path = str(tmp_path_factory.mktemp("gpu_images") / "q.gguf")
    # F32 weights: the CPU's products then take float activations (no Q8 rounding), so the two backends agree to
    # float order and the image path's error stands out (with q4_k_m, a text-only row already differed by 3%)
    synth_model(path, "qwen35", SHAPE, "f32", seed=3)
    g = Engine.load(path, backend="gpu", n_ctx=256, card_profile=PROFILE)
    c = Engine.load(path, backend="cpu", n_ctx=256)
    for e in (g, c):
        e.image_encoder = FakeEncoder(e.args.n_embd)
    yield g, c
    g.close()
    c.close()


def _close(got, want, what):
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 2e-3 * scale, what


def test_gpu_prefill_with_image_matches_cpu(engines):
    g, c = engines
    req = c.make_request(chat(png(160, 96, seed=9)), max_tokens=4)
    sts = []
    for e in (g, c):
        st = e.new_state()
        st.images = req.images
        lg = e.backend.forward(req.ids, st, all_logits=False)[-1].copy()
        nxt = e.backend.forward([70], st, all_logits=False)[-1].copy()  # decoded on the CPU after the image
        sts.append((lg, nxt))
    _close(sts[0][0], sts[1][0], "prompt")
    _close(sts[0][1], sts[1][1], "decode after it")


def test_gpu_pass_of_two_prompts_with_an_image(engines):
    g, c = engines
    r1 = c.make_request(chat(png(64, 64, seed=1)), max_tokens=2)
    r2 = c.make_request([{"role": "user", "content": "no image here, only words"}], max_tokens=2)
    out = {}
    for name, e in (("gpu", g), ("cpu", c)):
        chunks = []
        for r in (r1, r2):
            st = e.new_state()
            st.images = r.images
            chunks.append((r.ids, st))
        if name == "gpu":
            got = e.backend.prefill_many([(ids, st, (), None) for ids, st in chunks])
        else:
            got = e.backend.forward_many(chunks)
        out[name] = np.concatenate([np.asarray(x).reshape(-1, x.shape[-1])[-1:] for x in got])
    _close(out["gpu"].reshape(2, -1), out["cpu"].reshape(2, -1), "two prompts")

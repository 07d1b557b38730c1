"""Images through the engine with a fake encoder (tests/fake_vision.py) on a tiny synthetic Qwen3.5: an image prompt on
the CPU equal to the reference, chunking and decode after an image bit-exact on the CPU, the prefix cache keyed by the
images (different images never share a snapshot, the same one is reused and not encoded again), and every
generating entry point taking images."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fake_vision import FakeEncoder, png

from hybridinfer.engine.api import Engine
from hybridinfer.engine.images import NoImageEncoderError
from hybridinfer.engine.prefix.index import with_images
from hybridinfer.errors import ParameterError

pytestmark = pytest.mark.isa  # native kernels of every SIMD unit: CI runs these at each level

_GDN = dict(ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)
SHAPE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512, **_GDN)
IMG_A, IMG_B = png(128, 64, seed=1), png(128, 64, seed=2)  # 2 x 4 merged tokens each


def chat(img, text="what is this?"):
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model

    d = tmp_path_factory.mktemp("images")
    paths = {}
    for quant in ("f32", "q4_k_m"):
        paths[quant] = str(d / f"qwen35_{quant}.gguf")
        synth_model(paths[quant], "qwen35", SHAPE, quant, seed=3)
    return paths


def _load(path, backend="cpu", **kw):
    if backend == "cpu":
        kw["n_threads"] = 2
    eng = Engine.load(path, backend=backend, n_ctx=256, **kw)
    eng.image_encoder = FakeEncoder(eng.args.n_embd)
    return eng


def _run(eng, ids, spans, chunks=None, then=()):
    """Logits of every prompt row (or the chunk ends') and of each token of `then` decoded after it."""
    st = eng.new_state()
    st.images = spans
    be = eng.backend
    if chunks is None:
        out = [be.forward(ids, st, all_logits=True)]
    else:
        out = [be.forward(ids[a : a + chunks], st, all_logits=False)[-1:].copy() for a in range(0, len(ids), chunks)]
    dec = [be.forward([t], st, all_logits=False)[-1:].copy() for t in then]
    return np.concatenate(out), np.concatenate(dec) if dec else None


def test_image_prompt_cpu_equals_reference(model):
    ref, cpu = _load(model["f32"], "reference"), _load(model["f32"])
    req = cpu.make_request(chat(IMG_A), max_tokens=4)
    (sp,) = req.images
    assert sp.grid == (1, 2, 4) and req.ids[sp.row - 1] == cpu.tokenizer.token_id("<|vision_start|>")
    assert req.ids[sp.end] == cpu.tokenizer.token_id("<|vision_end|>")
    then = [65, 66, 67]
    want, want_dec = _run(ref, req.ids, req.images, then=then)
    got, got_dec = _run(cpu, req.ids, req.images, then=then)
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 1e-4 * scale and (got.argmax(-1) == want.argmax(-1)).all()
    assert float(np.abs(got_dec - want_dec).max()) <= 1e-4 * scale
    # the image's rows and positions matter: another image, or the rows at plain positions, move the logits
    other, _ = _run(cpu, req.ids, cpu.make_request(chat(IMG_B)).images)
    assert float(np.abs(other[-1] - got[-1]).max()) > 1e-3 * scale
    ref.close()
    cpu.close()


def test_chunks_and_decode_after_an_image_are_bit_exact(model):
    cpu = _load(model["q4_k_m"])
    req = cpu.make_request(chat(IMG_A, "and then?"), max_tokens=4)
    then = [70, 71, 72]
    whole, dec = _run(cpu, req.ids, req.images, then=then)
    for chunk in (1, 5):  # 1: every image row alone (never the recorded decode step); 5: cuts inside the image
        ends, dec_c = _run(cpu, req.ids, req.images, chunks=chunk, then=then)
        assert np.array_equal(ends[-1], whole[-1]) and np.array_equal(dec_c, dec)
    # two sequences decoded together (attn_rows with their rope shifts) give each one's bits
    sts = []
    for spans in (req.images, ()):
        st = cpu.new_state()
        st.images = spans
        cpu.backend.forward(req.ids, st, all_logits=False)
        sts.append(st)
    for k, t in enumerate(then):  # recorded at the first step, replayed (with the shifts it holds) after
        both = cpu.backend.decode_batch([t, t], sts)
        assert np.array_equal(both[0], dec[k])
    cpu.close()


def test_prefix_cache_keys_images_and_reuses_the_same_one(model):
    eng = _load(model["q4_k_m"], prefix_cache={"ram_bytes": 64 << 20})
    cold = _load(model["q4_k_m"])
    enc = eng.image_encoder
    a = eng.make_request(chat(IMG_A), max_tokens=3)
    b = eng.make_request(chat(IMG_B), max_tokens=3)
    assert a.ids == b.ids  # the same token ids: only the images tell them apart
    ka, kb = with_images(a.ids, a.images), with_images(b.ids, b.images)
    row = a.images[0].row
    assert np.array_equal(ka[:row], kb[:row]) and not np.array_equal(ka, kb)

    g1 = eng.generate(chat(IMG_A), max_tokens=3, temperature=0)
    g2 = eng.generate(chat(IMG_B), max_tokens=3, temperature=0)
    assert g2.timings["reused_tokens"] <= row  # nothing of image A's snapshot serves image B
    assert g2.tokens == cold.generate(chat(IMG_B), max_tokens=3, temperature=0).tokens
    assert enc.calls == 2
    turn2 = chat(IMG_A) + [{"role": "assistant", "content": g1.text}, {"role": "user", "content": "more?"}]
    g3 = eng.generate(turn2, max_tokens=3, temperature=0)
    assert enc.calls == 2  # image A again: from the store, not encoded
    assert g3.timings["reused_tokens"] >= len(a.ids)  # the first turn's prompt (and reply) restored
    assert g3.tokens == cold.generate(turn2, max_tokens=3, temperature=0).tokens
    eng.close()
    cold.close()


def test_every_entry_point_takes_images(model):
    eng = _load(model["q4_k_m"])
    want = eng.generate(chat(IMG_A), max_tokens=4, temperature=0).tokens
    kw = dict(max_tokens=4, temperature=0)
    assert eng.generate([{"role": "user", "content": "what is this?"}], images=[IMG_A], **kw).tokens == want
    assert eng.submit(chat(IMG_A), **kw).result().tokens == want
    url = "data:image/png;base64," + base64.b64encode(IMG_A).decode()  # an OpenAI part, as the library takes it
    oa = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                       {"type": "text", "text": "what is this?"}]}]
    assert eng.generate(oa, **kw).tokens == want
    slots = eng.tokenize_chat(eng.chat_text(chat(IMG_A)))  # token ids: each <|image_pad|> is one image's slot
    assert slots.count(eng.tokenizer.token_id("<|image_pad|>")) == 1
    assert eng.generate(slots, images=[IMG_A], **kw).tokens == want
    assert "".join(eng.stream(chat(IMG_A), **kw)) == eng.detokenize(want)
    got = eng.generate_batch([{"messages": chat(IMG_A)}, {"prompt": "<__media__> hi", "images": [IMG_B]}], **kw)
    assert got[0].tokens == want and len(got[1].tokens) == 4
    raw = eng.make_request("a <__media__> b <__media__>", images=[IMG_A, IMG_B])
    assert [s.digest for s in raw.images] == [s.digest for s in eng.make_request(chat(IMG_A)).images] + [
        eng.make_request(chat(IMG_B)).images[0].digest]
    with pytest.raises(ParameterError, match="media markers"):
        eng.make_request("one <__media__>", images=[IMG_A, IMG_B])
    with pytest.raises(ParameterError, match=r"messages\[0\]\.content\[0\]: not an image"):
        eng.make_request(chat(b"not an image"))
    with pytest.raises(ParameterError, match="image 1: "):
        eng.make_request("<__media__><__media__>", images=[IMG_A, b""])
    eng.image_encoder = None
    with pytest.raises(NoImageEncoderError, match="--mmproj"):
        eng.generate(chat(IMG_A), **kw)
    assert eng.generate("plain text", **kw).tokens  # text still works
    eng.close()


def test_image_snapshots_on_disk_serve_another_process(model, tmp_path):
    """Snapshot files hold the images' key ids: a second engine on the same folder restores the image prompt and
    answers as a cold run."""
    spec = {"ram_bytes": 64 << 20, "disk_dir": str(tmp_path / "cache")}
    one = _load(model["q4_k_m"], prefix_cache=spec)
    g1 = one.generate(chat(IMG_A), max_tokens=3, temperature=0)
    one.close()
    two = _load(model["q4_k_m"], prefix_cache=spec)
    g2 = two.generate(chat(IMG_A), max_tokens=3, temperature=0)
    assert g2.timings["reused_tokens"] >= g1.prompt_tokens - 1 and g2.tokens == g1.tokens
    g3 = two.generate(chat(IMG_B), max_tokens=3, temperature=0)  # another image: not the file of image A
    assert g3.timings["reused_tokens"] <= two.make_request(chat(IMG_B)).images[0].row
    two.close()

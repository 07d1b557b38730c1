"""The whole model on an image prompt against llama.cpp in one go: libmtmd tokenizes the prompt with its media
marker, encodes the image with its own tower and decodes every chunk (text at consecutive positions, the image's
rows at its M-RoPE positions) with mtmd_helper_eval_chunks into a llama.cpp context with F32 K/V and no flash
attention; this engine runs the same prompt text and image from `Engine.load(text, mmproj=...)` on the CPU. The
mmproj is the vision oracle's (tests/oracle_vision.py, llama.cpp's converter); the text model is a synthetic
Qwen3.5 of its width with a vocabulary (the oracle's own text GGUF has none, and mtmd tokenizes text)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hybridinfer.models import mrope

pytestmark = pytest.mark.oracle

PROMPT = "<|im_start|>user\n<__media__>what is in the picture?<|im_end|>\n<|im_start|>assistant\n"


def _llama_cpp_image_prompt(vl, rgb, capture=()):
    """(the prompt's ids with the image's tokens as None, llama.cpp's last logits, its position after the prompt,
    mtmd's captured tensors)."""
    import llama_cpp as lc

    from hybridinfer.tools.benchmarks.vision_mtmd import MtmdEncoder

    mt = MtmdEncoder(vl["mmproj"], vl["vocab_text"], n_threads=2, min_tokens=1, max_tokens=4096, capture=capture)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 64, 64, 2, 2
    cp.type_k = cp.type_v = lc.GGML_TYPE_F32
    cp.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
    lctx = lc.llama_init_from_model(mt.model, cp)
    m = mt.m
    try:
        with mt.tokenized(rgb, PROMPT) as chunks:
            ids: list[int | None] = []
            for i in range(m.mtmd_input_chunks_size(chunks)):
                ch = m.mtmd_input_chunks_get(chunks, i)
                if m.mtmd_input_chunk_get_type(ch) == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    toks = m.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
                    ids += [int(toks[k]) for k in range(n.value)]
                else:
                    ids += [None] * int(m.mtmd_input_chunk_get_n_tokens(ch))
            n_past = lc.llama_pos(0)
            assert m.mtmd_helper_eval_chunks(mt.ctx, lctx, chunks, 0, 0, 64, True, ctypes.byref(n_past)) == 0
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(mt.model))
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(lctx, -1), (n_vocab,)).copy()
        return ids, logits, int(n_past.value), dict(mt.captured)
    finally:
        lc.llama_free(lctx)
        mt.close()


def _ours(eng, image):
    """This engine's last logits on PROMPT with `image` (a PIL image, or an ImageEmbedding as it is), its ids and
    image spans."""
    req = eng.make_request(PROMPT, images=[image], max_tokens=0)
    st = eng.new_state()
    st.images = req.images
    return eng.prefill(req.ids, st)[-1].copy(), req.ids, req.images


def test_image_prompt_equals_llama_cpp_mtmd(vl):
    """The same ids (mtmd's tokenization, its image tokens where ours are), the same position after the prompt
    (the image advances it by max(h, w), not its token count), and the same last logits:
    - the engine as it is (transformers' arithmetic in the tower, whose rows are 4-7e-4 relative from llama.cpp's,
      test_vision_tower.py): measured 4.4e-6 of a largest logit of 0.47 (9e-6 relative). The bound, 1e-4 of the
      largest logit, is that gap times the logits' sensitivity to the rows: reversing the rows (a change of their
      own size) moves the logits by 1.3e-2 (3e-2 relative), so 7e-4 of the rows' size moves them ~2e-5;
    - with llama.cpp's F16 roundings in our tower (oracle_vision.LlamaCppRounding, its own GELU outputs): measured
      1.9e-7 (4e-7 relative); bounded by 1e-5, float32 summation order (test_image_llama_oracle.py's text side,
      our rows fed to llama.cpp: 2.7e-6 of 1.54);
    - the rows reversed are more than 20 times further from llama.cpp's logits: the check sees the image."""
    pytest.importorskip("llama_cpp")
    from oracle_vision import gelu_names, sample_image, with_llama_cpp_rounding

    from hybridinfer.engine.api import Engine
    from hybridinfer.engine.images import vision_ids

    img = sample_image(96, 64, seed=9)  # a multiple of patch·merge inside both sides' limits: identical pixels
    names = gelu_names(2)
    want_ids, want, want_pos, cap = _llama_cpp_image_prompt(vl, np.asarray(img), capture=names)
    scale = float(np.abs(want).max())
    with Engine.load(vl["vocab_text"], backend="cpu", n_ctx=256, n_threads=2, mmproj=vl["mmproj"],
                     image_min_tokens=1, image_max_tokens=4096) as eng:
        pad = vision_ids(eng.tokenizer)[1]
        got, ids, spans = _ours(eng, img)
        assert ids == [pad if t is None else t for t in want_ids]
        assert len(spans) == 1 and spans[0].grid == (1, 2, 3) and ids.count(pad) == 6
        assert want_pos == len(ids) + mrope.shift_at(spans, len(ids)) == len(ids) - 6 + 3
        d_plain = float(np.abs(got - want).max())

        with_llama_cpp_rounding(eng.image_encoder, [cap[n] for n in names])
        emb = eng.image_encoder.encode(img)
        got_r, _, _ = _ours(eng, emb)
        d_round = float(np.abs(got_r - want).max())

        shuffled = type(emb)(emb.rows[::-1].copy(), emb.grid, emb.digest + "-reversed")
        d_far = float(np.abs(_ours(eng, shuffled)[0] - want).max())
    print(f"image prompt vs llama.cpp (max logit {scale:.2f}): engine {d_plain:.1e}, with llama.cpp's roundings "
          f"{d_round:.1e}, rows reversed {d_far:.1e}")
    assert d_plain <= 1e-4 * scale
    assert d_round <= 1e-5 * scale
    assert d_far > 20 * d_plain

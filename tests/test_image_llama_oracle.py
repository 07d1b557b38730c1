"""The text model on an image prompt against llama.cpp: the same image rows (a fake tower's, fed to both as
embeddings) at mtmd's multimodal positions (an embedding batch with four positions a row, section-major, as
mtmd-helper's decode_embd_batch writes them), on a tiny F32 synthetic Qwen3.5 with F32 K/V. The text after the image
continues at llama.cpp's positions, so its logits agree only if the rows, their IMROPE positions and the shift after
the image are all llama.cpp's."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from fake_vision import FakeEncoder, png
from test_image_engine import SHAPE

from hybridinfer.engine.api import Engine
from hybridinfer.format.image_input import open_image
from hybridinfer.models import mrope
from hybridinfer.models.mrope import ImageSpan

pytestmark = pytest.mark.oracle


def _llama_after_image(path, before, rows, grid, after, n_ctx=128, plain=False):
    """llama.cpp's logits of each token of `after` (text, mtmd's positions) after `before` (text at 0..) and the
    image rows `rows` (one embedding batch at mtmd's MROPE positions; plain: at consecutive positions instead)."""
    import llama_cpp as lc

    llm = lc.Llama(model_path=path, n_ctx=n_ctx, n_batch=64, n_ubatch=64, n_threads=2, n_threads_batch=2,
                   type_k=lc.GGML_TYPE_F32, type_v=lc.GGML_TYPE_F32, seed=0, verbose=False)
    ctx = llm._ctx.ctx
    n_embd = rows.shape[1]

    def decode(n, token=None, embd=None, pos=None, logits_all=False):
        b = lc.llama_batch_init(n, n_embd if embd is not None else 0, 1)
        own_pos = ctypes.cast(b.pos, ctypes.c_void_p).value  # the address (a field's pointer object follows the field)
        try:
            b.n_tokens = n
            keep = None
            if embd is not None:
                ctypes.memmove(b.embd, np.ascontiguousarray(embd, np.float32).ctypes.data, embd.nbytes)
                keep = (ctypes.c_int32 * len(pos))(*pos)  # 4 positions a row, section-major
                b.pos = ctypes.cast(keep, ctypes.POINTER(lc.llama_pos))
            for i in range(n):
                if token is not None:
                    b.token[i] = token[i]
                    b.pos[i] = pos[i]
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = 1 if logits_all or i == n - 1 else 0
            assert lc.llama_decode(ctx, b) == 0
        finally:
            b.pos = ctypes.cast(own_pos, ctypes.POINTER(lc.llama_pos))
            lc.llama_batch_free(b)

    try:
        decode(len(before), token=before, pos=list(range(len(before))))
        t, h, w = grid
        base = len(before)
        n = t * h * w
        pos = [base] * n + [base + i // w for i in range(n)] + [base + i % w for i in range(n)] + [0] * n
        if plain:
            pos = [base + i for i in range(n)] * 4
        decode(n, embd=rows, pos=pos)
        p0 = base + (n if plain else max(grid))
        decode(len(after), token=after, pos=list(range(p0, p0 + len(after))), logits_all=True)
        V = lc.llama_n_vocab(lc.llama_model_get_vocab(llm._model.model))
        return np.array([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), (V,)) for i in range(len(after))])
    finally:
        llm.close()


def test_text_after_an_image_equals_llama_cpp(tmp_path):
    pytest.importorskip("llama_cpp")
    from hybridinfer.tools.synth import synth_model

    path = str(tmp_path / "q.gguf")
    synth_model(path, "qwen35", SHAPE, "f32", seed=6)
    ref = Engine.load(path, backend="reference", n_ctx=128)
    emb = FakeEncoder(ref.args.n_embd).encode(open_image(png(160, 96, seed=4)))
    tok = ref.tokenizer
    vs, pad, ve = (tok.token_id(x) for x in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    before = [tok.token_id("<|im_start|>"), *tok.encode("user\n"), vs]
    after = [ve, *tok.encode("what is in the picture?")]
    ids = before + [pad] * emb.n_tokens + after
    st = ref.new_state()
    st.images = (ImageSpan(len(before), emb.grid, emb.digest, emb.rows),)
    ours = ref.backend.forward(ids, st, all_logits=True)[-len(after):]
    want = _llama_after_image(path, before, emb.rows, emb.grid, after)
    scale = float(np.abs(want).max())
    d = float(np.abs(ours - want).max())
    print(f"image prompt vs llama.cpp: max|d| {d:.2e} of {scale:.2f}")
    assert d <= 1e-3 * scale and (ours.argmax(-1) == want.argmax(-1)).all()
    # the check has teeth: llama.cpp with the same rows at consecutive positions is far from this engine's answer
    plain = _llama_after_image(path, before, emb.rows, emb.grid, after, plain=True)
    assert float(np.abs(plain - ours).max()) > 20 * d
    assert mrope.shift_at(st.images, len(ids)) == max(emb.grid) - emb.n_tokens
    ref.close()

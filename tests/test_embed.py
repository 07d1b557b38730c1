"""Engine.embed and the hidden states under it (Backend.hidden): the reference's hidden states are exactly what its
head reads (head(hidden) equals its logits); the CPU's do not depend on how the prompt is chunked and agree with the
reference's; an embedding is unit length, deterministic, pooled as asked; bad input is a typed error."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridinfer.engine.api import Engine
from hybridinfer.errors import ContextLengthError, ParameterError

pytestmark = pytest.mark.isa

TEXT = "The quick brown fox jumps over the lazy dog, twice."


@pytest.fixture(scope="module")
def cpu(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=256, isa=os.environ.get("HYBRIDINFER_ISA"))
    yield eng
    eng.close()


def test_reference_hidden_is_what_the_head_reads(smollm_ref):
    ids = smollm_ref.tokenize(TEXT)
    h = smollm_ref.hidden_states(ids)
    be = smollm_ref.backend
    assert h.shape == (len(ids), smollm_ref.args.n_embd) and h.dtype == np.float32
    np.testing.assert_array_equal(be.w.mm(be.head[1], h).astype(np.float32), smollm_ref.logits(ids))


def test_cpu_hidden_chunking_and_reference(cpu, smollm_ref):
    ids = cpu.tokenize(TEXT)
    h = cpu.hidden_states(ids)
    chunk = cpu.prefill_chunk
    try:
        cpu.prefill_chunk = 3  # the prompt in chunks of 3: every row in its one-token float shape all the same
        np.testing.assert_array_equal(cpu.hidden_states(ids), h)
    finally:
        cpu.prefill_chunk = chunk
    ref = smollm_ref.hidden_states(ids)
    cos = (h * ref).sum(1) / np.linalg.norm(h, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.99, cos  # llama.cpp's 8-bit activations against float ones


def test_embed(cpu):
    v = cpu.embed(TEXT)
    assert v.shape == (cpu.args.n_embd,) and abs(float(np.linalg.norm(v)) - 1) < 1e-5
    np.testing.assert_array_equal(cpu.embed(TEXT), v)
    h = cpu.hidden_states(cpu.tokenize(TEXT)).astype(np.float64)
    np.testing.assert_allclose(v, h.mean(0) / np.linalg.norm(h.mean(0)), rtol=0, atol=1e-6)
    last = cpu.embed(cpu.tokenize(TEXT), pooling="last")
    np.testing.assert_allclose(last, h[-1] / np.linalg.norm(h[-1]), rtol=0, atol=1e-6)
    raw = cpu.embed(TEXT, normalize=False)
    np.testing.assert_allclose(raw, h.mean(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(ParameterError, match="pooling"):
        cpu.embed(TEXT, pooling="cls")
    with pytest.raises(ParameterError, match="at least one token"):
        cpu.embed([])
    with pytest.raises(ContextLengthError, match="n_ctx=256"):
        cpu.embed([1] * 300)
    with pytest.raises(ParameterError, match="outside the vocabulary"):
        cpu.embed([10 ** 9])

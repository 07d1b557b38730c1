"""Our tokenizer against llama.cpp's own tokenizer test files (real vocabularies: Qwen2 and the Qwen3.5
pre-tokenizer, Llama 3, GPT-2), taken from the llama-cpp-python source distribution."""

from __future__ import annotations

import os

import pytest

VOCABS = ["qwen35", "qwen2", "llama-bpe", "gpt-2"]


@pytest.fixture(scope="module")
def vocab_dir():
    import llama_vocabs

    d = llama_vocabs.vocab_dir()
    if d is None:
        pytest.skip("llama-cpp-python (and its source distribution) not available")
    return d


@pytest.mark.oracle
@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_tokenizer_test_vectors(vocab_dir, name):
    import llama_vocabs

    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.format.tokenizer import Tokenizer

    path = os.path.join(vocab_dir, f"ggml-vocab-{name}.gguf")
    tok = Tokenizer.from_gguf(GGUFModel(path))
    cases = llama_vocabs.cases(path)
    assert len(cases) >= 40
    for text, expected in cases:
        assert tok.encode(text, add_bos=False, parse_special=False) == expected, repr(text)
        assert tok.decode(expected) == text, repr(text)

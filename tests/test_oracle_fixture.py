"""The oracle_gguf fixture: gpu-marked tests skip with a reason when their oracle model cannot be made here."""

from __future__ import annotations

import sys

import pytest


def test_gpu_test_skips_naming_what_is_missing(_oracle_models, monkeypatch):
    conftest = sys.modules["conftest"]
    monkeypatch.setattr(conftest, "_missing_oracle_tools", lambda quant: ["llama_cpp"])
    with pytest.raises(pytest.skip.Exception, match=r"needs llama_cpp \(not installed\).*HYBRIDINFER_ORACLE_CACHE"):
        _oracle_models("qwen35", "q4_k_m", 977, None, True)


def test_missing_tools_are_found():
    conftest = sys.modules["conftest"]
    assert conftest._missing_oracle_tools(None) == []  # torch and transformers are installed with the tests
    import importlib.util

    want = [] if importlib.util.find_spec("llama_cpp") else ["llama_cpp"]
    assert conftest._missing_oracle_tools("q8_0") == want

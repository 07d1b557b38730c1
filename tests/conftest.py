"""Shared fixtures: the embedded SmolLM2 GGUF and session-cached tiny oracle models."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    from hybridinfer_gpu_probe import has_gpu  # noqa: F401  (tiny module, below)

    if not has_gpu():
        skip = pytest.mark.skip(reason="no CUDA device / pycuda")
        for it in items:
            if "gpu" in it.keywords:
                it.add_marker(skip)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from hybridinfer.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_ref(smollm_path):
    """The reference engine on SmolLM2 (weights dequantized once per session)."""
    from hybridinfer.api import Engine

    return Engine.load(smollm_path, backend="reference", n_ctx=1024)


@pytest.fixture(scope="session")
def oracle_gguf(tmp_path_factory):
    """oracle_gguf(arch, quant=None) -> path of a tiny random model converted from transformers."""
    from oracle_models import make_oracle_gguf

    # HYBRIDINFER_ORACLE_CACHE: a directory of models made earlier (the GPU machine has no llama.cpp quantizer)
    d = os.environ.get("HYBRIDINFER_ORACLE_CACHE") or tmp_path_factory.mktemp("oracle")
    cache: dict = {}

    def get(arch: str, quant: str | None = None, seed: int = 0, layers: int | None = None):
        key = (arch, quant, seed, layers)
        if key not in cache:
            cache[key] = make_oracle_gguf(arch, str(d), seed=seed, quant=quant, layers=layers)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def ga():
    """pycuda's gpuarray module once a context is up (gpu-marked kernel tests)."""
    from hybridinfer.gpu import loader

    loader.init()
    from pycuda import gpuarray

    return gpuarray


@pytest.fixture(scope="module")
def libs():
    """One SimdLib per ISA this CPU runs, 2 threads each (test_simd_gdn.py has its own, by thread count)."""
    from hybridinfer.cpu.simd import SimdLib, supported_isas

    out = {isa: SimdLib(isa, n_threads=2) for isa in supported_isas()}
    yield out
    for lib in out.values():
        lib.close()

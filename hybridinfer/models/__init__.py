"""Architectures, one module each: its ModelArgs, tensor specs and forward (written in models/graph.py's op
vocabulary). `model_args(gm)` picks the module by `general.architecture`."""

from __future__ import annotations

from types import ModuleType

from ..errors import UnsupportedArchitectureError
from ..format.gguf_model import GGUFModel
from . import llama, qwen3vl_vision, qwen35, qwen35moe

ARCHITECTURES: dict[str, ModuleType] = {m.ARCH: m for m in (llama, qwen35, qwen35moe)}
# vision towers of mmproj files (general.architecture "clip"), by clip.projector_type
PROJECTORS: dict[str, ModuleType] = {m.PROJECTOR: m for m in (qwen3vl_vision,)}


def arch_module(arch: str) -> ModuleType:
    mod = ARCHITECTURES.get(arch)
    if mod is None:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return mod


def model_args(gm: GGUFModel):
    """The frozen ModelArgs of the file, after checking every tensor's presence, shape and type."""
    return arch_module(gm.arch).ModelArgs.from_gguf(gm)


def vision_args(gm: GGUFModel, min_pixels: int | None = None, max_pixels: int | None = None):
    """The frozen VisionArgs of an mmproj file, its module picked by `clip.projector_type`, every tensor checked."""
    if gm.arch != "clip":
        raise UnsupportedArchitectureError(
            f"{gm.path!r} is not an mmproj: general.architecture is {gm.arch!r}, not 'clip'")
    proj = gm.meta("clip.projector_type", None)
    mod = PROJECTORS.get(proj)
    if mod is None:
        raise UnsupportedArchitectureError(
            f"{gm.path!r}: projector type {proj!r} is not supported (supported: {', '.join(sorted(PROJECTORS))})")
    return mod, mod.VisionArgs.from_gguf(gm, min_pixels, max_pixels)

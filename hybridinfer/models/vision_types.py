"""What the text model receives from an image encoder (the vision tower of an mmproj GGUF).

The encoder (models/ + backends/) and the engine's image plumbing (positions, prefill, caches, interfaces) meet
here and nowhere else: an encoder turns one RGB image into an `ImageEmbedding`; the engine places its rows where
the prompt's image tokens are and gives them the multimodal rotary positions of `grid`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class ImageEmbedding:
    """One image as the text model takes it.

    rows: float32 [n_tokens, n_embd], one row per image token, in the order the prompt holds them (row-major over
        the merged grid: t, then h, then w).
    grid: (t, h, w) of merged tokens; t * h * w == n_tokens (a still image has t == 1).
    digest: hex content hash of the preprocessed pixels and grid; keys the embedding cache and the prefix cache, so
        two different images never share an entry and the same image is never encoded twice.
    """

    rows: np.ndarray
    grid: tuple[int, int, int]
    digest: str

    def __post_init__(self) -> None:
        t, h, w = self.grid
        if self.rows.ndim != 2 or self.rows.shape[0] != t * h * w:
            raise ValueError(f"image rows {self.rows.shape} do not match grid {self.grid}")

    @property
    def n_tokens(self) -> int:
        return int(self.rows.shape[0])


class ImageEncoder(Protocol):
    """An mmproj's vision tower on some backend. `Engine.image_encoder` is one of these, or None without --mmproj."""

    n_embd: int  # width of the rows it returns: equals the text model's embedding width (checked at load)

    def encode(self, image) -> ImageEmbedding:
        """`image`: an RGB PIL.Image.Image (format/image_input.open_image makes one from bytes, a path or a PIL
        image)."""
        ...

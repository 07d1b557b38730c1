"""A stand-in vision tower for the image plumbing's tests: an ImageEncoder (models/vision_types.py) whose rows are a
fixed function of the image's pixels, so tests need no mmproj file. The grid is the image's size over 32 (16-pixel
patches merged 2 x 2, as Qwen3.5's tower), at least 1 x 1; each row is the mean colour of its cell projected to
n_embd by a seeded matrix, at the scale of a token embedding. `calls` counts encodes."""

from __future__ import annotations

import hashlib

import numpy as np

from hybridinfer.models.vision_types import ImageEmbedding


class FakeEncoder:
    def __init__(self, n_embd: int, scale: float = 1.0, seed: int = 7):
        self.n_embd, self.calls = n_embd, 0
        self.proj = np.random.default_rng(seed).standard_normal((4, n_embd)).astype(np.float32) * np.float32(scale)

    def encode(self, image) -> ImageEmbedding:
        self.calls += 1
        W, H = image.size
        h, w = max(1, H // 32), max(1, W // 32)
        cells = np.asarray(image.convert("RGB").resize((w, h)), dtype=np.float32).reshape(h * w, 3) / 255.0
        feats = np.concatenate([cells, np.ones((h * w, 1), np.float32)], axis=1) - 0.5
        rows = (feats @ self.proj).astype(np.float32)
        d = hashlib.blake2b(image.tobytes() + f"{image.size}".encode(), digest_size=16).hexdigest()
        return ImageEmbedding(rows, (1, h, w), d)


def png(w: int, h: int, seed: int = 0) -> bytes:
    """A PNG of random pixels, made now."""
    import io

    from PIL import Image

    px = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return buf.getvalue()

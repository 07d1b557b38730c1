"""The engine's image encoder: an mmproj's vision tower (backends/vision.py), optionally behind a bounded LRU of
embeddings keyed by the preprocessed image's digest. The engine keeps its embeddings in engine/images.ImageStore
(keyed by the image's pixels, before any preprocessing) and loads the tower here without an LRU of its own.

The tower runs on its own SimdLib (the backend's unit and thread count), under its own lock: an image encoded
for one request does not hold the scheduler's steps (the other streams) for the seconds a large image takes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..errors import ParameterError
from ..models.vision_types import ImageEmbedding

DEFAULT_CACHE_BYTES = 256 << 20


class EmbeddingLRU:
    """ImageEmbeddings by key (their digest unless put says another), least recently used out first once their rows
    pass `max_bytes`; one larger than max_bytes is not kept."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        if max_bytes < 0:
            raise ParameterError(f"image cache bytes must be >= 0, got {max_bytes}")
        self.max_bytes, self.bytes = max_bytes, 0
        self._d: OrderedDict[str, ImageEmbedding] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str) -> ImageEmbedding | None:
        e = self._d.get(key)
        if e is None:
            self.misses += 1
            return None
        self._d.move_to_end(key)
        self.hits += 1
        return e

    def put(self, e: ImageEmbedding, key: str | None = None) -> None:
        key = e.digest if key is None else key
        if key in self._d or e.rows.nbytes > self.max_bytes:
            return
        self._d[key] = e
        self.bytes += e.rows.nbytes
        while self.bytes > self.max_bytes:
            _, old = self._d.popitem(last=False)
            self.bytes -= old.rows.nbytes

    def __len__(self) -> int:
        return len(self._d)


class CachedImageEncoder:
    """An ImageEncoder (models/vision_types.py) whose `encode` looks the image up first."""

    def __init__(self, encoder, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.encoder, self.cache = encoder, EmbeddingLRU(cache_bytes)
        self.n_embd = encoder.n_embd
        self.lock = threading.Lock()

    def encode(self, image) -> ImageEmbedding:
        with self.lock:
            p = self.encoder.prepare(image)
            hit = self.cache.get(p.digest)
            if hit is not None:
                return hit
            e = self.encoder.encode_prepared(p)
            self.cache.put(e)
            return e

    def close(self) -> None:
        with self.lock:
            self.encoder.close()


def load_encoder(path, n_embd_text: int, backend, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 min_tokens: int | None = None, max_tokens: int | None = None) -> CachedImageEncoder:
    """The mmproj at `path` for a text model of width n_embd_text on `backend`: the numpy reference under the
    reference backend; on the card beside the text model where the backend prefills on a card (`backend.gpu` with
    a `tower_room`: one card's GPUModel, or a multi-card prefill's chosen card, whose `tower_context` every encode
    runs in) and the tower fits the room its plan leaves (weights resident, else streamed; that card's budget then
    keeps the tower's bytes apart: set_aside); else the CPU's SIMD products (the GPU backend's CPU unit and
    threads). min/max_tokens: the image size limits in merged tokens (None: the file's or Qwen's defaults)."""
    from ..backends.vision import load_image_encoder

    simd = None
    cpu = getattr(backend, "cpu", backend)
    lib = getattr(cpu, "simd", None)
    if lib is not None:
        from ..backends.cpu.simd import SimdLib

        simd = SimdLib(isa=lib.isa, n_threads=lib.n_threads)
    card = getattr(backend, "gpu", None)
    room = getattr(card, "tower_room", None)
    enc = load_image_encoder(path, n_embd_text, simd, min_tokens=min_tokens, max_tokens=max_tokens,
                             gpu=room is not None, vram_room=room, card=getattr(card, "tower_context", None))
    plan = getattr(enc.ops, "plan", None)
    if plan is not None:
        card.set_aside(plan.reserve)
        if simd is not None:  # the card's tower has no use for the CPU's threads
            simd.close()
    return CachedImageEncoder(enc, cache_bytes)

"""An RGB image turned into the patch rows a Qwen-VL vision tower takes, as transformers' Qwen2VL image processor
(the one Qwen3.5's processor config names; its PIL variant, `Qwen2VLImageProcessorPil`) makes them.

Steps, each as the processor does it, so the pixel values are equal to its `pixel_values` bit for bit:
1. `smart_resize`: height and width rounded to multiples of patch·merge, then scaled (keeping the aspect ratio)
   into [min_pixels, max_pixels]. An image far beyond max_pixels is scaled down, never refused.
2. PIL's BICUBIC resize of the uint8 image (always called, as the processor does).
3. rescale in float64 by 1/255, to float32; then (x - mean) / std in float32.
4. patches in merge-window order: (h/m, w/m, m, m) patches, each flattened as (channel, t, p, p) with the still
   image repeated over the temporal patch (t = 2 identical frames).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from ..errors import ParameterError

# Qwen3.5's preprocessor_config.json (size.shortest_edge / longest_edge): used where the mmproj does not say
QWEN_MIN_PIXELS = 65536
QWEN_MAX_PIXELS = 16777216


@dataclass(frozen=True)
class PrepConfig:
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    min_pixels: int = QWEN_MIN_PIXELS
    max_pixels: int = QWEN_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.min_pixels < 1 or self.max_pixels < self.min_pixels:
            raise ParameterError(f"image pixel limits must satisfy 1 <= min_pixels <= max_pixels, got "
                                 f"min_pixels={self.min_pixels}, max_pixels={self.max_pixels}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass(frozen=True)
class Prepared:
    """patches: float32 [h·w, patch_dim] in merge-window order; grid: (t, h, w) in patches (not merged)."""

    patches: np.ndarray
    grid: tuple[int, int, int]
    digest: str


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' `smart_resize` (qwen2_vl), the same float steps: Python's round (half to even), floor, ceil."""
    if min(height, width) < 1:
        raise ParameterError(f"image size {width}x{height} is empty")
    if max(height, width) / min(height, width) > 200:
        raise ParameterError(f"image aspect ratio of {width}x{height} is over 200, which the vision tower refuses")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_pixels(image, cfg: PrepConfig) -> np.ndarray:
    """Steps 1-3: float32 [3, H, W], normalized."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ParameterError(f"an image must be a PIL image, got {type(image).__name__}")
    if image.mode != "RGB":
        raise ParameterError(f"an image must be RGB (open_image converts it), got mode {image.mode!r}")
    w, h = image.size
    rh, rw = smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    img = image.resize((rw, rh), resample=Image.Resampling.BICUBIC)
    x = np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None, None]
    return (x - mean) / std


def patchify(x: np.ndarray, cfg: PrepConfig) -> tuple[np.ndarray, int, int]:
    """Step 4 (the processor's `patchify`): [3, H, W] -> [gh·gw, 3·t·p·p] in merge-window order."""
    c, hh, ww = x.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = hh // p, ww // p
    y = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    y = np.broadcast_to(y[:, :, :, :, :, None], (*y.shape[:5], t, p, p))
    return np.ascontiguousarray(y.reshape(gh * gw, c * t * p * p), dtype=np.float32), gh, gw


def prepare(image, cfg: PrepConfig) -> Prepared:
    """An RGB PIL image -> the tower's patch rows, its patch grid and the content digest (pixels and grid)."""
    patches, gh, gw = patchify(resized_pixels(image, cfg), cfg)
    h = hashlib.sha256()
    h.update(np.asarray([1, gh, gw], dtype=np.int64).tobytes())
    h.update(patches.tobytes())
    return Prepared(patches, (1, gh, gw), h.hexdigest())

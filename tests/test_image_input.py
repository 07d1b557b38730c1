"""format/image_input.open_image: every way an image is given, and each bad one refused with its typed error."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from fake_vision import png
from PIL import Image

from hybridinfer.errors import ParameterError
from hybridinfer.format.image_input import ImageBombError, ImageError, RemoteImageError, open_image


def _pixels(img) -> np.ndarray:
    return np.asarray(img)


def test_bytes_path_data_url_and_pil_give_the_same_rgb(tmp_path):
    data = png(40, 24, seed=3)
    p = tmp_path / "a.png"
    p.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    want = _pixels(Image.open(io.BytesIO(data)).convert("RGB"))
    for src in (data, str(p), p, url, Image.open(io.BytesIO(data))):
        img = open_image(src)
        assert img.mode == "RGB" and img.size == (40, 24)
        assert np.array_equal(_pixels(img), want)


def test_alpha_and_palette_become_rgb():
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    img = open_image(buf.getvalue())
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (10, 20, 30)  # alpha dropped, as llama.cpp's loader
    assert open_image(Image.new("P", (4, 4))).mode == "RGB"


def test_exif_orientation_is_applied():
    img = Image.fromarray(np.arange(6 * 4 * 3, dtype=np.uint8).reshape(4, 6, 3))  # 6 wide, 4 high
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif.tobytes())
    assert open_image(buf.getvalue()).size == (4, 6)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header(w: int, h: int) -> bytes:
    """A PNG declaring w x h pixels that holds a few bytes of pixel data."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        _chunk(b"IEND", b"")


def test_decompression_bomb_refused_from_its_header():
    with pytest.raises(ImageBombError, match="decompression bomb"):
        open_image(_png_header(100_000, 100_000))  # no pixel data at all: only the header was read


def test_large_image_under_the_bomb_limit_is_taken():
    assert open_image(png(4000, 40, seed=1)).size == (4000, 40)  # the tower resizes it, not this


@pytest.mark.parametrize("bad, what", [(b"not an image at all", "format"), (png(32, 32)[:60], "corrupt or truncated"),
                                        (b"", "empty")])
def test_bad_bytes_get_a_typed_error(bad, what):
    with pytest.raises(ImageError, match=what) as e:
        open_image(bad, what="image 3")
    assert isinstance(e.value, ParameterError) and "image 3" in str(e.value)


def test_bad_sources():
    with pytest.raises(RemoteImageError, match="--allow-remote-images"):
        open_image("https://example.com/cat.png")
    with pytest.raises(ImageError, match="base64"):
        open_image("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="not an image"):
        open_image("data:text/plain;base64,aGk=")
    with pytest.raises(ImageError, match="cannot read image file"):
        open_image("/nonexistent/x.png")
    with pytest.raises(ImageError, match="expected bytes"):
        open_image(12)
    with pytest.raises(ImageError, match="scheme"):
        open_image("ftp://host/x.png")

"""An image as the user gives it (bytes, a path, a `data:` URL, a PIL image) -> an RGB PIL image, or a typed error.

Every interface (Engine.generate(images=...), chat messages, the CLI, the server, batch lines) goes through
`open_image`, so a bad image is refused the same way everywhere. Pillow reads the header first (`Image.open` is
lazy): a decompression bomb is refused from its declared size before any pixel is decoded. An image larger than a
vision tower takes is not refused here: the tower resizes it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings

from ..errors import ParameterError


class ImageError(ParameterError):
    """An image cannot be used: its bytes are corrupt or truncated, its format is not one Pillow reads, it declares
    more pixels than the decompression-bomb limit, or it names a remote URL the caller did not allow. The message
    names the image (`what`) and the problem."""


class RemoteImageError(ImageError):
    """An image given as an http(s) URL while remote images are not allowed (`--allow-remote-images` off)."""


class ImageBombError(ImageError):
    """An image declaring more pixels than Pillow's MAX_IMAGE_PIXELS limit (checked from its header)."""


def _pil():
    from PIL import Image, ImageOps

    return Image, ImageOps


def _decode_data_url(url: str, what: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep:
        raise ImageError(f"{what}: a data: URL needs a ',' before its payload")
    meta = head[5:].split(";")
    if meta and meta[0] and not meta[0].startswith("image/"):
        raise ImageError(f"{what}: a data: URL of media type {meta[0]!r} is not an image")
    if "base64" not in meta[1:]:
        from urllib.parse import unquote_to_bytes

        return unquote_to_bytes(body)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what}: the base64 payload of the data: URL is invalid ({e})") from None


def image_bytes(source, *, allow_remote: bool = False, what: str = "image") -> bytes | object:
    """The bytes of `source` (a data: URL, an http(s) URL when allowed, a path, bytes), or a PIL image as it is."""
    Image, _ = _pil()
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise ImageError(f"{what}: expected bytes, a path, a data: or http(s) URL, or a PIL image; got "
                         f"{type(source).__name__}")
    low = source[:16].lower()
    if low.startswith("data:"):
        return _decode_data_url(source, what)
    if low.startswith(("http://", "https://")):
        if not allow_remote:
            raise RemoteImageError(f"{what}: remote image URLs are not allowed ({source[:80]!r}); send the image as a "
                                   "data: URL, or start the server with --allow-remote-images")
        return _fetch(source, what)
    if "://" in source[:16]:
        raise ImageError(f"{what}: unsupported URL scheme in {source[:80]!r} (data:, http: or https: only)")
    try:
        with open(source, "rb") as f:
            return f.read()
    except OSError as e:
        raise ImageError(f"{what}: cannot read image file {source!r}: {e.strerror or e}") from None


def _fetch(url: str, what: str, limit: int = 64 << 20, timeout: float = 20.0) -> bytes:
    from urllib.request import Request, urlopen

    try:
        with urlopen(Request(url, headers={"User-Agent": "hybridinfer"}), timeout=timeout) as r:
            data = r.read(limit + 1)
    except OSError as e:
        raise ImageError(f"{what}: cannot fetch {url[:80]!r}: {e}") from None
    if len(data) > limit:
        raise ImageError(f"{what}: {url[:80]!r} is larger than {limit >> 20} MiB")
    return data


def open_image(source, *, allow_remote: bool = False, what: str = "image"):
    """`source` as an RGB PIL image with its EXIF orientation applied. `what` names it in errors ("image 2",
    "messages[0].content[1]")."""
    Image, ImageOps = _pil()
    src = image_bytes(source, allow_remote=allow_remote, what=what)
    if isinstance(src, Image.Image):
        img = src
    else:
        if not src:
            raise ImageError(f"{what}: the image is empty (0 bytes)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(src))
                _check_bomb(img, what)
                img.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageBombError(f"{what}: refused as a decompression bomb: {e}") from None
        except Image.UnidentifiedImageError:
            raise ImageError(f"{what}: not an image in a format this build of Pillow reads "
                             f"({len(src)} bytes starting {src[:8]!r})") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise ImageError(f"{what}: the image data is corrupt or truncated ({e})") from None
    try:
        img = ImageOps.exif_transpose(img)
    except Exception as e:  # noqa: BLE001 - a broken EXIF block is the image's fault, said as such
        raise ImageError(f"{what}: its EXIF orientation cannot be applied ({e})") from None
    return img if img.mode == "RGB" else _to_rgb(img)


def _check_bomb(img, what: str) -> None:
    """Pillow warns over MAX_IMAGE_PIXELS and raises over twice it; both refused, from the header's size."""
    Image, _ = _pil()
    limit = Image.MAX_IMAGE_PIXELS
    w, h = img.size
    if limit and w * h > limit:
        raise ImageBombError(f"{what}: refused as a decompression bomb: {w}x{h} = {w * h} pixels exceeds the limit "
                             f"of {limit} pixels")


def _to_rgb(img):
    """RGB with any alpha dropped, not composited: llama.cpp's loader (stb_image asked for 3 channels) does the same,
    so both engines see the same pixels."""
    return img.convert("RGB")

"""Images in prompts: where they go in the token ids, their embeddings (encoded once per image), their rows.

A prompt names its images (chat messages' image parts, `images=[...]` beside any prompt); each becomes, as the
Qwen3.5 chat template writes an image part and llama.cpp's mtmd lays it out, `<|vision_start|>` then one
`<|image_pad|>` per image token then `<|vision_end|>`. Rendering and tokenizing write one `<|image_pad|>` per image
(a slot; in a chat it is template markup, so text a user sends can never make one); `attach` then encodes each
image (`Engine.image_encoder`, part of an mmproj file) and widens its slot to its n_tokens rows, as
`models/mrope.ImageSpan`s that go with the Request to its DecoderState (the rows' embeddings and rotary positions).

Raw text prompts mark where each image goes with llama.cpp's media marker `<__media__>`; without one the images
go first. Embeddings are kept by a hash of the image's pixels (ImageStore), so an image sent again (the next turn
of a chat) is not encoded again, and the prefix cache keys a snapshot by the digests of the images before it.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import ParameterError
from ..format.image_input import ImageError, open_image
from ..models.mrope import ImageSpan
from ..models.vision_types import ImageEmbedding
from .image_encoder import EmbeddingLRU

MEDIA_MARKER = "<__media__>"  # llama.cpp's mtmd_default_marker
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
MARKUP = VISION_START + IMAGE_PAD + VISION_END
IMAGE_PART_TYPES = ("image", "image_url", "input_image")


class NoImageEncoderError(ParameterError):
    """A prompt holds an image but the model was loaded without a vision tower (no --mmproj)."""


# ---- where images are in a prompt ----------------------------------------------------------------------------

def part_source(part: dict, where: str):
    """The image of one content part: engine `{"type": "image", "image": PIL|path|bytes}`, OpenAI
    `{"type": "image_url", "image_url": {"url": ...}}` (or the url as a string), Responses
    `{"type": "input_image", "image_url": ...}`."""
    t = part.get("type")
    v = part.get("image") if t == "image" else part.get("image_url")
    if isinstance(v, dict):
        v = v.get("url")
    if v is None:
        raise ImageError(f"{where}: an image part of type {t!r} without its image")
    return v


def _is_image(p) -> bool:
    return isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES


def has_images(messages) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list | tuple) and any(map(_is_image, m["content"]))
               for m in messages)


@dataclass(frozen=True)
class Named:
    """An image with the place it came from, which its errors name ("messages[0].content[1]")."""

    source: object
    where: str


def chat_sources(messages) -> list[Named]:
    """The images of chat messages, in the order the template writes them (message by message, part by part)."""
    out = []
    for i, m in enumerate(messages):
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, list | tuple):
            out += [Named(part_source(p, f"messages[{i}].content[{j}]"), f"messages[{i}].content[{j}]")
                    for j, p in enumerate(c) if _is_image(p)]
    return out


def chat_markup(messages):
    """(messages, put): each image part made a text part holding a marker no user text holds (a fresh nonce), the
    content of a message with images joined into one string (so every template takes it); put(ChatText) turns
    each marker in the rendered chat into MARKUP, as template markup (control tokens). Messages without images
    come back as they are, and put leaves their ChatText alone."""
    if not has_images(messages):
        return messages, lambda chat: chat
    marker = f"[[hi-image-{secrets.token_hex(8)}]]"
    out = []
    for i, m in enumerate(messages):
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, list | tuple) and any(map(_is_image, c)):
            text = []
            for j, p in enumerate(c):
                if _is_image(p):
                    text.append(marker)
                elif isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str):
                    text.append(p["text"])
                else:
                    raise ParameterError(f"messages[{i}].content[{j}]: a content part of type "
                                         f"{p.get('type') if isinstance(p, dict) else type(p).__name__!r} is not "
                                         "supported beside images (text and image parts only)")
            m = {**m, "content": "".join(text)}
        out.append(m)
    return out, lambda chat: _put_markup(chat, marker)


def _put_markup(chat, marker: str):
    """chat with each marker replaced by MARKUP, the spans of guarded text moved with it."""
    from ..format.chat_text import ChatText

    pieces = chat.text.split(marker)
    if len(pieces) == 1:
        return chat
    starts, n = [], 0  # start of each marker in the old text
    for p in pieces[:-1]:
        n += len(p)
        starts.append(n)
        n += len(marker)
    d = len(MARKUP) - len(marker)
    move = lambda x: x + d * sum(1 for s in starts if s < x)  # noqa: E731
    spans = tuple((move(a), move(b)) for a, b in chat.spans)
    return ChatText(MARKUP.join(pieces), spans, chat.guarded)


def text_markup(text: str, n_images: int) -> str:
    """A raw prompt with its media markers as MARKUP; without any, the images' MARKUP first."""
    k = text.count(MEDIA_MARKER)
    if k == 0:
        return MARKUP * n_images + text
    if k != n_images:
        raise ParameterError(f"the prompt has {k} media markers {MEDIA_MARKER!r} for {n_images} images")
    return text.replace(MEDIA_MARKER, MARKUP)


def prepare(prompt, images):
    """(prompt with every image's slot, the images in slot order) for Engine.make_request. `images` beside a chat
    go first in its last user message; beside token ids, each `<|image_pad|>` id is one image's slot."""
    extra = list(images or ())
    if isinstance(prompt, str):
        return (text_markup(prompt, len(extra)) if extra else prompt), extra
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt):
        msgs = list(prompt)
        if extra:
            k = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
            if k is None:
                raise ParameterError("images were given beside a chat with no user message to put them in")
            c = msgs[k].get("content")
            parts = list(c) if isinstance(c, list | tuple) else ([{"type": "text", "text": c}] if c else [])
            msgs[k] = {**msgs[k], "content": [{"type": "image", "image": s} for s in extra] + parts}
        return msgs, chat_sources(msgs)
    return prompt, extra


# ---- embeddings ----------------------------------------------------------------------------------------------

class ImageStore:
    """Encoded images by a hash of their RGB pixels (least recently used out beyond `max_bytes` of rows); `encoded`
    counts the encoder's calls. Thread-safe; the encoder runs beside the scheduler's steps, under its own lock."""

    def __init__(self, max_bytes: int = 512 << 20):
        self.encoded = 0
        self._c = EmbeddingLRU(int(max_bytes))  # keyed by pixel_key
        self._lock = threading.Lock()

    @staticmethod
    def pixel_key(img) -> str:
        h = hashlib.blake2b(f"{img.size}|{img.mode}".encode(), digest_size=16)
        h.update(img.tobytes())
        return h.hexdigest()

    def get(self, engine, img) -> ImageEmbedding:
        key = self.pixel_key(img)
        with self._lock:
            hit = self._c.get(key)
            if hit is not None:
                return hit
        enc = getattr(engine, "image_encoder", None)
        if enc is None:
            raise NoImageEncoderError(f"{getattr(engine.gm, 'path', 'the model')!r} was loaded without a vision "
                                      "tower: it takes no images (load it with its mmproj file, --mmproj)")
        emb = enc.encode(img)  # not under the engine's lock: the tower has its own (engine/image_encoder.py), and
        # holding the engine's would stall every running stream for the seconds a large image takes
        if emb.rows.shape[1] != engine.args.n_embd:
            raise ParameterError(f"the image encoder gives rows of {emb.rows.shape[1]} values for a model of "
                                 f"n_embd={engine.args.n_embd}")
        with self._lock:
            self.encoded += 1
            self._c.put(emb, key)
        return emb


def store_of(engine) -> ImageStore:
    s = getattr(engine, "image_store", None)
    if s is None:
        s = engine.image_store = ImageStore()
    return s


def embed(engine, sources, allow_remote: bool = False) -> list[ImageEmbedding]:
    """Each image (an ImageEmbedding as it is, or anything open_image takes) encoded, or from the store."""
    if sources and getattr(engine, "image_encoder", None) is None:
        raise NoImageEncoderError(f"{getattr(engine.gm, 'path', 'the model')!r} was loaded without a vision tower: "
                                  "it takes no images (load it with its mmproj file, --mmproj)")
    out = []
    for k, s in enumerate(sources):
        what = s.where if isinstance(s, Named) else f"image {k}"
        s = s.source if isinstance(s, Named) else s
        if isinstance(s, ImageEmbedding):
            out.append(s)
        else:
            out.append(store_of(engine).get(engine, open_image(s, allow_remote=allow_remote, what=what)))
    return out


# ---- slots to rows -----------------------------------------------------------------------------------------

def vision_ids(tokenizer) -> tuple[int, int, int]:
    ids = tuple(tokenizer.token_id(t) if tokenizer is not None else None for t in (VISION_START, IMAGE_PAD,
                                                                                    VISION_END))
    if None in ids:
        raise ParameterError("this model's vocabulary has no vision tokens (<|vision_start|>, <|image_pad|>, "
                             "<|vision_end|>): it takes no images")
    return ids  # type: ignore[return-value]


def attach(engine, ids: list[int], embeddings: list[ImageEmbedding]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """ids with each `<|image_pad|>` slot widened to its image's rows (slots and images in order), and the spans."""
    pad = vision_ids(engine.tokenizer)[1]
    slots = [i for i, t in enumerate(ids) if t == pad]
    if len(slots) != len(embeddings):
        raise ParameterError(f"the prompt has {len(slots)} image slots for {len(embeddings)} images")
    out, spans, last = [], [], 0
    for s, e in zip(slots, embeddings, strict=True):
        out += ids[last:s]
        spans.append(ImageSpan(len(out), tuple(int(x) for x in e.grid), e.digest,
                               np.ascontiguousarray(e.rows, dtype=np.float32)))
        out += [pad] * e.n_tokens
        last = s + 1
    return out + ids[last:], tuple(spans)


def map_points(points, spans) -> tuple[int, ...] | None:
    """Positions in the slot ids (one pad an image) as positions in the widened ids."""
    if points is None:
        return None
    pts = (points,) if isinstance(points, int | np.integer) else tuple(points)
    slot_at, extra = [], 0
    for s in spans:
        slot_at.append((s.row - extra, s.n_tokens - 1))
        extra += s.n_tokens - 1
    return tuple(int(p) + sum(d for at, d in slot_at if at < p) for p in pts)

"""Where a sequence's images sit and the multimodal rotary positions of its rows (Qwen3.5's IMROPE).

A sequence's rows are its prompt's tokens; an image takes n_tokens = t*h*w rows (its `<|image_pad|>` tokens, whose
embeddings are the encoder's rows), but only max(t, h, w) rotary positions, as llama.cpp's mtmd lays it out
(MTMD_POS_TYPE_MROPE): image row i at base (t), base + its row in the merged grid (h), base + its column (w), 0;
the text after it continues at base + max(t, h, w). A text row's four positions are equal, so a sequence without
images gets the plain positions 0, 1, 2 .. and the plain rope's bits. After an image a row's position is its row
plus `shift_at` (negative). The layout belongs to the request (its prompt says where each image is), so a state
restored from a snapshot takes it from the request, and the prefix cache keys a snapshot by the images before it.

Every backend reads `positions(state.images, p0, T)` for a call over rows p0..p0+T and `imrope_streams` for which
of the four positions each rotary pair takes (docs/gguf-qwen35.md §4 step 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ImageSpan:
    """One image in a sequence: its first row, its grid of merged tokens (t, h, w), its encoder rows
    (float32 [t*h*w, n_embd], which replace the image tokens' embeddings) and its digest."""

    row: int
    grid: tuple[int, int, int]
    digest: str
    rows: np.ndarray = field(compare=False, repr=False)

    @property
    def n_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def n_pos(self) -> int:
        return max(self.grid)

    @property
    def end(self) -> int:
        return self.row + self.n_tokens


def shift_at(spans, row: int) -> int:
    """Rotary position minus row index of a text row at `row`: what the images wholly before it saved."""
    return sum(s.n_pos - s.n_tokens for s in spans if s.end <= row)


def positions(spans, p0: int, T: int) -> tuple[int, np.ndarray | None]:
    """The rotary positions of rows p0..p0+T: (shift, None) when no image row is among them (row r at r + shift),
    else (0, int32 (T, 4)) with each row's (t, h, w, e) positions."""
    inside = [s for s in spans if s.row < p0 + T and s.end > p0]
    if not inside:
        return shift_at(spans, p0), None
    rows = np.arange(p0, p0 + T, dtype=np.int64)
    out = np.empty((T, 4), np.int64)
    ends = np.array([s.end for s in spans], np.int64)
    saved = np.concatenate([[0], np.cumsum([s.n_pos - s.n_tokens for s in spans])]).astype(np.int64)
    order = np.argsort(ends, kind="stable")
    shift = saved[np.searchsorted(ends[order], rows, side="right")] if (order == np.arange(len(spans))).all() \
        else np.array([shift_at(spans, r) for r in rows], np.int64)  # spans out of order: the plain sum
    out[:] = (rows + shift)[:, None]
    for s in inside:
        a, b = max(s.row, p0), min(s.end, p0 + T)
        i = np.arange(a - s.row, b - s.row)
        _, h, w = s.grid
        base = s.row + shift_at(spans, s.row)
        sl = slice(a - p0, b - p0)
        out[sl, 0] = base
        out[sl, 1] = base + (i % (h * w)) // w
        out[sl, 2] = base + i % w
        out[sl, 3] = 0
    return 0, out.astype(np.int32)


def imrope_streams(sections, n_pairs: int) -> np.ndarray:
    """Which of a row's four positions (t, h, w, e) rotary pair i takes, llama.cpp's interleaved rule
    (ggml_mrope_cache_init with is_imrope): sector = i mod sum(sections); sector mod 3 == 1 below 3*sections[1]
    -> h, == 2 below 3*sections[2] -> w, == 0 below 3*sections[0] -> t, else e. No sections: all t."""
    secs = [int(x) for x in (tuple(sections) + (0, 0, 0, 0))[:4]]
    total = sum(secs)
    out = np.zeros(n_pairs, np.int32)
    if total <= 0:
        return out
    for i in range(n_pairs):
        sec = i % total
        if sec % 3 == 1 and sec < 3 * secs[1]:
            out[i] = 1
        elif sec % 3 == 2 and sec < 3 * secs[2]:
            out[i] = 2
        elif sec % 3 == 0 and sec < 3 * secs[0]:
            out[i] = 0
        else:
            out[i] = 3
    return out


def mrope_table(streams: np.ndarray, pos4: np.ndarray) -> np.ndarray:
    """The native table (hi_rope_multi's mrope): the pairs' streams, then each row's four positions, int32."""
    return np.ascontiguousarray(np.concatenate([streams.astype(np.int32), pos4.astype(np.int32).reshape(-1)]))


def image_rows(spans, p0: int, T: int):
    """(first, last) rows of the call p0..p0+T that take an image's encoder rows, with those rows: [(a, b, rows)]
    with a, b relative to p0."""
    out = []
    for s in spans:
        a, b = max(s.row, p0), min(s.end, p0 + T)
        if a < b:
            out.append((a - p0, b - p0, s.rows[a - s.row : b - s.row]))
    return out

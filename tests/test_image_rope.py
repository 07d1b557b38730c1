"""Multimodal rotary positions (Qwen3.5's IMROPE, models/mrope.py): the layout of an image's positions as llama.cpp's
mtmd gives them, the rope on the reference and the CPU against a plain re-implementation of llama.cpp's
ggml_mrope_cache_init, and text rows unchanged (the same bits as the plain rope)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends import reference_ops as op
from hybridinfer.models import mrope
from hybridinfer.models.mrope import ImageSpan

pytestmark = pytest.mark.isa  # native kernels of every SIMD unit: CI runs these at each level

SECTIONS = (11, 11, 10, 0)  # the released Qwen3.5's rope.dimension_sections (n_rot 64)


def _span(row, h, w, digest="d"):
    return ImageSpan(row, (1, h, w), digest, np.zeros((h * w, 4), np.float32))


def test_positions_follow_mtmd_layout():
    """Text 0..4, an image of 2 x 3 at rows 5..10 (mtmd: t = 5, h = 5 + row, w = 5 + col), text from 5 + max(2, 3)."""
    spans = (_span(5, 2, 3),)
    shift, p4 = mrope.positions(spans, 0, 14)
    assert shift == 0
    want = [[p] * 4 for p in range(5)]
    want += [[5, 5 + i // 3, 5 + i % 3, 0] for i in range(6)]
    want += [[p] * 4 for p in (8, 9, 10)]
    assert p4.tolist() == want
    assert mrope.positions(spans, 11, 3) == (3 - 6, None)  # after it: plain rows, 3 positions for 6 rows
    assert mrope.positions(spans, 0, 5) == (0, None)
    assert mrope.positions((), 7, 2) == (0, None)
    # a chunk cut inside the image sees the same positions as one pass
    assert np.array_equal(np.concatenate([mrope.positions(spans, 0, 7)[1], mrope.positions(spans, 7, 7)[1]]), p4)


def test_two_images_shift_add_up():
    spans = (_span(1, 2, 2, "a"), _span(6, 1, 4, "b"))  # 4 rows for 2 positions, 4 rows for 4 positions
    assert mrope.shift_at(spans, 5) == -2 and mrope.shift_at(spans, 10) == -2
    _, p4 = mrope.positions(spans, 6, 5)
    assert p4[:4].tolist() == [[4, 4, 4 + i, 0] for i in range(4)]  # row 6 is position 6 - 2
    assert p4[4].tolist() == [8] * 4


def _llama_streams(sections, n_pairs):
    """ggml_mrope_cache_init's is_imrope branch, written from its source."""
    s0, s1, s2, s3 = sections
    sect_dims = s0 + s1 + s2 + s3
    out = []
    for i in range(n_pairs):
        sector = i % sect_dims
        if sector % 3 == 1 and sector < 3 * s1:
            out.append(1)
        elif sector % 3 == 2 and sector < 3 * s2:
            out.append(2)
        elif sector % 3 == 0 and sector < 3 * s0:
            out.append(0)
        else:
            out.append(3)
    return out


def _llama_rope(x, pos4, sections, n_rot, theta):
    """llama.cpp's IMROPE (NEOX pairs) in float32 as ggml computes it: each stream's theta starts at its position and
    is multiplied by theta_scale = base^(-2/n_rot) once per pair."""
    T, H, hd = x.shape
    half = n_rot // 2
    ts = np.float32(theta) ** np.float32(-2.0 / n_rot)
    streams = _llama_streams(sections, half)
    out = x.copy()
    for t in range(T):
        th = [np.float32(p) for p in pos4[t]]
        cs, sn = np.zeros(half, np.float32), np.zeros(half, np.float32)
        for i in range(half):
            a = th[streams[i]]
            cs[i], sn[i] = np.cos(a, dtype=np.float32), np.sin(a, dtype=np.float32)
            th = [np.float32(v * ts) for v in th]
        a, b = x[t, :, :half], x[t, :, half:n_rot]
        out[t, :, :half] = a * cs - b * sn
        out[t, :, half:n_rot] = b * cs + a * sn
    return out


@pytest.mark.parametrize("sections, n_rot", [(SECTIONS, 64), ((3, 3, 2, 0), 16), ((2, 1, 1, 0), 16)])
def test_streams_equal_llama_rule(sections, n_rot):
    assert mrope.imrope_streams(sections, n_rot // 2).tolist() == _llama_streams(sections, n_rot // 2)


def _case(seed=0, T=9):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, 3, 80)).astype(np.float32)
    _, p4 = mrope.positions((_span(2, 2, 3),), 0, T)
    return x, p4


def test_reference_imrope_equals_llama_formula():
    x, p4 = _case()
    got = op.rope(x, p4, 64, 1e7, True, None, mrope.imrope_streams(SECTIONS, 32))
    want = _llama_rope(x, p4, SECTIONS, 64, 1e7)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert np.array_equal(got[..., 64:], x[..., 64:])  # past n_rot: untouched


def test_text_rows_keep_the_plain_rope_bits():
    x = np.random.default_rng(1).standard_normal((6, 2, 64)).astype(np.float32)
    pos = np.arange(40, 46)
    streams = mrope.imrope_streams(SECTIONS, 32)
    assert np.array_equal(op.rope(x, np.repeat(pos[:, None], 4, 1), 64, 1e7, True, None, streams),
                          op.rope(x, pos, 64, 1e7, True))


def test_cpu_imrope_equals_llama_formula_and_text_bits():
    from hybridinfer.backends.cpu.simd import SimdLib

    lib = SimdLib(n_threads=1)
    try:
        x, p4 = _case(2)
        streams = mrope.imrope_streams(SECTIONS, 32)
        y = np.ascontiguousarray(x[..., :64])
        lib.rope(y, 0, 64, 1e7, True, np.zeros(0, np.float32), mrope=mrope.mrope_table(streams, p4))
        np.testing.assert_allclose(y, _llama_rope(x[..., :64], p4, SECTIONS, 64, 1e7), rtol=0, atol=2e-5)
        # text rows through the multimodal path, and a shift, give the plain rope's bits
        t = np.ascontiguousarray(x[..., :64])
        plain, multi, shifted = t.copy(), t.copy(), t.copy()
        lib.rope(plain, 30, 64, 1e7, True, np.zeros(0, np.float32))
        rows = np.arange(30, 30 + len(t))
        lib.rope(multi, 0, 64, 1e7, True, np.zeros(0, np.float32),
                 mrope=mrope.mrope_table(streams, np.repeat(rows[:, None], 4, 1)))
        lib.rope(shifted, 37, 64, 1e7, True, np.zeros(0, np.float32), shift=-7)
        assert np.array_equal(plain, multi) and np.array_equal(plain, shifted)
    finally:
        lib.close()

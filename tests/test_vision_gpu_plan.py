"""The card's vision tower memory, without a card (backends/gpu/vision_plan.py): padding, the products' shapes and
bytes, the activation buffers an image takes, and the resident / streamed / CPU choice from the sizes."""

from __future__ import annotations

import dataclasses

import pytest

from hybridinfer.backends.gpu import vision_plan as vp
from hybridinfer.format.image_prep import PrepConfig
from hybridinfer.models.qwen3vl_vision import VisionArgs, matrix_names


def _args(c=1152, f=4304, layers=27, heads=16, out=2048, max_pixels=1 << 20) -> VisionArgs:
    prep = PrepConfig(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=(0.5,) * 3,
                      image_std=(0.5,) * 3, min_pixels=4096, max_pixels=max_pixels)
    return VisionArgs(n_embd=c, n_ff=f, n_layer=layers, n_head=heads, patch_size=16, merge_size=2, pos_side=48,
                      eps=1e-6, out_dim=out, prep=prep)


def test_padded_steps_of_32():
    assert [vp.padded(k) for k in (1, 32, 33, 48, 4304, 4320)] == [32, 32, 64, 64, 4320, 4320]


def test_matrix_shapes_and_bytes():
    a = _args()
    assert vp.matrix_shape(a, "v.patch_embd") == (1152, 1536)
    assert vp.matrix_shape(a, "v.blk.3.attn_qkv") == (3456, 1152)
    assert vp.matrix_shape(a, "v.blk.26.ffn_down") == (1152, 4304)
    assert vp.matrix_shape(a, "mm.0") == (4608, 4608) and vp.matrix_shape(a, "mm.2") == (2048, 4608)
    with pytest.raises(KeyError):
        vp.matrix_shape(a, "v.blk.0.ffn_gate")
    b = vp.matrix_bytes(a, lambda n: 2)
    assert set(b) == set(matrix_names(a))
    assert b["v.blk.0.ffn_down"] == 1152 * 4320 * 2  # K padded to 4320
    assert b["v.blk.0.ffn_up"] == 4304 * 1152 * 2  # N is not padded
    assert vp.matrix_bytes(a, lambda n: 4 if n == "mm.2" else 2)["mm.2"] == 2048 * 4608 * 4


def test_stages_cover_every_product_once_in_order():
    a = _args(layers=3)
    st = vp.stages(a)
    assert st[0] == ("v.patch_embd",) and st[-1] == ("mm.0", "mm.2") and len(st) == 5
    assert st[2] == tuple(f"v.blk.1.{p}" for p in ("attn_qkv", "attn_out", "ffn_up", "ffn_down"))
    assert [n for s in st for n in s] == matrix_names(a)


def test_buffers_hold_every_view_the_forward_takes():
    a = _args(c=48, f=72, layers=2, heads=4, out=40)  # C, F, 4C padded: 64, 96, 192
    n = 140
    b = vp.buffer_floats(a, n)
    assert b["x"] == n * 64 and b["qkv"] == 3 * n * 48 and b["o"] == n * 48 and b["rope"] == 2 * n * 12
    assert b["h"] >= max(n * 64, n * 1536, 35 * 192)  # LayerNorm rows, patch rows, merged rows: padded
    assert b["y"] >= max(n * 144, n * 72, 35 * 192, 35 * 40)  # the products' outputs
    assert b["g"] >= max(n * 96, 35 * 192)  # the GELU's padded rows
    assert vp.activation_bytes(a, n) == 4 * sum(b.values())
    assert vp.activation_bytes(a, 2 * n) > vp.activation_bytes(a, n)
    assert vp.max_patches(a) == (1 << 20) // 256


def test_plan_resident_streamed_cpu():
    w = {"a": 100, "b1": 300, "b2": 300, "m": 200}
    stages = [("a",), ("b1",), ("b2",), ("m",)]
    vec, act = 10, 50
    p = vp.plan_tower(w, stages, vec, act, 10**6)
    assert p.mode == vp.RESIDENT and p.reserve == 900 + vec + act and p.weights == 900 and p.activations == act
    assert vp.plan_tower(w, stages, vec, act, 960).mode == vp.RESIDENT  # exactly the need
    p = vp.plan_tower(w, stages, vec, act, 959)
    assert p.mode == vp.STREAMED and p.reserve == 300 + vec + act == 360 and p.weights == 300
    assert vp.plan_tower(w, stages, vec, act, 360).mode == vp.STREAMED
    p = vp.plan_tower(w, stages, vec, act, 359)
    assert p.mode == vp.CPU and p.reserve == 0
    # a stage is all its products at once
    assert vp.plan_tower(w, [("a",), ("b1", "b2"), ("m",)], vec, act, 500).mode == vp.CPU


def test_tower_plan_of_the_published_shape():
    a = _args(max_pixels=1024 * 768)
    whole = sum(vp.matrix_bytes(a, lambda n: 2).values())
    act = vp.activation_bytes(a, vp.max_patches(a))
    vec = 4 * vp.vector_floats(a)
    assert vp.tower_plan(a, lambda n: 2, whole + act + vec).mode == vp.RESIDENT
    p = vp.tower_plan(a, lambda n: 2, whole + act + vec - 1)
    mb = vp.matrix_bytes(a, lambda n: 2)
    assert p.mode == vp.STREAMED and p.weights == mb["mm.0"] + mb["mm.2"]  # the merger's: the largest stage
    assert vp.tower_plan(a, lambda n: 2, 0).mode == vp.CPU
    # a larger image limit needs more room
    big = dataclasses.replace(a, prep=dataclasses.replace(a.prep, max_pixels=4 * 1024 * 768))
    assert vp.tower_plan(big, lambda n: 2, whole + act + vec).mode != vp.RESIDENT

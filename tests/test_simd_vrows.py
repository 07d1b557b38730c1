"""The SIMD library's vision row ops (native/simd/vrows.c through SimdLib.layer_norm, gelu_tanh, gelu_erf,
rope_heads) give the bits of the numba kernels they replace (backends/cpu/vision_kernels.py) on every unit this CPU
runs, on one thread and on three (rows split over the pool), at edge shapes: one row, rows that are no multiple of
a chunk, odd widths, strided rows; and refuse bad arrays naming what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.cpu import vision_kernels as vk
from hybridinfer.backends.cpu.simd import SimdLib, supported_isas
from hybridinfer.errors import KernelArgumentError

_LIBS: dict = {}


def _lib(isa: str, threads: int) -> SimdLib:
    if (isa, threads) not in _LIBS:
        _LIBS[(isa, threads)] = SimdLib(isa, threads)
    return _LIBS[(isa, threads)]


UNITS = [(isa, t) for isa in supported_isas() for t in (1, 3)]
SHAPES = [(1, 1152), (37, 1152), (130, 1153), (5, 7)]


def _x(shape, seed, scale=3.0, offset=0.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale + offset).astype(np.float32)


@pytest.mark.parametrize("isa,threads", UNITS)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_bits_of_numba(isa, threads, shape):
    lib = _lib(isa, threads)
    n = shape[1]
    w, b = _x(n, 1), _x(n, 2)
    for seed, offset in ((3, 0.0), (4, 1000.0), (5, -3e4)):  # large offsets: the double statistics matter
        x = _x(shape, seed, offset=offset)
        want = np.empty_like(x)
        vk.layer_norm_rows(x, want, w, b, 1e-6)
        got = lib.layer_norm(x, w, b, 1e-6, np.full_like(x, np.nan))
        assert np.array_equal(got, want), (isa, threads, shape, offset)
    # strided rows in and out (views of wider rows)
    wide, out = _x((shape[0], n + 9), 6, offset=50.0), np.full((shape[0], n + 3), np.nan, np.float32)
    want = np.empty((shape[0], n), np.float32)
    vk.layer_norm_rows(np.ascontiguousarray(wide[:, :n]), want, w, b, 1e-5)
    lib.layer_norm(wide[:, :n], w, b, 1e-5, out[:, :n])
    assert np.array_equal(out[:, :n], want) and np.isnan(out[:, n:]).all()


def _gelu_input(shape, seed):
    x = _x(shape, seed)
    flat = x.reshape(-1)
    edges = np.array([0, 1e-30, -1e-30, 9, -9, 30, -30, 100, -100, 1e4, -1e4, 3.4e38, -3.4e38], np.float32)
    flat[: min(flat.size, edges.size)] = edges[: flat.size]
    return x


@pytest.mark.parametrize("isa,threads", UNITS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["tanh", "erf"])
def test_gelus_bits_of_numba(isa, threads, shape, kind):
    lib = _lib(isa, threads)
    kernel, op = (vk.gelu_tanh_rows, lib.gelu_tanh) if kind == "tanh" else (vk.gelu_erf_rows, lib.gelu_erf)
    x, bias = _gelu_input(shape, 7), _x(shape[1], 8)
    want = np.empty_like(x)
    kernel(x, want, bias)
    got = op(x, bias, np.full_like(x, np.nan))
    assert np.array_equal(got, want), (isa, threads, shape, kind)
    inplace = x.copy()
    assert op(inplace, bias, inplace) is inplace and np.array_equal(inplace, want)  # out may be x
    # no bias: v = x (numba's with a zero bias, for inputs without a -0)
    kernel(x, want, np.zeros(shape[1], np.float32))
    assert np.array_equal(op(x, None, np.empty_like(x)), want)
    # strided rows
    wide = np.concatenate([x, _x((shape[0], 5), 9)], axis=1)
    out = np.full((shape[0], shape[1] + 2), np.nan, np.float32)
    kernel(x, want, bias)
    op(wide[:, : shape[1]], bias, out[:, : shape[1]])
    assert np.array_equal(out[:, : shape[1]], want) and np.isnan(out[:, shape[1]:]).all()


@pytest.mark.parametrize("isa,threads", UNITS)
@pytest.mark.parametrize("rows,heads,hd", [(1, 2, 8), (37, 3, 16), (100, 16, 72), (21, 2, 260)])  # 260: past the tile
def test_rope_heads_both_k_layouts(isa, threads, rows, heads, hd):
    from hybridinfer.models.qwen3vl_vision import rotate

    lib = _lib(isa, threads)
    qkv = _x((rows, 3, heads, hd), 10)
    ang = _x((rows, hd), 11)
    cos, sin = np.cos(ang), np.sin(ang)
    q, k = rotate(qkv[:, 0], cos, sin), rotate(qkv[:, 1], cos, sin)
    for k_t in (True, False):
        qh, vh = (np.full((heads, rows, hd), np.nan, np.float32) for _ in range(2))
        kk = np.full((heads, hd, rows) if k_t else (heads, rows, hd), np.nan, np.float32)
        lib.rope_heads(qkv, cos, sin, qh, kk, vh, k_transposed=k_t)
        assert np.array_equal(qh, q.transpose(1, 0, 2))
        assert np.array_equal(kk, k.transpose(1, 2, 0) if k_t else k.transpose(1, 0, 2))
        assert np.array_equal(vh, qkv[:, 2].transpose(1, 0, 2))
    want = [np.empty_like(a) for a in (qh, np.empty((heads, hd, rows), np.float32), vh)]
    vk.rope_heads(0, rows, qkv, cos, sin, *want)
    got = [np.empty_like(a) for a in want]
    lib.rope_heads(qkv, cos, sin, *got)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_thread_counts_and_units_agree_on_tower_shapes():
    """784 rows of 1152 (a 448x448 image's tower): every unit and thread count, the same bits."""
    x, w, b = _x((784, 1152), 12, offset=7.0), _x(1152, 13), _x(1152, 14)
    outs = []
    for isa, threads in UNITS:
        lib = _lib(isa, threads)
        ln = lib.layer_norm(x, w, b, 1e-6, np.empty_like(x))
        outs.append((ln, lib.gelu_tanh(x, b, np.empty_like(x)), lib.gelu_erf(x, b, np.empty_like(x))))
    assert all(np.array_equal(a, z) for o in outs[1:] for a, z in zip(o, outs[0], strict=True))


def test_bad_arrays_refused_naming_them():
    lib = _lib(supported_isas()[0], 1)
    x, w = _x((4, 8), 15), _x(8, 16)
    out = np.empty_like(x)
    with pytest.raises(KernelArgumentError, match=r"layer_norm: w must be 8 contiguous float32 values, got float32 "
                                                  r"\(7,\)"):
        lib.layer_norm(x, w[:7], w, 1e-6, out)
    with pytest.raises(KernelArgumentError, match="layer_norm: x must have dtype float32, got float64"):
        lib.layer_norm(x.astype(np.float64), w, w, 1e-6, out)
    with pytest.raises(KernelArgumentError, match=r"layer_norm: out has shape \(3, 8\), expected \(4, 8\)"):
        lib.layer_norm(x, w, w, 1e-6, out[:3])
    with pytest.raises(KernelArgumentError, match="layer_norm: out must not share memory with x"):
        lib.layer_norm(x, w, w, 1e-6, x)
    with pytest.raises(KernelArgumentError, match="gelu_tanh: x is not C-contiguous within rows"):
        lib.gelu_tanh(x[:, ::2], None, out[:, :4])
    with pytest.raises(KernelArgumentError, match="gelu_erf: bias must be 8 contiguous float32 values"):
        lib.gelu_erf(x, w[::-1][::2], out)
    with pytest.raises(KernelArgumentError, match="gelu_tanh: out must be x itself or not share memory with it"):
        lib.gelu_tanh(x[1:], None, x[:-1])
    qkv, cs = _x((5, 3, 2, 6), 17), _x((5, 6), 18)
    heads = np.empty((2, 5, 6), np.float32)
    with pytest.raises(KernelArgumentError, match=r"rope_heads: qkv must be \[rows, 3, heads, head_dim\] with an even "
                                                  r"head_dim, got shape \(5, 3, 2, 5\)"):
        lib.rope_heads(qkv[..., :5].copy(), cs[:, :5].copy(), cs[:, :5].copy(), heads, heads, heads)
    with pytest.raises(KernelArgumentError, match=r"rope_heads: k must be a writable C-contiguous float32 array of "
                                                  r"shape \(2, 6, 5\), got float32 \(2, 5, 6\)"):
        lib.rope_heads(qkv, cs, cs, heads, np.empty((2, 5, 6), np.float32), np.empty((2, 5, 6), np.float32))
    with pytest.raises(KernelArgumentError, match="rope_heads: qh shares memory with vh"):
        lib.rope_heads(qkv, cs, cs, heads, np.empty((2, 5, 6), np.float32), heads, k_transposed=False)
    with pytest.raises(KernelArgumentError, match=r"rope_heads: cos must be a C-contiguous float32 array of shape "
                                                  r"\(5, 6\), got float64"):
        lib.rope_heads(qkv, cs.astype(np.float64), cs, heads, np.empty((2, 6, 5), np.float32), heads.copy())


class _NumbaRows:
    """CPUVisionOps' row ops as they were before the SIMD library took them: the numba kernels on RowPool."""

    def layer_norm(self, x, name, eps):
        out = np.empty_like(x)
        self.rows.run(vk.layer_norm_rows, (x, out), self.vector(name + ".weight"), self.vector(name + ".bias"),
                      float(eps))
        return out

    def linear_gelu(self, x, name, kind):
        out = self._float_product(x, name)
        self.rows.run(vk.gelu_tanh_rows if kind == "tanh" else vk.gelu_erf_rows, (out, out),
                      self.vector(name + ".bias"))
        return out

    def rotary_attention(self, qkv, cos, sin, scale):
        # the numba layout kernel in place of the library's for this call
        rope, self.simd = self.simd, _RopeByNumba(self.simd, self.rows)
        try:
            return super().rotary_attention(qkv, cos, sin, scale)
        finally:
            self.simd = rope


class _RopeByNumba:
    def __init__(self, simd, rows):
        self._simd, self._rows = simd, rows

    def __getattr__(self, name):
        return getattr(self._simd, name)

    def rope_heads(self, qkv, cos, sin, qh, k, vh, k_transposed=True):
        kt = k if k_transposed else k.transpose(0, 2, 1)  # the numba kernel writes kᵀ: k in rows through a view
        self._rows.run_ranges(vk.rope_heads, qkv.shape[0], qkv, cos, sin, qh, kt, vh)


@pytest.mark.parametrize("isa", supported_isas())
def test_tower_bits_as_with_the_numba_kernels(tmp_path, isa):
    """A synthetic tower (tanh and erf GELU MLPs) encodes to the same bits with the library's row ops as with the
    numba kernels they replace, on every unit (the products: the library's float ones or numpy's BLAS)."""
    from oracle_vision import sample_image

    from hybridinfer.backends.cpu.vision import CPUVisionOps
    from hybridinfer.backends.vision import load_image_encoder
    from hybridinfer.tools.synth_vision import synth_mmproj

    mm = tmp_path / "mm.gguf"
    synth_mmproj(mm, 40, {"depth": 2, "hidden": 64, "heads": 4, "ff": 128, "pos_side": 6})
    img = sample_image(70, 50, seed=2)
    lib = _lib(isa, 3)
    enc = load_image_encoder(mm, 40, lib, 4 * 1024, 64 * 1024)
    assert type(enc.ops) is CPUVisionOps
    got = enc.encode(img).rows
    enc.ops.__class__ = type("NumbaRowsOps", (_NumbaRows, CPUVisionOps), {})
    want = enc.encode(img).rows
    enc.close()
    assert got.shape == want.shape and np.array_equal(got, want)

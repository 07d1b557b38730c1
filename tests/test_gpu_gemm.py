"""gemm.cu against numpy: dequantize exactly (hybridinfer.format.quant), multiply in float64, compare with a bound
scaled by sum_k |x w| (fp32 accumulation over K). Outputs are poisoned with NaN before every launch."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.gpu.k_gemm import TILES_BY_CLASS
from hybridinfer.format import quant

pytestmark = pytest.mark.gpu

TYPES = [quant.F32, quant.F16, quant.Q4_0, quant.Q8_0, quant.Q4_K, quant.Q5_K, quant.Q6_K]
KQUANTS = {quant.Q4_K, quant.Q5_K, quant.Q6_K}
IDS = [quant.type_name(q) for q in TYPES]
ALL_TILES = sorted({t for tiles in TILES_BY_CLASS.values() for t in tiles})


def _compiled(k_gemm, tile):
    """Skip a tile the running kernel class (the card's or --card-profile's) does not compile."""
    from hybridinfer.backends.gpu import loader

    if tile is not None and tuple(tile) not in k_gemm.TILES_BY_CLASS[loader.kernel_class()]:
        pytest.skip(f"tile {tile} is not compiled for kernel class {loader.kernel_class()}")


@pytest.fixture(scope="module")
def gpu():
    from pycuda import gpuarray

    from hybridinfer.backends.gpu import k_gemm, loader

    loader.init()
    return gpuarray, k_gemm


def _weight(qtype, shape, rng):
    """Random valid GGUF bytes for `shape` and their exact float32 dequantization."""
    qk, _ = quant.block_info(qtype)
    n = int(np.prod(shape))
    raw = quant.random_blocks(qtype, n // qk, rng).reshape(-1)
    return raw, quant.dequantize(raw, qtype, shape)


def _k_for(qtype, small=False):
    return (256 if small else 512) if qtype in KQUANTS else 96


def _check(y, x, w_f32, what):
    """y (M, N) against x (M, K) @ w (N, K)^T in float64."""
    x64, w64 = x.astype(np.float64), w_f32.astype(np.float64)
    ref = x64 @ w64.T
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    assert np.isfinite(y).all(), f"{what}: non-finite outputs (unwritten rows/columns?)"
    err = np.abs(y.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), f"{what}: |err| {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


def _poisoned(gpuarray, shape):
    return gpuarray.to_gpu(np.full(shape, np.nan, np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("T", [1, 7, 65, 300])
@pytest.mark.parametrize("N", [197, 256])
def test_gemm(gpu, qtype, T, N):
    gpuarray, k_gemm = gpu
    rng = np.random.default_rng(1000 * qtype + 10 * T + N)
    K = _k_for(qtype)
    raw, wf = _weight(qtype, (N, K), rng)
    x = rng.standard_normal((T, K), dtype=np.float32)
    w = k_gemm.DeviceWeight.upload(raw, qtype, (N, K))
    out = _poisoned(gpuarray, (T, N))
    k_gemm.gemm(gpuarray.to_gpu(x), w, out=out)
    _check(out.get(), x, wf, f"{w} T={T}")


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("tile", ALL_TILES, ids=[f"b{m}n{n}" for m, n in ALL_TILES])
def test_gemm_every_tile(gpu, qtype, tile):
    gpuarray, k_gemm = gpu
    _compiled(k_gemm, tile)
    rng = np.random.default_rng(7 * qtype + tile[0] + tile[1])
    T, N, K = 83, 290, _k_for(qtype, small=True)  # partial tiles in both directions
    raw, wf = _weight(qtype, (N, K), rng)
    x = rng.standard_normal((T, K), dtype=np.float32)
    w = k_gemm.DeviceWeight.upload(raw, qtype, (N, K))
    out = _poisoned(gpuarray, (T, N))
    k_gemm.gemm(gpuarray.to_gpu(x), w, out=out, tile=tile)
    _check(out.get(), x, wf, f"{w} tile={tile}")


def _grouping(counts, T, rng):
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    idx = rng.integers(0, T, offs[-1]).astype(np.int32)
    return offs, idx


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("tile", [None, (16, 128), (64, 128), (128, 128), (16, 256), (32, 256), (64, 256), (32, 64),
                                  (64, 64)])
def test_gemm_grouped(gpu, qtype, tile):
    gpuarray, k_gemm = gpu
    _compiled(k_gemm, tile)
    rng = np.random.default_rng(31 * qtype + sum(tile or ()))
    counts = [3, 0, 70, 1, 130, 0, 17]  # uneven, two experts without tokens
    E, N, K, T = len(counts), 197, _k_for(qtype, small=True), 50
    raw, wf = _weight(qtype, (E, N, K), rng)
    w = k_gemm.DeviceWeight.upload(raw, qtype, (E, N, K))
    offs, idx = _grouping(counts, T, rng)
    x = rng.standard_normal((T, K), dtype=np.float32)
    out = _poisoned(gpuarray, (offs[-1], N))
    k_gemm.gemm_grouped(gpuarray.to_gpu(x), w, gpuarray.to_gpu(offs), gpuarray.to_gpu(idx), out=out, tile=tile)
    y = out.get()
    for e in range(E):
        rows = slice(offs[e], offs[e + 1])
        if counts[e]:
            _check(y[rows], x[idx[rows]], wf[e], f"{w} expert {e}")


@pytest.mark.parametrize("qtype", [quant.Q4_K, quant.Q8_0])
def test_gemm_grouped_without_idx_many_experts(gpu, qtype):
    """Rows already in grouped order (a down projection) and more experts than threads per block, so the
    tile lookup's prefix sum runs over several chunks; most experts have no rows."""
    gpuarray, k_gemm = gpu
    rng = np.random.default_rng(qtype)
    E, N, K = 300, 64, _k_for(qtype, small=True)
    counts = np.zeros(E, np.int64)
    for e, c in [(0, 5), (17, 33), (255, 1), (256, 40), (299, 9)]:
        counts[e] = c
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    M = int(offs[-1])
    raw, wf = _weight(qtype, (E, N, K), rng)
    w = k_gemm.DeviceWeight.upload(raw, qtype, (E, N, K))
    x = rng.standard_normal((M, K), dtype=np.float32)
    out = _poisoned(gpuarray, (M, N))
    k_gemm.gemm_grouped(gpuarray.to_gpu(x), w, gpuarray.to_gpu(offs), None, out=out)
    y = out.get()
    for e in np.nonzero(counts)[0]:
        rows = slice(offs[e], offs[e + 1])
        _check(y[rows], x[rows], wf[e], f"{w} expert {e}")


def test_argument_checks(gpu):
    gpuarray, k_gemm = gpu
    from hybridinfer.errors import KernelArgumentError

    rng = np.random.default_rng(0)
    raw, _ = _weight(quant.Q4_K, (8, 256), rng)
    w = k_gemm.DeviceWeight.upload(raw, quant.Q4_K, (8, 256))
    with pytest.raises(KernelArgumentError, match="shape"):
        k_gemm.gemm(gpuarray.zeros((3, 128), np.float32), w)
    with pytest.raises(KernelArgumentError, match="dtype"):
        k_gemm.gemm(gpuarray.zeros((3, 256), np.float64), w)
    with pytest.raises(KernelArgumentError, match="no kernel"):
        k_gemm.gemm(gpuarray.zeros((3, 32), np.float32),
                    k_gemm.DeviceWeight(quant.Q4_1, (8, 32), gpuarray.zeros(8 * 20, np.uint8)))


@pytest.mark.parametrize("qtype", [quant.F32, quant.F16, quant.Q4_K], ids=["F32", "F16", "Q4_K"])
@pytest.mark.parametrize("tile", ALL_TILES, ids=[f"b{m}n{n}" for m, n in ALL_TILES])
def test_gemm_grid_stride_loops(gpu, qtype, tile):
    """A grid smaller than the tiles in both directions (as when a prompt's tiles pass sm_20's 65535 a dimension):
    each block walks several weight tiles and several token tiles through the kernels' grid-stride loops, plainly
    and grouped (several experts, one without rows)."""
    gpuarray, k_gemm = gpu
    from hybridinfer.backends.gpu import loader

    _compiled(k_gemm, tile)
    bm, bn = tile
    rng = np.random.default_rng(5 * qtype + bm + bn)
    K = _k_for(qtype, small=True)
    name = f"gemm_{k_gemm.GEMM_TYPES[qtype]}_b{bm}_n{bn}"
    counts = [2 * bm + 5, 0, bm + 1]  # the experts' token tiles: 3, 0, 2
    E, T, N = len(counts), sum(counts), 3 * bn + 7
    raw, wf = _weight(qtype, (E, N, K), rng)
    w = k_gemm.DeviceWeight.upload(raw, qtype, (E, N, K))
    x = rng.standard_normal((T, K), dtype=np.float32)
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    xd, od = gpuarray.to_gpu(x), gpuarray.to_gpu(offs)
    null = np.uintp(0)
    split = tile in k_gemm.SPLIT_TILES[loader.kernel_class()]
    for grouped, grid in ((False, (2, 2)), (True, (3, 2))) + (((False, (2, 2, 3)),) if split else ()):
        s = grid[2] if len(grid) == 3 else 1  # split over K: three slabs of partial sums, added here
        out = _poisoned(gpuarray, (s, T, N))
        we = int(w.data.gpudata) + (0 if grouped else 2 * N * w.row_nbytes)  # plain: expert 2's matrix
        args = [np.uintp(int(xd.gpudata)), np.uintp(we), np.uintp(int(out.gpudata)),
                np.uintp(int(od.gpudata)) if grouped else null, null, np.int32(E if grouped else 1), np.int32(T),
                np.int32(N), np.int32(K), np.int32(w.row_nbytes), np.int32(s)]
        loader.launch(k_gemm.FAMILY, name, grid, (256,), args)
        y = out.get().sum(axis=0)
        if grouped:
            for e in range(E):
                rows = slice(offs[e], offs[e + 1])
                if counts[e]:
                    _check(y[rows], x[rows], wf[e], f"{w} tile={tile} grouped expert {e} grid={grid}")
        else:
            _check(y, x, wf[2], f"{w} tile={tile} plain grid={grid}")


@pytest.mark.parametrize("qtype", [quant.F32, quant.F16, quant.Q8_0, quant.Q6_K], ids=["F32", "F16", "Q8_0", "Q6_K"])
def test_gemm_split_over_k(gpu, qtype):
    """A product split over K (every tile the running class splits, 2 to 4 parts, and one whose last part is empty)
    matches the reference, and equals the sum of its parts' slabs in order; the choice by split_count given a
    scratch; the argument checks."""
    gpuarray, k_gemm = gpu
    from hybridinfer.backends.gpu import loader
    from hybridinfer.errors import KernelArgumentError

    cls = loader.kernel_class()
    rng = np.random.default_rng(77 + qtype)
    K = 512 if qtype in KQUANTS else 160  # Q8_0 / F: 5 chunks of 32, so 4 parts leave the last one empty
    T, N = 75, 131
    raw, wf = _weight(qtype, (N, K), rng)
    w = k_gemm.DeviceWeight.upload(raw, qtype, (N, K))
    x = rng.standard_normal((T, K), dtype=np.float32)
    xd = gpuarray.to_gpu(x)
    part = gpuarray.to_gpu(np.full(4 * T * N + 3, np.nan, np.float32))
    for tile in k_gemm.SPLIT_TILES[cls]:
        for s in (2, 3, 4):
            out = _poisoned(gpuarray, (T, N))
            k_gemm.gemm(xd, w, out=out, tile=tile, part=part, ksplit=s)
            y = out.get()
            _check(y, x, wf, f"{w} tile={tile} ksplit={s}")
            slabs = part.get()[:s * T * N].reshape(s, T, N)
            acc = slabs[0].copy()
            for z in range(1, s):
                acc += slabs[z]
            assert np.array_equal(y, acc), f"{w} tile={tile} ksplit={s}: not the slabs' sum in order"
    # auto: a card's worth of SMs wanted, this product's tiles fewer; without a scratch, no split
    tile = k_gemm.SPLIT_TILES[cls][-1]
    want = k_gemm.split_count(loader.limits(), T, N, K, tile, int(part.size))
    out = _poisoned(gpuarray, (T, N))
    k_gemm.gemm(xd, w, out=out, tile=tile, part=part)
    _check(out.get(), x, wf, f"{w} tile={tile} auto split ({want})")
    with pytest.raises(KernelArgumentError, match="without a scratch"):
        k_gemm.gemm(xd, w, out=out, tile=tile, ksplit=2)
    with pytest.raises(KernelArgumentError, match="scratch"):
        k_gemm.gemm(xd, w, out=out, tile=tile, part=part[:T * N], ksplit=2)
    with pytest.raises(KernelArgumentError, match="cannot split"):
        k_gemm.gemm(xd, w, out=out, tile=tile, part=part, ksplit=K // 32 + 1)
    unsplit = [t for t in k_gemm.TILES_BY_CLASS[cls] if t not in k_gemm.SPLIT_TILES[cls]]
    if unsplit:
        with pytest.raises(KernelArgumentError, match="cannot split"):
            k_gemm.gemm(xd, w, out=out, tile=unsplit[0], part=part, ksplit=2)

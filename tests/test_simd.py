"""The native SIMD library (hybridinfer._simd through hybridinfer.backends.cpu.simd): quantizers, dot products,
GEMV/GEMM, MoE calls, threads, argument checks.

Oracles: llama.cpp's own CPU kernels (libggml-cpu from llama-cpp-python, built for this CPU: its
q8_0/q8_1/q8_K quantizers and vec_dot kernels) and the numpy reference (hybridinfer.backends.actquant: its
`qmatmul_ggml` emulates ggml's AVX2 float order exactly; `qmatmul` is the plain formula).
Every ISA path this CPU runs is checked: the quantizers give identical bytes everywhere; the dot products
give the same integers everywhere (checked exactly with unit scales, where every float operation is
exact); the float results of the FMA paths (scalar via fmaf, avx2, avx512vnni) equal ggml's bit for bit,
the SSSE3 path (multiply then add, for hosts without FMA) only in the last bits.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hybridinfer.backends import actquant as aq
from hybridinfer.backends import actquant_k as ak
from hybridinfer.backends.cpu import simd
from hybridinfer.backends.cpu.simd import GGML_MUL_MAT, GGML_MUL_MAT_ID, SimdLib, best_isa, supported_isas
from hybridinfer.errors import BackendNotAvailableError, UnsupportedTensorTypeError
from hybridinfer.format.quant import Q4_K, Q6_K, Q8_0, random_blocks

LEGACY = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}
KQUANT = {12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
ISAS = supported_isas()
FMA_ISAS = [i for i in ISAS if i in ("avx2", "avx512vnni")]  # the float operations of ggml's AVX2 kernels
# below AVX: ggml's generic loops (its SSE4.2 or baseline x86-64 build) and its reference Q8_0 / Q8_1 quantizers
GENERIC_ISAS = [i for i in ISAS if i in ("scalar", "ssse3")]


@pytest.fixture(scope="module")
def ggml():
    pytest.importorskip("llama_cpp")
    import ggml_kernels

    lib = ggml_kernels.load()
    lib.quantize_row_q8_K.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ggml_vec_dot_f16.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                     ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib



def _ggml_act(ggml, x: np.ndarray, kind: str, ref: bool = False) -> np.ndarray:
    import ggml_kernels

    if kind != "q8_K":
        return np.stack([ggml_kernels.quantize_act(ggml, r, kind, ref) for r in x])
    out = np.zeros((x.shape[0], x.shape[1] // 256 * 292), np.uint8)  # zeroed: ggml skips bsums of zero blocks
    for t, r in enumerate(np.ascontiguousarray(x)):
        ggml.quantize_row_q8_K(r.ctypes.data, out[t].ctypes.data, r.size)
    return out


def _ggml_matmul(ggml, raw, qtype, rows, cols, x) -> np.ndarray:
    import ggml_kernels

    return np.stack([ggml_kernels.matvec(ggml, raw, qtype, rows, cols, r) for r in x])


def _activations(rng, T: int, n: int) -> np.ndarray:
    """Rows of very different scales, with an all-zero block, exact rounding ties, a subnormal block, an inf."""
    x = (rng.standard_normal((T, n)) * rng.uniform(0.01, 50, (T, 1))).astype(np.float32)
    x[0, :32] = 0.0
    if T > 1:
        x[1, :32] = np.arange(-15.5, 16.5, dtype=np.float32)  # amax 127 below: id = 1, every value a tie
        x[1, 5] = 127.0
    if T > 2 and n >= 512:
        x[2, 256:288] = np.arange(-15.5, 16.5, dtype=np.float32)
        x[2, 260] = -127.0  # Q8_K: iscale = 1 on that block, ties again
        x[2, 300:320] = np.float32(1e-41)
    return x


# ------------------------------------------------------------------------------------------------
# the library


def test_isas_and_threads():
    assert ISAS[0] == "scalar" and best_isa() in ISAS
    assert set(ISAS) <= set(simd.ISAS)
    lib = SimdLib()
    assert lib.isa == best_isa() and lib.n_threads >= 1
    lib.close()
    lib = SimdLib("scalar", 3)
    assert (lib.isa, lib.n_threads) == ("scalar", 3)
    with pytest.raises(ValueError, match="'avx9'"):
        SimdLib("avx9")
    with pytest.raises(ValueError, match="n_threads"):
        SimdLib(None, 0)
    missing = [i for i in simd.ISAS if i not in ISAS]
    if missing:
        with pytest.raises(BackendNotAvailableError, match=missing[0]):
            SimdLib(missing[0])


def test_act_kinds_and_sizes():
    assert [simd.act_kind(q) for q in (0, 1, 2, 3, 6, 7, 8, 12, 13, 14)] == \
        ["f32", "f16", "q8_0", "q8_1", "q8_0", "q8_1", "q8_0", "q8_K", "q8_K", "q8_K"]
    assert simd.act_row_bytes(2, 4096) == 128 * 34 and simd.act_row_bytes(3, 64) == 72
    assert simd.act_row_bytes(12, 512) == 584 and simd.act_row_bytes(1, 10) == 20
    assert simd.weight_row_bytes(2, 4096) == 128 * 18 and simd.weight_row_bytes(14, 256) == 210
    with pytest.raises(ValueError, match="100"):
        simd.act_row_bytes(2, 100)
    with pytest.raises(UnsupportedTensorTypeError, match="Q2_K"):
        simd.act_kind(10)


def test_read_bandwidth(libs):
    bw = libs[ISAS[-1]].read_bandwidth(32 << 20, reps=2)
    assert 1e8 < bw < 1e13


def test_read_bandwidth_at_stays_inside_the_buffer():
    """The probe over an existing array reads whole pages inside it only: the array ends at a page that may
    not be read (PROT_NONE), and starts off a page boundary."""
    import mmap

    lib = SimdLib(n_threads=3)
    size = 8 << 20
    m = mmap.mmap(-1, size + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(whole.ctypes.data + size, 4096, 0) == 0  # PROT_NONE
    buf = whole[100:size]
    with pytest.raises(ValueError, match="all zero"):
        lib.read_bandwidth_at(buf, reps=1)
    buf[:] = 1
    assert 1e8 < lib.read_bandwidth_at(buf, reps=2) < 1e13
    with pytest.raises(ValueError, match="at least 1 MiB"):
        lib.read_bandwidth_at(buf[: 1 << 19])
    with pytest.raises(ValueError, match="C-contiguous"):
        lib.read_bandwidth_at(buf[::2])
    with pytest.raises(ValueError, match="reps"):
        lib.read_bandwidth_at(buf, reps=0)
    lib.close()
    del whole, buf
    m.close()


# ------------------------------------------------------------------------------------------------
# activation quantizers


@pytest.mark.parametrize("kind,qtype", [("q8_0", 2), ("q8_1", 3), ("q8_K", 12)])
def test_quantizers_match_ggml_and_numpy(ggml, libs, kind, qtype):
    rng = np.random.default_rng(11)
    x = _activations(rng, 5, 768)
    x[0, :32] = np.arange(-16, 16) * (x[0, 5] / 16)  # ties of x * id, where the two roundings differ
    theirs = _ggml_act(ggml, x, kind)
    ref = aq.quantize_act(x, kind)
    assert np.array_equal(ref, theirs)  # the numpy reference is llama.cpp's rounding
    theirs_ref = theirs if kind == "q8_K" else _ggml_act(ggml, x, kind, ref=True)
    assert np.array_equal(aq.quantize_act(x, kind, ref=True), theirs_ref)
    for isa, lib in libs.items():
        want = theirs_ref if isa in GENERIC_ISAS else theirs
        ours = lib.quantize(x, qtype)
        assert ours.shape == want.shape and np.array_equal(ours, want), isa
        one = lib.quantize(x[3], qtype)  # a 1-D row
        assert np.array_equal(one, want[3]), isa


def test_q8_0_reference_rounding_edges(libs):
    """Below AVX the Q8_0 activations are quantize_row_q8_0_ref's (roundf, half away from zero; the SSSE3 unit's
    in vectors): values just below and at halves, zero, infinite and NaN blocks, as the scalar loop gives them."""
    x = np.zeros((2, 32 * 6), np.float32)
    x[0, :32] = 127.0  # d = 1, id = 1: x * id is x
    x[0, 1:12] = [0.49999997, 0.5, -0.5, 2.5, -3.5, 126.5, -126.5, 1.5000001, -0.49999997, 7.0, -0.0]
    x[0, 32:64] = np.linspace(-3, 3, 32)  # a generic block
    x[0, 64:96] = 0.0  # all zero: d = 0, id = 0
    x[1, :32] = np.linspace(-1, 1, 32)
    x[1, 5] = np.nan  # NaN: the scan's order decides amax
    x[1, 32:64] = np.linspace(-2, 2, 32)
    x[1, 40] = np.inf
    x[1, 64:96] = np.linspace(-1e-3, 1e-3, 32)
    x[1, 96:128] = np.float32(1e-40)  # subnormal inputs: 1 / d overflows
    x[1, 128:192] = np.random.default_rng(7).standard_normal(64) * 50
    want = libs["scalar"].quantize(x, 8)  # ggml's loop in C (the NaN block's amax is its scan order's)
    finite = np.ones(want.shape, bool)
    finite[1, :34] = False
    with np.errstate(all="ignore"):  # the numpy reference meets the NaN, infinite and overflowing blocks too
        ref = aq.quantize_act(x, "q8_0", ref=True)
    assert np.array_equal(want[finite], ref[finite])
    if "ssse3" in libs:
        assert np.array_equal(libs["ssse3"].quantize(x, 8), want)
    q = want[0, 2:34].view(np.int8)
    assert list(q[1:12]) == [0, 1, -1, 3, -4, 127, -127, 2, 0, 7, 0]


def test_f16_activations_round_to_nearest_even(libs):
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = np.where(np.isfinite(x) & (np.abs(x) < 1e30), x, np.float32(1.0)).astype(np.float32)
    x[:20] = [0, -0.0, 65504, 65519.99, 65520, -65520, 6e-8, 2.98e-8, 2.99e-8, 1e-5, 6.1e-5, 1.5e-7, 1, 2049,
              2051, 1e-45, 3.0e5, 0.1, -0.3, 1e-3]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint8)
    for isa, lib in libs.items():
        assert np.array_equal(lib.quantize(x, 1), want), isa
        assert np.array_equal(lib.quantize(x, 0), x.view(np.uint8)), isa


# ------------------------------------------------------------------------------------------------
# dot products, GEMV and GEMM


@pytest.mark.parametrize("qtype", sorted(LEGACY))
def test_legacy_matmul_matches_ggml(ggml, libs, qtype):
    rng = np.random.default_rng(qtype)
    rows, cols = 37, 32 * 9  # rows: not a multiple of threads or tiles; cols: an odd number of blocks
    raw = random_blocks(qtype, rows * cols // 32, rng).reshape(-1)
    x = _activations(rng, 17, cols)
    theirs = _ggml_matmul(ggml, raw, qtype, rows, cols, x)
    kind = aq.LEGACY[qtype][1]
    xq_ref = aq.quantize_act(x, kind)
    exact = aq.qmatmul_ggml(xq_ref, raw, qtype, rows, cols)
    assert np.array_equal(exact, theirs)  # the numpy ggml-order reference
    plain = aq.qmatmul(x, raw, qtype, rows, cols)
    scale = np.abs(theirs).max()
    assert np.allclose(plain, theirs, rtol=1e-5, atol=1e-5 * scale)
    for isa, lib in libs.items():
        for T in (1, 3, 17):
            xq = lib.quantize(x[:T], qtype)
            out = np.full((T, rows), np.nan, np.float32)
            lib.matmul(raw, qtype, rows, cols, xq, out)
            if isa in FMA_ISAS:
                assert np.array_equal(out, theirs[:T]), (isa, T)
            else:  # ggml's generic loops (Q4_0: its SSSE3 path on the SSSE3 unit), on ggml's ref quantization
                assert np.array_equal(xq, aq.quantize_act(x[:T], kind, ref=True)), (isa, T)
                want = aq.qmatmul_generic(xq, raw, qtype, rows, cols, ssse3=isa == "ssse3")
                assert np.array_equal(out, want), (isa, T)
                # and only the float order differs from ggml's AVX2 kernels on the same activations
                avx = aq.qmatmul_ggml(xq, raw, qtype, rows, cols)
                assert np.allclose(out, avx, rtol=1e-5, atol=2e-6 * scale) and not np.array_equal(out, avx), (isa, T)
        gemv = np.zeros(rows, np.float32)  # 1-D: T = 1
        lib.matmul(raw, qtype, rows, cols, lib.quantize(x[5], qtype), gemv)
        assert np.array_equal(gemv, out[5]), isa


def test_q8_0_scales_that_are_not_normal_fp16(libs):
    """The SSSE3 Q8_0 dot converts 4 blocks' fp16 scales at a time as normal numbers and hands blocks with a zero,
    subnormal, infinite or NaN scale (weights or activations) to the one-by-one conversion: the same bits as the
    generic loop on the reference, whatever the scales."""
    rng = np.random.default_rng(80)
    rows, nb = 6, 11
    raw = random_blocks(8, rows * nb, rng)
    for r, b, h in ((0, 0, 0x0000), (0, 3, 0x8000), (1, 5, 0x0001), (2, 8, 0x03ff), (3, 1, 0x7c00), (4, 9, 0x7e00),
                    (5, 4, 0x0400)):
        raw[r * nb + b, 0:2] = np.frombuffer(np.uint16(h).tobytes(), np.uint8)
    raw = raw.reshape(-1)
    x = _activations(rng, 3, 32 * nb)
    x[1, 64:96] = 0  # an all-zero block: its activation scale is 0
    x[2, 200:232] *= 1e-38  # its scale subnormal
    for isa in GENERIC_ISAS:
        lib = libs.get(isa)
        if lib is None:
            continue
        xq = lib.quantize(x, 8)
        out = np.full((3, rows), 1.0, np.float32)
        lib.matmul(raw, 8, rows, 32 * nb, xq, out)
        want = aq.qmatmul_generic(xq, raw, 8, rows, 32 * nb, ssse3=isa == "ssse3")
        assert np.array_equal(out, want, equal_nan=True), isa
        assert np.isnan(out[:, 4]).all() and np.isfinite(out[:, 0]).all()


def _unit_scale_blocks(qtype: int, rows: int, nb: int, rng) -> np.ndarray:
    blk = random_blocks(qtype, rows * nb, rng)
    blk[:, 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    if qtype in (3, 7):
        blk[:, 2:4] = np.frombuffer(np.float16(1).tobytes(), np.uint8)  # m = 1
    return blk.reshape(-1)


def _unit_scale_acts(kind: str, T: int, nb: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    bb = 36 if kind == "q8_1" else 34
    q = rng.integers(-127, 128, (T, nb, 32)).astype(np.int8)
    s = rng.integers(-2048, 2049, (T, nb)).astype(np.float16)  # any integer fp16 holds exactly
    b = np.zeros((T, nb, bb), np.uint8)
    b[..., 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    if kind == "q8_1":
        b[..., 2:4] = s[..., None].view(np.uint8)
    b[..., bb - 32:] = q.view(np.uint8)
    return b.reshape(T, nb * bb), q, s.astype(np.int64)


@pytest.mark.parametrize("qtype", sorted(LEGACY))
def test_every_isa_gives_the_same_integers(libs, qtype):
    """With every scale 1 (and m = 1, integer s) each row is an exact integer in every float operation, so
    all paths must return exactly sum_blocks(sum_i w_i q_i) [+ sum_blocks s]: the integer dot itself."""
    rng = np.random.default_rng(100 + qtype)
    rows, nb, T = 29, 11, 5
    cols = 32 * nb
    raw = _unit_scale_blocks(qtype, rows, nb, rng)
    kind = aq.LEGACY[qtype][1]
    xq, q, s = _unit_scale_acts(kind, T, nb, rng)
    wq, _, _ = aq.weight_ints(raw, qtype, rows, cols)
    want = np.einsum("tbj,rbj->tr", q.astype(np.int64), wq.astype(np.int64))
    if qtype in (3, 7):
        want = want + s.sum(axis=1)[:, None]
    assert np.abs(want).max() < 2**24
    for isa, lib in libs.items():
        out = np.zeros((T, rows), np.float32)
        lib.matmul(raw, qtype, rows, cols, xq, out)
        assert np.array_equal(out.astype(np.int64), want) and np.array_equal(out, want.astype(np.float32)), isa


@pytest.mark.parametrize("qtype", sorted(KQUANT))
def test_kquant_matmul(libs, qtype):
    """The K-quant dots (dot_kquants.h) wired into the GEMV/GEMM drivers, against the numpy reference."""
    rng = np.random.default_rng(qtype)
    rows, cols = 13, 256 * 3
    raw = random_blocks(qtype, rows * cols // 256, rng).reshape(-1)
    x = _activations(rng, 3, cols)
    xq = ak.quantize_q8_K(x)
    want = ak.kquant_matmul_q8(xq, raw, qtype, rows, cols)
    scale = np.abs(want).max()
    for isa, lib in libs.items():
        assert np.array_equal(lib.quantize(x, qtype), xq), isa
        out = np.zeros((3, rows), np.float32)
        lib.matmul(raw, qtype, rows, cols, xq, out)
        if isa in FMA_ISAS:
            assert np.array_equal(out, want), isa
        else:
            assert np.allclose(out, want, rtol=1e-5, atol=2e-6 * scale), isa


@pytest.mark.parametrize("qtype", [0, 1])
def test_float_matmul(ggml, libs, qtype):
    rng = np.random.default_rng(7 + qtype)
    rows, cols, T = 9, 32 * 5 + 13, 4  # a tail of 13 after the 32-wide steps
    w = random_blocks(qtype, rows * cols, rng).reshape(-1).view(np.float32 if qtype == 0 else np.float16)
    w = w.reshape(rows, cols)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    xa = x if qtype == 0 else x.astype(np.float16).astype(np.float32)  # F16: activations rounded to fp16
    xs = xa
    want = (xa.astype(np.float64) @ w.astype(np.float64).T)
    scale = np.abs(want).max()
    results = {}
    for isa, lib in libs.items():
        xq = lib.quantize(x, qtype)
        out = np.zeros((T, rows), np.float32)
        lib.matmul(w, qtype, rows, cols, xq, out)
        assert np.allclose(out, want, rtol=1e-5, atol=1e-5 * scale), isa
        results[isa] = out
    # the AVX units as llama.cpp's AVX builds: ggml_vec_dot_f32 / _f16 here (173 is no multiple of the width)
    from oracles import ggml_ref as gr

    for isa in FMA_ISAS:
        W = 16 if isa == "avx512vnni" else 8
        if qtype == 0:
            want_isa = gr.dot_f32(xa[:, None, :], w[None, :, :], W)
        else:  # vec_dot_f16: the same vector part, the tail summed in double
            n = cols // (4 * W) * (4 * W)
            body = gr.dot_f32(xs[:, None, :n], w.astype(np.float32)[None, :, :n], W)
            tail = (xs[:, None, n:] * w.astype(np.float32)[None, :, n:]).astype(np.float32).astype(np.float64)
            want_isa = np.cumsum(np.concatenate([body[..., None].astype(np.float64), tail], -1), -1)[..., -1]
            want_isa = want_isa.astype(np.float32)
        assert np.array_equal(results[isa], want_isa), isa
    # the scalar unit as ggml built without SIMD: float products summed in double
    prods = (xs[:, None, :] * w.astype(np.float32)[None, :, :]).astype(np.float32).astype(np.float64)
    assert np.array_equal(results["scalar"], np.cumsum(prods, axis=-1)[..., -1].astype(np.float32))
    if qtype == 1 and best_isa() in FMA_ISAS:  # the llama.cpp here is its native build: its f16 dot, bit for bit
        xh = x.astype(np.float16)
        o = np.zeros(1, np.float32)
        for t in range(T):
            for r in range(rows):
                ggml.ggml_vec_dot_f16(cols, o.ctypes.data, 0, w[r].ctypes.data, 0, xh[t].ctypes.data, 0, 1)
                assert results[best_isa()][t, r] == o[0], (t, r)


@pytest.mark.parametrize("qtype", [0, 1])
def test_float_matmul_tinyblas_shape(libs, qtype):
    """Two tokens or more and a length that is a multiple of the vector width: llamafile's tinyBLAS order."""
    from oracles import ggml_ref as gr

    rng = np.random.default_rng(70 + qtype)
    rows, cols, T = 7, 16 * 9, 3
    w = random_blocks(qtype, rows * cols, rng).reshape(-1).view(np.float32 if qtype == 0 else np.float16)
    w = w.reshape(rows, cols)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    xs = x if qtype == 0 else x.astype(np.float16).astype(np.float32)
    for isa in FMA_ISAS:
        lib = libs[isa]
        out = np.zeros((T, rows), np.float32)
        lib.matmul(w, qtype, rows, cols, lib.quantize(x, qtype), out)
        W = 16 if isa == "avx512vnni" else 8
        assert np.array_equal(out, gr.tinyblas_dot(xs[:, None, :], w.astype(np.float32)[None, :, :], W)), isa
        one = np.zeros(rows, np.float32)  # one token: vec_dot's order instead
        lib.matmul(w, qtype, rows, cols, lib.quantize(x[0], qtype), one)
        assert not np.array_equal(one, out[0]) or qtype == 1, isa


def test_gemm_token_blocks_and_chunks(libs):
    """T beyond one token block (32) and rows beyond one work chunk: the GEMM equals row-by-row GEMVs."""
    rng = np.random.default_rng(5)
    rows, cols, T = 203, 32 * 7, 45
    for qtype in (2, 7):
        raw = random_blocks(qtype, rows * cols // 32, rng).reshape(-1)
        x = rng.standard_normal((T, cols)).astype(np.float32)
        for isa, lib in libs.items():
            xq = lib.quantize(x, qtype)
            out = np.zeros((T, rows), np.float32)
            lib.matmul(raw, qtype, rows, cols, xq, out)
            for t in (0, 31, 32, 44):
                one = np.zeros(rows, np.float32)
                lib.matmul(raw, qtype, rows, cols, xq[t], one)
                assert np.array_equal(out[t], one), (isa, t)


def test_strided_views(libs):
    """Rows of a wider buffer (what a reused workspace hands in) give the same results as compact arrays."""
    rng = np.random.default_rng(9)
    rows, cols, T = 21, 64, 3
    raw = random_blocks(8, rows * cols // 32, rng).reshape(-1)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    lib = libs[ISAS[-1]]
    xq = lib.quantize(x, 8)
    out = np.zeros((T, rows), np.float32)
    lib.matmul(raw, 8, rows, cols, xq, out)
    xbuf = np.zeros((8, 200), np.float32)
    xbuf[:T, :cols] = x
    qbuf = np.zeros((8, 300), np.uint8)
    lib.quantize(xbuf[:T, :cols], 8, qbuf[:T, :68])
    obuf = np.zeros((8, 50), np.float32)
    lib.matmul(raw, 8, rows, cols, qbuf[:T, :68], obuf[:T, :rows])
    assert np.array_equal(qbuf[:T, :68], xq) and np.array_equal(obuf[:T, :rows], out)
    assert not obuf[:T, rows:].any() and not obuf[T:].any()


# ------------------------------------------------------------------------------------------------
# MoE (the thread pool: test_simd_pool.py)


@pytest.mark.parametrize("gate_type,down_type", [(2, 8), (3, 7), (12, 14)])
def test_moe_calls_equal_separate_matmuls(libs, gate_type, down_type):
    rng = np.random.default_rng(gate_type)
    E, F, D, k = 6, 64, 512 if gate_type >= 12 else 96, 4
    qk = 256 if gate_type >= 12 else 32
    wg = random_blocks(gate_type, E * F * D // qk, rng).reshape(-1)
    wu = random_blocks(gate_type, E * F * D // qk, rng).reshape(-1)
    dk = 256 if down_type >= 12 else 32
    Fd = 256 if down_type >= 12 else F  # the down projection's input width
    wd = random_blocks(down_type, E * D * Fd // dk, rng).reshape(-1)
    ids = np.array([4, 0, 5, 2], np.int32)
    x = rng.standard_normal(D).astype(np.float32)
    h = rng.standard_normal((k, Fd)).astype(np.float32)
    gpe, dpe = wg.size // E, wd.size // E
    for isa, lib in libs.items():
        xq = lib.quantize(x, gate_type)
        g, u = np.zeros((k, F), np.float32), np.zeros((k, F), np.float32)
        lib.moe_gate_up(wg, gate_type, wu, gate_type, F, D, xq, ids, g, u)
        hq = lib.quantize(h, down_type)
        d = np.zeros((k, D), np.float32)
        lib.moe_down(wd, down_type, D, Fd, hq, ids, d)
        for i, e in enumerate(ids):
            one = np.zeros(F, np.float32)
            lib.matmul(wg[e * gpe:(e + 1) * gpe], gate_type, F, D, xq, one)
            assert np.array_equal(g[i], one), (isa, i)
            lib.matmul(wu[e * gpe:(e + 1) * gpe], gate_type, F, D, xq, one)
            assert np.array_equal(u[i], one), (isa, i)
            od = np.zeros(D, np.float32)
            lib.matmul(wd[e * dpe:(e + 1) * dpe], down_type, D, Fd, hq[i], od)
            assert np.array_equal(d[i], od), (isa, i)


@pytest.mark.parametrize("gate_type,down_type,s_down_type", [(2, 8, 8), (12, 14, 12), (12, 12, 14)])
def test_moe_calls_with_the_shared_expert_equal_separate_matmuls(libs, gate_type, down_type, s_down_type):
    """The shared expert in the routed experts' calls: its products are the plain MUL_MAT ones, the routed
    experts' unchanged."""
    rng = np.random.default_rng(7 + gate_type)
    E, F, D, k = 5, 64, 512, 3
    qk = 256 if gate_type >= 12 else 32
    wg, wu = (random_blocks(gate_type, E * F * D // qk, rng).reshape(-1) for _ in range(2))
    sg, su = (random_blocks(gate_type, F * D // qk, rng).reshape(-1) for _ in range(2))
    Fd = 256 if down_type >= 12 else F
    wd = random_blocks(down_type, E * D * Fd // (256 if down_type >= 12 else 32), rng).reshape(-1)
    sd = random_blocks(s_down_type, D * Fd // (256 if s_down_type >= 12 else 32), rng).reshape(-1)
    ids = np.array([3, 0, 4], np.int32)
    x = rng.standard_normal(D).astype(np.float32)
    h = rng.standard_normal((k + 1, Fd)).astype(np.float32)
    for isa, lib in libs.items():
        xq = lib.quantize(x, gate_type)
        g, u = np.full((k + 1, F), np.nan, np.float32), np.full((k + 1, F), np.nan, np.float32)
        lib.moe_gate_up(wg, gate_type, wu, gate_type, F, D, xq, ids, g[:k], u[:k], GGML_MUL_MAT_ID,
                        shared=(sg, gate_type, su, gate_type, F, g[k], u[k]))
        hq = lib.quantize(h, down_type)
        d, s = np.full((k, D), np.nan, np.float32), np.full(D, np.nan, np.float32)
        lib.moe_down(wd, down_type, D, Fd, hq[:k], ids, d, GGML_MUL_MAT_ID, shared=(sd, s_down_type, Fd, hq[k], s))
        g0, u0, d0 = np.zeros((k, F), np.float32), np.zeros((k, F), np.float32), np.zeros((k, D), np.float32)
        lib.moe_gate_up(wg, gate_type, wu, gate_type, F, D, xq, ids, g0, u0, GGML_MUL_MAT_ID)
        lib.moe_down(wd, down_type, D, Fd, hq[:k], ids, d0, GGML_MUL_MAT_ID)
        assert np.array_equal(g[:k], g0) and np.array_equal(u[:k], u0) and np.array_equal(d, d0), isa
        for w, out in ((sg, g[k]), (su, u[k])):
            one = np.zeros(F, np.float32)
            lib.matmul(w, gate_type, F, D, xq, one, GGML_MUL_MAT)
            assert np.array_equal(out, one), isa
        one = np.zeros(D, np.float32)
        lib.matmul(sd, s_down_type, D, Fd, hq[k], one, GGML_MUL_MAT)
        assert np.array_equal(s, one), isa
        with pytest.raises(ValueError, match="activation format"):
            lib.moe_down(wd, down_type, D, Fd, hq[:k], ids, d, shared=(sd, 8 if down_type >= 12 else 12, Fd, hq[k], s))
        with pytest.raises(ValueError, match="shared w_up"):
            lib.moe_gate_up(wg, gate_type, wu, gate_type, F, D, xq, ids, g[:k], u[:k],
                            shared=(sg, gate_type, su[:-1], gate_type, F, g[k], u[k]))


# ------------------------------------------------------------------------------------------------
# bad input


def test_bad_inputs_raise_typed_errors(libs):
    lib = libs["scalar"]
    rng = np.random.default_rng(0)
    rows, cols = 8, 64
    raw = random_blocks(2, rows * cols // 32, rng).reshape(-1)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    xq = lib.quantize(x, 2)
    out = np.zeros((2, rows), np.float32)
    with pytest.raises(UnsupportedTensorTypeError, match="Q2_K"):
        lib.matmul(raw, 10, rows, cols, xq, out)
    with pytest.raises(UnsupportedTensorTypeError, match="BF16"):
        lib.quantize(x, 30)
    with pytest.raises(TypeError, match="x must have dtype float32, got float64"):
        lib.quantize(x.astype(np.float64), 2)
    with pytest.raises(TypeError, match="xq must have dtype uint8"):
        lib.matmul(raw, 2, rows, cols, xq.view(np.int8), out)
    with pytest.raises(TypeError, match="out must have dtype float32"):
        lib.matmul(raw, 2, rows, cols, xq, out.astype(np.float64))
    with pytest.raises(TypeError, match="w must be a numpy array"):
        lib.matmul(list(raw), 2, rows, cols, xq, out)
    with pytest.raises(ValueError, match="x is not C-contiguous"):
        lib.quantize(np.zeros((3, 128), np.float32)[:, ::2], 2)
    with pytest.raises(ValueError, match="out is not C-contiguous"):
        lib.matmul(raw, 2, rows, cols, xq, np.zeros((rows, 2), np.float32).T)
    with pytest.raises(ValueError, match="w is not C-contiguous"):
        lib.matmul(raw.reshape(rows, -1)[:, ::2], 2, rows, cols // 2, xq, out)
    with pytest.raises(ValueError, match=r"out has shape \(2, 7\)"):
        lib.matmul(raw, 2, rows, cols, xq, np.zeros((2, 7), np.float32))
    with pytest.raises(ValueError, match=r"xq has shape \(2, 67\)"):
        lib.matmul(raw, 2, rows, cols, xq[:, :67], out)
    with pytest.raises(ValueError, match="w has 144 bytes"):
        lib.matmul(raw[:144], 2, rows, cols, xq, out)
    with pytest.raises(ValueError, match="not a whole number"):
        lib.quantize(x[:, :40], 2)
    with pytest.raises(ValueError, match="out is read-only"):
        ro = np.zeros((2, rows), np.float32)
        ro.flags.writeable = False
        lib.matmul(raw, 2, rows, cols, xq, ro)
    ids = np.array([0, 3], np.int32)
    g = np.zeros((2, rows), np.float32)
    with pytest.raises(ValueError, match="expert id 3, outside"):
        lib.moe_gate_up(raw, 2, raw, 2, 4, cols, xq[0], ids, g, g.copy())
    with pytest.raises(TypeError, match="experts must hold integer"):
        lib.moe_gate_up(raw, 2, raw, 2, 4, cols, xq[0], np.array([0.0, 1.0]), g[:, :4], g[:, :4].copy())
    with pytest.raises(ValueError, match="different activation formats"):
        lib.moe_gate_up(raw, 2, raw, 3, 4, cols, xq[0], [0, 1], g[:, :4], g[:, :4].copy())
    with pytest.raises(ValueError, match=r"xq must have shape \(2, 68\)"):
        lib.moe_down(raw, 2, 4, cols, xq[0], [0, 1], g[:, :4])


def test_closed_lib_refuses_calls():
    lib = SimdLib("scalar", 2)
    x = np.zeros((1, 64), np.float32)
    lib.quantize(x, 8)
    lib.close()
    lib.close()
    with pytest.raises(ValueError, match="closed"):
        lib.quantize(x, 8)


def test_matmul_many_equals_separate_matmuls(libs):
    rng = np.random.default_rng(31)
    cols, T = 96, 3
    shapes = [(2, 40), (6, 7), (8, 129), (2, 5)]  # Q4_0, Q5_0, Q8_0 share Q8_0 activations
    ws = [random_blocks(q, r * cols // 32, rng).reshape(-1) for q, r in shapes]
    x = rng.standard_normal((T, cols)).astype(np.float32)
    for isa, lib in libs.items():
        xq = lib.quantize(x, 2)
        outs = [np.zeros((T, r), np.float32) for _, r in shapes]
        lib.matmul_many(xq, cols, [(w, q, r, o) for w, (q, r), o in zip(ws, shapes, outs, strict=True)])
        for w, (q, r), o in zip(ws, shapes, outs, strict=True):
            one = np.zeros((T, r), np.float32)
            lib.matmul(w, q, r, cols, xq, one)
            assert np.array_equal(o, one), (isa, q)
    with pytest.raises(ValueError, match="different activation formats"):
        lib.matmul_many(xq, cols, [(ws[0], 2, 40, outs[0]), (random_blocks(3, 40 * cols // 32, rng).reshape(-1), 3,
                                                              40, outs[0].copy())])
    with pytest.raises(TypeError, match=r"items\[0\] must be"):
        lib.matmul_many(xq, cols, [(ws[0], 2, 40)])


@pytest.mark.parametrize("T", [1, 3])
def test_matmul_many_across_activation_formats(libs, T):
    """One call over weights that take different activation formats (Q8_0 and Q8_1 legacy types, K-quants,
    F16) gives each product the bits of its own matmul: every job reads its own format's rows and
    preparation, shared only with jobs of the same rows."""
    rng = np.random.default_rng(32)
    cols = 512
    shapes = [(Q8_0, 40), (Q4_K, 24), (3, 9), (Q6_K, 33), (2, 17), (1, 5), (Q4_K, 8)]  # 3: Q4_1 (Q8_1), 1: F16
    ws = []
    for q, r in shapes:
        ws.append(rng.standard_normal(r * cols).astype(np.float16).view(np.uint8) if q == 1 else
                  random_blocks(q, r * cols // (256 if q in (Q4_K, Q6_K) else 32), rng).reshape(-1))
    x = rng.standard_normal((T, cols)).astype(np.float32)
    for isa, lib in libs.items():
        xq = {lib.act_kind(q): lib.quantize(x, q) for q, _ in shapes}
        assert len(xq) == 4, sorted(xq)
        outs = [np.zeros((T, r), np.float32) for _, r in shapes]
        lib.matmul_many(xq, cols, [(w, q, r, o) for w, (q, r), o in zip(ws, shapes, outs, strict=True)])
        for w, (q, r), o in zip(ws, shapes, outs, strict=True):
            one = np.zeros((T, r), np.float32)
            lib.matmul(w, q, r, cols, xq[lib.act_kind(q)], one)
            assert np.array_equal(o, one), (isa, q)
    lib = next(iter(libs.values()))
    with pytest.raises(ValueError, match="q8_K activations, which xq does not have"):
        lib.matmul_many({"q8_0": xq["q8_0"]}, cols, [(ws[1], Q4_K, 24, outs[1])])
    with pytest.raises(ValueError, match="has 2 rows"):
        lib.matmul_many({"q8_0": xq["q8_0"], "q8_K": lib.quantize(x[:2] if T > 2 else np.vstack([x, x])[:2], Q4_K)},
                        cols, [(ws[0], Q8_0, 40, outs[0]), (ws[1], Q4_K, 24, outs[1])])

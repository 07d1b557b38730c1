"""K-quant dot products (Q4_K, Q5_K, Q6_K x Q8_K).

(a) The numpy reference (hybridinfer.backends.actquant_k) against llama.cpp's own CPU kernels (libggml-cpu from
    llama-cpp-python): Q8_K activation bytes, and every row's dot product, bit for bit.
(b) The C header native/simd/dot_kquants.h, compiled here once per ISA into a tiny ctypes library (this
    tests the header itself, independent of the engine's cffi build), against the references and ggml.
    The AVX2 and AVX-512 VNNI paths are bit-identical to ggml's AVX2 kernels (`kquant_matmul_q8`); the
    SSSE3 and scalar paths to ggml's generic kernels, what llama.cpp built without AVX runs
    (`kquant_matmul_q8_generic`; checked against such a build of llama.cpp when the paths were written).
    Every path gives the same integers: checked exactly on blocks whose scales make every float operation
    exact.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

from hybridinfer.backends import actquant_k as ak
from hybridinfer.format.quant import random_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMD_DIR = os.path.join(ROOT, "native", "simd")
TYPES = {ak.Q4_K: "q4_K", ak.Q5_K: "q5_K", ak.Q6_K: "q6_K"}
TIDS = list(TYPES.values())
FP16_FIELDS = {ak.Q4_K: (0, 2), ak.Q5_K: (0, 2), ak.Q6_K: (208,)}

# ISA -> (gcc flags, CPU features it needs, the float order: ggml's AVX2 kernels or its generic ones)
ISAS = {
    "scalar": ([], (), "generic"),
    "ssse3": (["-mssse3"], ("ssse3",), "generic"),
    "avx2": (["-mavx2", "-mfma"], ("avx2", "fma"), "avx2"),
    "avx512vnni": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
                   ("avx512f", "avx512bw", "avx512vl", "avx512vnni"), "avx2"),
}

HARNESS_C = r"""
#include <stddef.h>
#include "dot_kquants.h"

typedef float (*hk_dot)(int, const void *restrict, const void *restrict);
typedef void (*hk_ggml_dot)(int, float *, size_t, const void *, size_t, const void *, size_t, int);

/* out[t*rows + r] = dot(row r, token t): the ISA path of this unit (scalar = 0) or the portable one */
void hk_matmul(int type, int scalar, int rows, int n, const void *w, int tokens, const void *y, float *out) {
    hk_dot f = type == 12 ? (scalar ? hi_dot_q4_K_q8_K_scalar : hi_dot_q4_K_q8_K)
             : type == 13 ? (scalar ? hi_dot_q5_K_q8_K_scalar : hi_dot_q5_K_q8_K)
                          : (scalar ? hi_dot_q6_K_q8_K_scalar : hi_dot_q6_K_q8_K);
    const size_t rb = (size_t)(n / 256) * (type == 12 ? 144 : type == 13 ? 176 : 210);
    const size_t yb = (size_t)(n / 256) * sizeof(block_q8_K);
    for (int t = 0; t < tokens; ++t)
        for (int r = 0; r < rows; ++r)
            out[(size_t)t * rows + r] = f(n, (const char *)w + r * rb, (const char *)y + t * yb);
}

/* the same loop over one of ggml's ggml_vec_dot_*_q8_K (a function pointer) */
void hk_matmul_ggml(void *fn, int type, int rows, int n, const void *w, int tokens, const void *y, float *out) {
    hk_ggml_dot f = (hk_ggml_dot)fn;
    const size_t rb = (size_t)(n / 256) * (type == 12 ? 144 : type == 13 ? 176 : 210);
    const size_t yb = (size_t)(n / 256) * sizeof(block_q8_K);
    for (int t = 0; t < tokens; ++t)
        for (int r = 0; r < rows; ++r)
            f(n, out + (size_t)t * rows + r, 0, (const char *)w + r * rb, 0, (const char *)y + t * yb, 0, 1);
}

/* which = 0: the header's fused multiply-add (emulated where the unit has no FMA); 1: libm's fmaf */
void hk_fma(int n, const float *a, const float *b, const float *c, float *out, int which) {
    for (int i = 0; i < n; ++i) out[i] = which ? fmaf(a[i], b[i], c[i]) : hi_kq_fmaf(a[i], b[i], c[i]);
}

int hk_cpu_has(const char *isa) {
    __builtin_cpu_init();
    if (!strcmp(isa, "ssse3")) return __builtin_cpu_supports("ssse3");
    if (!strcmp(isa, "avx2")) return __builtin_cpu_supports("avx2");
    if (!strcmp(isa, "fma")) return __builtin_cpu_supports("fma");
    if (!strcmp(isa, "avx512f")) return __builtin_cpu_supports("avx512f");
    if (!strcmp(isa, "avx512bw")) return __builtin_cpu_supports("avx512bw");
    if (!strcmp(isa, "avx512vl")) return __builtin_cpu_supports("avx512vl");
    if (!strcmp(isa, "avx512vnni")) return __builtin_cpu_supports("avx512vnni");
    return 0;
}
"""

_ARGS = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
         ctypes.c_void_p]


# ------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def ggml():
    """libggml-cpu's K-quant kernels (what llama.cpp runs on this CPU)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_cpu_init()  # fills the fp16 table the kernels read
    lib.quantize_row_q8_K.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """ISA name -> ctypes library built from the header with that ISA's flags; ISAs this CPU lacks are left out.
    Empty without a C compiler (the header tests then skip; the reference tests loop in Python)."""
    cc = shutil.which("gcc")
    if cc is None:
        return {}
    d = tmp_path_factory.mktemp("kq_harness")
    src = d / "harness.c"
    src.write_text(HARNESS_C)
    libs = {}
    for isa, (flags, needs, _) in ISAS.items():
        so = d / f"kq_{isa}.so"
        cmd = [cc, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", *flags,
               "-I", SIMD_DIR, str(src), "-o", str(so), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{isa}: {' '.join(cmd)}\n{r.stderr}"
        lib = ctypes.CDLL(str(so))
        lib.hk_cpu_has.argtypes = [ctypes.c_char_p]
        if not all(lib.hk_cpu_has(f.encode()) for f in needs):
            continue
        lib.hk_matmul.argtypes = _ARGS
        lib.hk_matmul_ggml.argtypes = [ctypes.c_void_p] + _ARGS[:2] + _ARGS[3:]
        lib.hk_fma.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int]
        libs[isa] = lib
    return libs


def _run(lib, qtype: int, raw: np.ndarray, rows: int, n: int, y: np.ndarray, scalar: bool = False) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    y = np.ascontiguousarray(y, dtype=np.uint8)
    T = y.shape[0]
    out = np.zeros((T, rows), np.float32)
    lib.hk_matmul(qtype, int(scalar), rows, n, raw.ctypes.data, T, y.ctypes.data, out.ctypes.data)
    return out


def _run_ggml(ggml, harness, qtype: int, raw: np.ndarray, rows: int, n: int, y: np.ndarray) -> np.ndarray:
    """ggml's vec_dot for every (token, row), looped in C by the harness (in Python where there is none)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    y = np.ascontiguousarray(y, dtype=np.uint8)
    T = y.shape[0]
    out = np.zeros((T, rows), np.float32)
    f = getattr(ggml, f"ggml_vec_dot_{TYPES[qtype]}_q8_K")
    if harness is not None:
        fn = ctypes.cast(f, ctypes.c_void_p).value
        harness.hk_matmul_ggml(fn, qtype, rows, n, raw.ctypes.data, T, y.ctypes.data, out.ctypes.data)
        return out
    rb, yb = raw.size // rows, y.shape[1]
    for t in range(T):
        for r in range(rows):
            f(ctypes.c_int(n), ctypes.c_void_p(out.ctypes.data + 4 * (t * rows + r)), ctypes.c_size_t(0),
              ctypes.c_void_p(raw.ctypes.data + r * rb), ctypes.c_size_t(0),
              ctypes.c_void_p(y.ctypes.data + t * yb), ctypes.c_size_t(0), ctypes.c_int(1))
    return out


def _ggml_q8_K(ggml, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // 256 * ak.Q8K_BYTES), np.uint8)  # zeroed: ggml skips bsums of 0-blocks
    for t in range(x.shape[0]):
        ggml.quantize_row_q8_K(x[t].ctypes.data, out[t].ctypes.data, x.shape[1])
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


# ------------------------------------------------------------------------------------------------
# inputs


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random fp16 bit patterns (subnormals and both signs included, never inf or NaN), as bytes (n, 2)."""
    b = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    b[(b & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)
    return b.view(np.uint8).reshape(n, 2)


def _raw_blocks(qtype: int, nblk: int, rng: np.random.Generator) -> np.ndarray:
    """Uniformly random block bytes with finite fp16 scales: every bit pattern of quants and sub-scales."""
    raw = rng.integers(0, 256, (nblk, ak.BLOCK_BYTES[qtype]), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        raw[:, off:off + 2] = _finite_f16(rng, nblk)
    return raw


def _extreme_blocks(qtype: int, nblk: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks at the edges: all quants and sub-scales at their maxima (or minima), fp16 scales at the
    largest finite value, the smallest subnormal, zero, and negative."""
    raw = np.zeros((nblk, ak.BLOCK_BYTES[qtype]), np.uint8)
    f16 = np.array([0x7BFF, 0x0001, 0x0000, 0xFBFF, 0x03FF, 0x0400, 0x3C00], np.uint16)
    for i in range(nblk):
        kind = i % 4
        if qtype == ak.Q6_K:
            raw[i, :192] = 0xFF if kind in (0, 2) else 0x00  # q = 63 or 0
            raw[i, 192:208] = (0x80 if kind < 2 else 0x7F) if kind != 3 else rng.integers(0, 256, 16)  # sc -128 / 127
        else:
            raw[i, 4:16] = 0xFF if kind != 3 else rng.integers(0, 256, 12)  # sc = m = 63
            raw[i, 16:] = 0xFF if kind in (0, 2) else 0x00
        for off in FP16_FIELDS[qtype]:
            raw[i, off:off + 2] = np.array([f16[(i + off) % len(f16)]], np.uint16).view(np.uint8)
    return raw


def _blocks(source: str, qtype: int, nblk: int, rng: np.random.Generator) -> np.ndarray:
    if source == "random_blocks":
        return random_blocks(qtype, nblk, rng)
    return _raw_blocks(qtype, nblk, rng) if source == "raw_bytes" else _extreme_blocks(qtype, nblk, rng)


def _q8K_raw(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_K bytes from int8 quants q (T, nb, 256) and scales d (T, nb), bsums consistent."""
    T, nb, _ = q.shape
    out = np.zeros((T, nb), dtype=[("d", "<f4"), ("qs", "i1", (256,)), ("bsums", "<i2", (16,))])
    out["d"] = d
    out["qs"] = q
    out["bsums"] = q.reshape(T, nb, 16, 16).sum(-1, dtype=np.int16)
    return out.view(np.uint8).reshape(T, nb * ak.Q8K_BYTES)


def _activations(rng: np.random.Generator, T: int, n: int) -> np.ndarray:
    x = (rng.standard_normal((T, n)) * rng.uniform(0.01, 30, (T, 1))).astype(np.float32)
    if T > 1:
        x[1, :256] = 0  # an all-zero block
    return x


SHAPES = [(1, 256), (7, 256), (33, 3 * 256), (5, 17 * 256)]  # (rows, n): odd rows, n = 256 k with odd k


# ------------------------------------------------------------------------------------------------
# (a) the numpy reference against libggml-cpu


def test_quantize_q8_K_matches_ggml(ggml):
    rng = np.random.default_rng(0)
    n = 256 * 5
    x = _activations(rng, 5, n)
    x[2, 256:512] = rng.integers(-40, 40, 256) + 0.5  # rounding ties (round half to even)...
    x[2, 256 + 7] = -127.0  # ...with iscale = -127 / max = 1 exactly
    x[2, 512:768] = rng.integers(-40, 40, 256) - 0.5
    x[2, 512 + 3] = 127.0  # iscale = -1
    x[3, 0:256] = rng.standard_normal(256).astype(np.float32)
    x[3, 10], x[3, 20] = 9.0, -9.0  # equal magnitudes: the first one sets the sign of d
    x[3, 256:512] *= np.float32(1e-30)  # tiny and huge blocks
    x[3, 512:768] *= np.float32(1e30)
    x[4, 768:1024] = np.float32(1e-40)  # subnormal block: iscale overflows to -inf, as in ggml
    x[4, 0:256] = rng.standard_normal(256).astype(np.float32)
    x[4, 5], x[4, 9] = np.nan, np.inf  # non-finite values: whatever ggml stores, the same bytes
    ours = ak.quantize_q8_K(x)
    assert ours.shape == (5, 5 * 292) and ours.dtype == np.uint8
    np.testing.assert_array_equal(ours, _ggml_q8_K(ggml, x))
    d, q, bs = ak.unpack_q8_K(ours, n)
    assert d[1, 0] == 0 and not q[1, 0].any()


@pytest.mark.parametrize("qtype", list(TYPES), ids=TIDS)
@pytest.mark.parametrize("source", ["random_blocks", "raw_bytes", "extreme"])
def test_reference_matches_ggml(ggml, kernels, qtype, source):
    rng = np.random.default_rng(qtype * 7 + len(source))
    for rows, n in SHAPES:
        nblk = rows * n // 256
        raw = _blocks(source, qtype, nblk, rng)
        x = _activations(rng, 3, n)
        ref = ak.kquant_matmul(x, raw, qtype, rows, n)
        assert ref.shape == (3, rows) and ref.dtype == np.float32
        theirs = _run_ggml(ggml, kernels.get("scalar"), qtype, raw, rows, n, _ggml_q8_K(ggml, x))
        assert _same_bits(ref, theirs), (TYPES[qtype], source, rows, n, np.abs(ref - theirs).max())


def test_reference_matches_ggml_on_extreme_activations(ggml, kernels):
    """Q8_K quants at -128 (ggml's quantizer stops at -127; the kernels must not care) and 127."""
    rng = np.random.default_rng(5)
    rows, n = 9, 3 * 256
    q = rng.integers(-128, 128, (2, n // 256, 256)).astype(np.int8)
    q[0, 0] = -128
    q[0, 1] = 127
    d = np.array([[1.0, 3e-5, 7.5], [0.25, 1e4, 1e-3]], np.float32)
    y = _q8K_raw(q, d)
    for qtype in TYPES:
        for raw in (_extreme_blocks(qtype, rows * 3, rng), _raw_blocks(qtype, rows * 3, rng)):
            ref = ak.kquant_matmul_q8(y, raw, qtype, rows, n)
            assert _same_bits(ref, _run_ggml(ggml, kernels.get("scalar"), qtype, raw, rows, n, y)), TYPES[qtype]


def test_reference_rejects_other_types():
    with pytest.raises(ValueError, match="Q4_K"):
        ak.kquant_matmul(np.zeros((1, 256), np.float32), np.zeros(34 * 8, np.uint8), 8, 1, 256)


def _fma_cases(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, c) float32 as the kernels meet them (a a scale product, b an integer lane, c an accumulator):
    random ones over wide ranges, and ones built so that a*b + c rounded to double lands exactly on a float
    tie while the exact sum does not (where a double-rounding emulation of fma goes wrong)."""
    n = 20000
    a = (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-40, 10, n)).astype(np.float32)
    b = rng.integers(-(1 << 24), 1 << 24, n).astype(np.float32)
    c = (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-30, 40, n)).astype(np.float32)
    # ties: b*k = 2^47 + r with 0 < |r| < 2^18, a = k 2^-71, so a*b = 2^-24 + r 2^-71 and 1 + a*b is within
    # 2^-53 of the tie 1 + 2^-24
    bb = rng.integers(1 << 23, 1 << 24, 200000, dtype=np.int64)
    k = (2.0 ** 47 / bb).round().astype(np.int64)
    r = bb * k - (1 << 47)
    ok = (r != 0) & (np.abs(r) < 1 << 18) & (k < 1 << 24)
    bb, k = bb[ok][:2000], k[ok][:2000]
    e = rng.integers(-20, 20, bb.size)
    sign = rng.choice([-1.0, 1.0], bb.size)
    at = (k * 2.0 ** (e - 71.0) * sign).astype(np.float32)
    ct = (2.0 ** e * sign).astype(np.float32)
    return np.concatenate([a, at]), np.concatenate([b, bb.astype(np.float32)]), np.concatenate([c, ct])


def test_fma_emulations_are_exact(kernels):
    """The reference's fma32 and the header's fused multiply-add (emulated in the units without FMA) against
    libm's fmaf, on the cases where rounding twice would differ."""
    _isa(kernels, "scalar")
    a, b, c = _fma_cases(np.random.default_rng(3))
    n = a.size
    libm = np.zeros(n, np.float32)
    kernels["scalar"].hk_fma(n, a.ctypes.data, b.ctypes.data, c.ctypes.data, libm.ctypes.data, 1)
    twice = (a.astype(np.float64) * b + c).astype(np.float32)
    assert not _same_bits(twice, libm)  # the tie cases do expose double rounding
    assert _same_bits(ak.fma32(a, b, c), libm)
    for isa, lib in kernels.items():
        out = np.zeros(n, np.float32)
        lib.hk_fma(n, a.ctypes.data, b.ctypes.data, c.ctypes.data, out.ctypes.data, 0)
        assert _same_bits(out, libm), isa


# ------------------------------------------------------------------------------------------------
# (b) the header, per ISA


def _isa(kernels, isa):
    if not kernels:
        pytest.skip("no gcc to compile the header")
    if isa not in kernels:
        pytest.skip(f"this CPU lacks {isa}")
    return kernels[isa]


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("qtype", list(TYPES), ids=TIDS)
def test_kernel_matches_reference_and_ggml(ggml, kernels, isa, qtype):
    """AVX paths: the AVX2-order reference and the host's llama.cpp (an AVX2 or wider build); SSSE3 and scalar
    paths: the generic-order reference. Every unit's portable functions (_scalar) are the generic ones."""
    lib = _isa(kernels, isa)
    generic = ISAS[isa][2] == "generic"
    rng = np.random.default_rng(100 + qtype)
    for source in ("random_blocks", "raw_bytes", "extreme"):
        for rows, n in SHAPES:
            nblk = rows * n // 256
            raw = _blocks(source, qtype, nblk, rng)
            x = _activations(rng, 3, n)
            if source == "extreme":
                x[0, :256] *= np.float32(1e6)  # a large activation block against the largest scales
            y = ak.quantize_q8_K(x)
            ours = _run(lib, qtype, raw, rows, n, y)
            gen = ak.kquant_matmul_q8_generic(y, raw, qtype, rows, n)
            what = (isa, TYPES[qtype], source, rows, n)
            assert _same_bits(_run(lib, qtype, raw, rows, n, y, scalar=True), gen), what
            if generic:
                assert _same_bits(ours, gen), what
            else:
                assert _same_bits(ours, ak.kquant_matmul_q8(y, raw, qtype, rows, n)), what
                assert _same_bits(ours, _run_ggml(ggml, kernels["scalar"], qtype, raw, rows, n, y)), what


@pytest.mark.parametrize("qtype", list(TYPES), ids=TIDS)
def test_generic_and_avx2_orders_differ(qtype):
    """The two references round differently on most rows of random blocks, so each check above tells them
    apart; both are the same dot product to float32 accuracy."""
    rng = np.random.default_rng(30 + qtype)
    rows, n = 64, 8 * 256
    raw = random_blocks(qtype, rows * n // 256, rng)
    y = ak.quantize_q8_K(_activations(rng, 2, n))
    gen = ak.kquant_matmul_q8_generic(y, raw, qtype, rows, n)
    avx = ak.kquant_matmul_q8(y, raw, qtype, rows, n)
    assert np.mean(gen.view(np.uint32) != avx.view(np.uint32)) > 0.3
    assert np.allclose(gen, avx, rtol=1e-4, atol=1e-5 * np.abs(avx).max())


def _exact_case(qtype: int, rng: np.random.Generator, rows: int, n: int, extreme: bool):
    """Blocks and activations whose every float operation is exact: fp16 scales 1 (and mins scale 1 or 2),
    Q8_K scale 1, so the result is the exact integer dot product whatever the rounding. Returns
    (raw, y, expected) with expected computed in int64."""
    nb = n // 256
    raw = _extreme_blocks(qtype, rows * nb, rng) if extreme else _raw_blocks(qtype, rows * nb, rng)
    one, two = np.array([0x3C00], np.uint16).view(np.uint8), np.array([0x4000], np.uint16).view(np.uint8)
    if qtype == ak.Q6_K:
        raw[:, 208:210] = one
    else:
        raw[:, 0:2] = one
        raw[:, 2:4] = two if not extreme else one
    if extreme:
        q = np.full((2, nb, 256), -128, np.int8)
        q[1] = 127
    else:
        q = rng.integers(-128, 128, (2, nb, 256)).astype(np.int8)
    y = _q8K_raw(q, np.ones((2, nb), np.float32))
    A, d, dmin, aux = ak.weight_terms(raw, qtype, rows, n)
    qi = q.astype(np.int64)
    exp = np.einsum("rbj,tbj->tr", A.astype(np.int64), qi)
    bs = qi.reshape(2, nb, 16, 16).sum(-1)
    if qtype == ak.Q6_K:
        exp -= 32 * np.einsum("rbs,tbs->tr", aux.astype(np.int64), bs)
    else:
        B = bs[..., 0::2] + bs[..., 1::2]
        dm = dmin.astype(np.int64)  # 1 or 2
        exp -= np.einsum("rb,rbs,tbs->tr", dm, aux.astype(np.int64), B)
    return raw, y, exp


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("qtype", list(TYPES), ids=TIDS)
def test_integer_sums_identical_across_isas(kernels, isa, qtype):
    lib = _isa(kernels, isa)
    rng = np.random.default_rng(7 + qtype)
    for extreme, (rows, n) in ((False, (11, 3 * 256)), (False, (3, 256)), (True, (4, 256))):
        raw, y, exp = _exact_case(qtype, rng, rows, n, extreme)
        assert np.abs(exp).max() < 2 ** 24 or extreme
        ours = _run(lib, qtype, raw, rows, n, y)
        scal = _run(kernels["scalar"], qtype, raw, rows, n, y, scalar=True)
        assert _same_bits(ours, scal), (isa, TYPES[qtype], extreme)
        if not extreme:
            np.testing.assert_array_equal(ours.astype(np.int64), exp)

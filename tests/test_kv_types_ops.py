"""K/V cache types (f16, q8_0, q4_0: llama.cpp's -ctk / -ctv) at the op level, on every ISA unit this CPU runs.

- The rows `attn_step` writes are llama.cpp's set_rows bytes: fp16 rounded to nearest even, q4_0 as
  quantize_row_q4_0_ref (gguf.quants), q8_0 as the quantize_row_q8_0 of the unit's ggml build (the AVX units:
  ggml's AVX path, half to even; scalar and SSSE3: quantize_row_q8_0_ref, half away from zero, which gguf.quants
  also gives); K roped first, both Walsh-Hadamard rotated first where asked (reference_ops.hadamard's bits).
- The attention over those rows is ggml_flash_attn_ext's (llama.cpp's own, tests/ggml_attention.py) bit for bit
  where the unit takes the float shape of the ggml build installed here, and within float rounding elsewhere and
  for rows over 2048 positions (which the op splits into chunks merged as llama.cpp's split decode merges them).
- attn_rows over typed caches is bit-identical to one attn_step per sequence.
- The rotation is the orthonormal Sylvester-Hadamard matrix, and state_kinds.kv_rotation is llama.cpp's rule.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hybridinfer.backends import reference_ops as rop
from hybridinfer.backends.cpu.simd import supported_isas
from hybridinfer.format.quant_types import cache_type
from hybridinfer.models.state_kinds import kv_rotation

ISAS = supported_isas()
FMA_ISAS = {"avx2", "avx512vnni"}  # ggml's AVX2 float shapes (FMA) and its AVX quantize_row_q8_0
H, HKV = 4, 2  # GQA: two query heads per K/V head
N_CTX = 300  # past one attention block (llama.cpp pads its cells to 256)
THETA = 1.0e7


def _ggml_level() -> str | None:
    """The ISA level the llama.cpp here was built for: "avx512", "avx2", "generic" (None: no llama.cpp)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    info = llama_cpp.llama_print_system_info().decode()
    return "avx512" if "AVX512 = 1" in info else "avx2" if "AVX2 = 1" in info else "generic"


GGML = _ggml_level()


def _exact(isa: str, kt: str) -> bool:
    """Whether unit `isa` computes what ggml_flash_attn_ext of the build here computes, bit for bit: q8_0 / q4_0 K
    take the AVX2 float shape of ggml's vec_dot on both its AVX2 and AVX-512 builds (and the steps after the dot are
    element by element); ggml_vec_dot_f16 (f16 K) has another shape on AVX-512 builds."""
    if isa not in FMA_ISAS or GGML not in ("avx2", "avx512"):
        return False
    return kt != "f16" or GGML == "avx2"


@pytest.fixture(scope="module")
def ggml():
    pytest.importorskip("llama_cpp")
    import ggml_kernels

    return ggml_kernels.load()


def _f(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _n_rot(hd: int) -> int:
    return hd // 4  # partial rotary, as Qwen3.5


def _roped(lib, x: np.ndarray, pos0: int) -> np.ndarray:
    y = np.ascontiguousarray(x, dtype=np.float32).copy()
    lib.rope(y, pos0, _n_rot(x.shape[-1]), THETA, True, np.zeros(0, np.float32))
    return y


def _set_rows(ggml, isa: str, x: np.ndarray, t: str) -> np.ndarray:
    """Rows x (T, Hkv, hd) as llama.cpp's set_rows writes them in cache type t for unit `isa` (independently of the
    engine: numpy's fp16, gguf.quants' q4_0, ggml's own q8_0 quantizers)."""
    import ggml_kernels
    from gguf import GGMLQuantizationType, quants

    if t == "f32":
        return x.astype(np.float32)
    if t == "f16":
        return x.astype(np.float16)  # round to nearest even
    if t == "q4_0":
        return quants.quantize(np.ascontiguousarray(x, np.float32), GGMLQuantizationType.Q4_0)
    T, hkv, hd = x.shape
    rows = [ggml_kernels.quantize_act(ggml, r, "q8_0", ref=isa not in FMA_ISAS) for r in x.reshape(T, hkv * hd)]
    return np.stack(rows).reshape(T, hkv, hd // 32 * 34)


def _caches(kt: str, vt: str, hd: int, n: int = N_CTX) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for t in (kt, vt):
        qt = cache_type(t)
        if t in ("f32", "f16"):
            out.append(np.zeros((n, HKV, hd), np.float32 if t == "f32" else np.float16))
        else:
            out.append(np.zeros((n, HKV, hd // qt.block * qt.nbytes), np.uint8))
    return out[0], out[1]


def _step(lib, q, k, v, kc, vc, pos0, kt, vt, rk=0, rv=0) -> np.ndarray:
    out = np.full((q.shape[0], H * q.shape[2]), np.nan, np.float32)
    scratch = np.zeros(lib.attention_scratch_size(kc.shape[0], q.shape[2]), np.float32)
    lib.attn_step(q, k, v, kc, vc, pos0, out, scratch, _n_rot(q.shape[2]), THETA, True, np.zeros(0, np.float32),
                  k_type=cache_type(kt).id, v_type=cache_type(vt).id, rot_k=rk, rot_v=rv)
    return out


def _tie_row(hd: int) -> np.ndarray:
    """A head's row whose q8_0 quants land on halves (d = 1): ggml's AVX quantizer rounds them to even, its
    reference quantizer away from zero."""
    r = (np.arange(hd, dtype=np.float32) % 32) - 15.5
    r[::32] = 127.0
    return r


# ---- 1. the rows written --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kt,vt,rot", [("f16", "f16", False), ("q8_0", "q8_0", False), ("q4_0", "q4_0", False),
                                       ("q8_0", "q4_0", True), ("q4_0", "q8_0", True), ("f16", "q8_0", True)])
@pytest.mark.parametrize("hd", [64, 128])
def test_rows_written_are_llama_set_rows(libs, ggml, kt, vt, rot, hd):
    """T = 9 rows at pos0 = 5 of a zeroed cache: K roped (and rotated), V (rotated), each in its type's bytes as
    llama.cpp writes them; the query roped and rotated as reference_ops.hadamard rotates it, bit for bit; no other
    row touched."""
    rng = np.random.default_rng(hd + len(kt + vt))
    T, pos0 = 9, 5
    rk, rv = ((hd if t == "k" else 64) if rot and cache_type(x).block > 1 else 0 for t, x in (("k", kt), ("v", vt)))
    for isa, lib in libs.items():
        q, k, v = _f(rng, T, H, hd), _f(rng, T, HKV, hd, scale=3.0), _f(rng, T, HKV, hd, scale=0.5)
        v[0, 0] = _tie_row(hd)
        kc, vc = _caches(kt, vt, hd, 32)
        q_in = q.copy()
        _step(lib, q, k, v, kc, vc, pos0, kt, vt, rk, rv)
        assert np.array_equal(q, rop.hadamard(_roped(lib, q_in, pos0), rk)), isa
        want_k = _set_rows(ggml, isa, rop.hadamard(_roped(lib, k, pos0), rk), kt)
        want_v = _set_rows(ggml, isa, rop.hadamard(v, rv), vt)
        assert np.array_equal(kc[pos0 : pos0 + T], want_k), (isa, "K")
        assert np.array_equal(vc[pos0 : pos0 + T], want_v), (isa, "V")
        for c in (kc, vc):
            assert not c[:pos0].any() and not c[pos0 + T :].any()
        if vt == "q8_0" and not rv:  # the tie row tells the two q8_0 roundings apart
            import ggml_kernels

            tie = v[0].reshape(-1)
            avx, ref = (ggml_kernels.quantize_act(ggml, tie, "q8_0", ref=r) for r in (False, True))
            assert not np.array_equal(avx, ref)
            assert np.array_equal(vc[pos0].reshape(-1), avx if isa in FMA_ISAS else ref), isa


def test_rows_equal_gguf_quants(libs):
    """gguf.quants (the reference backend's encoder) writes the same bytes for unrotated V rows: f16 and q4_0 at
    every unit, q8_0 at the units that quantize as ggml's reference quantizer (scalar, SSSE3; gguf rounds half away
    from zero too)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    rng = np.random.default_rng(7)
    hd, T = 64, 12
    for isa, lib in libs.items():
        for t, gt in (("f16", Q.F16), ("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0)):
            v = _f(rng, T, HKV, hd) * rng.uniform(0.01, 20.0, (T, HKV, 1)).astype(np.float32)
            v[0, 1] = _tie_row(hd)
            kc, vc = _caches("f16", t, hd, T)
            _step(lib, _f(rng, T, H, hd), _f(rng, T, HKV, hd), v, kc, vc, 0, "f16", t)
            want = quants.quantize(v, gt)
            if t == "q8_0" and isa in FMA_ISAS:
                assert not np.array_equal(vc.view(np.uint8), want.view(np.uint8)), isa  # the tie row differs
                assert np.array_equal(vc[2:], want[2:]), isa
            else:
                assert np.array_equal(vc.view(np.uint8), want.view(np.uint8)), (isa, t)


# ---- 2. the attention against ggml_flash_attn_ext ----------------------------------------------------------------
def _filled(lib, rng, kt, vt, hd, T, rk, rv):
    """Caches of N_CTX rows filled by attn_step in chunks of 64 up to N_CTX - T, then the step of the last T rows:
    (roped and rotated q of that step, caches, its output)."""
    kc, vc = _caches(kt, vt, hd)
    p = 0
    while p < N_CTX - T:
        n = min(64, N_CTX - T - p)
        _step(lib, _f(rng, n, H, hd), _f(rng, n, HKV, hd), _f(rng, n, HKV, hd), kc, vc, p, kt, vt, rk, rv)
        p += n
    q = _f(rng, T, H, hd, scale=2.0)
    out = _step(lib, q, _f(rng, T, HKV, hd), _f(rng, T, HKV, hd), kc, vc, p, kt, vt, rk, rv)
    return q, kc, vc, out


def _check(isa, kt, vt, got, want, what):
    scale = float(np.abs(want).max())
    d = float(np.abs(got - want).max())
    if _exact(isa, kt):
        assert np.array_equal(got, want), f"{what}: max |d| {d:.3g} of {scale:.3g}"
    else:  # f16 V accumulates in fp16 (ggml_vec_mad_f16): a last-bit difference upstream moves it by an fp16 step
        assert d <= (2e-3 if vt == "f16" else 1e-5) * scale, f"{what}: max |d| {d:.3g} of {scale:.3g}"


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("vt", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("kt", ["f16", "q8_0", "q4_0"])
def test_attention_equals_ggml_flash_attn_ext(libs, kt, vt, hd):
    """One query row (decode) and 7 rows (a prompt's chunk) at the end of a 300-row cache, H = 4 over H_kv = 2, with
    and without the rotation of quantized rows: ggml_flash_attn_ext over the same cache bytes (and the same roped,
    rotated q; its output rotated back)."""
    pytest.importorskip("llama_cpp")
    import ggml_attention

    rng = np.random.default_rng(hd * 7 + len(kt) * 3 + len(vt))
    rots = [(0, 0)]
    if kt != "f16" or vt not in ("f32", "f16"):
        rots.append((hd if kt != "f16" else 0, 64 if vt not in ("f32", "f16") else 0))
    for isa, lib in libs.items():
        for T in (1, 7):
            for rk, rv in rots:
                q, kc, vc, out = _filled(lib, rng, kt, vt, hd, T, rk, rv)
                want = ggml_attention.flash_attention(q, kc, vc, kt, vt, N_CTX - T).reshape(T, H * hd)
                _check(isa, kt, vt, out, rop.hadamard(want, rv), f"{isa} {kt}/{vt} hd {hd} T {T} rot {rk},{rv}")


@pytest.mark.parametrize("n", [2000, 2500])
@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "f32"), ("f16", "f16"), ("q8_0", "f16")])
def test_long_rows_against_ggml_flash_attn_ext(libs, kt, vt, n):
    """Rows over 2000 positions: as test_attention_equals_ggml_flash_attn_ext. Over 2500, past the length (2048)
    where the op splits a row into chunks of 1024 merged as llama.cpp merges its split-decode partials, while the
    llama.cpp here attends quantized K in one pass at any length (split decode: F16/F32 K and V of one type only):
    within float rounding then, at every unit; fp16 V much less close (ggml's one pass keeps VKQ in fp16 over all
    the rows, the merge adds the chunks' in float)."""
    pytest.importorskip("llama_cpp")
    import ggml_attention

    hd = 64
    rng = np.random.default_rng(n)
    for isa, lib in libs.items():
        for T in (1, 3):
            kc, vc = _caches(kt, vt, hd, n)
            p = n - T  # the earlier rows written directly (the reference's encoder): only the last step attends
            kc[:p], vc[:p] = rop.kv_encode(_f(rng, p, HKV, hd), kt), rop.kv_encode(_f(rng, p, HKV, hd), vt)
            q = _f(rng, T, H, hd, scale=0.5)  # a flat softmax: every position counts
            out = _step(lib, q, _f(rng, T, HKV, hd), _f(rng, T, HKV, hd), kc, vc, p, kt, vt)
            want = ggml_attention.flash_attention(q, kc, vc, kt, vt, p).reshape(T, H * hd)
            if n <= 2048:
                _check(isa, kt, vt, out, want, f"{isa} {kt}/{vt} {n} positions T {T}")
            else:
                d, scale = float(np.abs(out - want).max()), float(np.abs(want).max())
                assert d <= (5e-2 if vt == "f16" else 1e-5) * scale, (isa, T, d, scale)


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16")])
def test_rotation_against_ggml_on_rows_rotated_here(libs, ggml, kt, vt):
    """A 300-token prompt in one step with the rotation on: q, K and V rotated here (reference_ops.hadamard after the
    unit's rope), written as set_rows writes them, attended by ggml_flash_attn_ext and rotated back, equal the op's
    cache and output. The rotation is the same maths (orthogonal): the output stays about as close to the float
    attention of the unrotated rows as without it (a missing rotation of q or of the output would not be close)."""
    pytest.importorskip("llama_cpp")
    import ggml_attention

    hd, T = 128, N_CTX
    rk, rv = hd, (64 if vt != "f16" else 0)
    rng = np.random.default_rng(31)
    q, k, v = _f(rng, T, H, hd, scale=2.0), _f(rng, T, HKV, hd), _f(rng, T, HKV, hd)
    for isa, lib in libs.items():
        qr = rop.hadamard(_roped(lib, q, 0), rk)
        k_rows = _set_rows(ggml, isa, rop.hadamard(_roped(lib, k, 0), rk), kt)
        v_rows = _set_rows(ggml, isa, rop.hadamard(v, rv), vt)
        want = rop.hadamard(ggml_attention.flash_attention(qr, k_rows, v_rows, kt, vt, 0).reshape(T, H * hd), rv)
        outs = {}
        for r in (True, False):
            kc, vc = _caches(kt, vt, hd)
            q1 = q.copy()
            outs[r] = _step(lib, q1, k, v, kc, vc, 0, kt, vt, rk if r else 0, rv if r else 0)
            if r:
                assert np.array_equal(q1, qr) and np.array_equal(kc, k_rows) and np.array_equal(vc, v_rows), isa
                _check(isa, kt, vt, outs[r], want, f"{isa} {kt}/{vt} rotated")
        exact = rop.causal_attention(_roped(lib, q, 0), _roped(lib, k, 0), v, 0).reshape(T, H * hd)
        rms = lambda x: float(np.sqrt(np.mean(np.square(x))))  # noqa: E731
        err = {r: rms(o - exact) for r, o in outs.items()}
        # q8_0 about 1% of the output's rms, q4_0 about 15%; the output left rotated would be off by over 100%
        assert 0 < err[True] <= 1.5 * err[False] and err[True] < 0.25 * rms(exact), (isa, err, rms(exact))


# ---- attn_rows: B sequences at their own positions ---------------------------------------------------------------
@pytest.mark.parametrize("kt,vt,rot", [("q8_0", "q8_0", True), ("q4_0", "f16", False), ("f16", "q4_0", True),
                                       ("q8_0", "f32", False)])
def test_attn_rows_typed_equal_one_step_per_sequence(libs, kt, vt, rot):
    """One token of each of 4 sequences at positions 0, 37, 150 and 298 (+1) of typed caches: queries, caches and
    outputs bit-identical to 4 attn_step calls, with either scratch layout."""
    hd, pos = 64, [0, 37, 150, 298]
    rk = 64 if rot and kt != "f16" else 0
    rv = 64 if rot and vt not in ("f32", "f16") else 0
    for isa, lib in libs.items():
        rng = np.random.default_rng(5)
        caches = []
        for p in pos:  # each sequence's earlier rows (and one more, for dpos = 1)
            kc, vc = _caches(kt, vt, hd)
            _step(lib, _f(rng, p + 1, H, hd), _f(rng, p + 1, HKV, hd), _f(rng, p + 1, HKV, hd), kc, vc, 0, kt, vt,
                  rk, rv)
            caches.append((kc, vc))
        B = len(pos)
        q, k, v = _f(rng, B, H, hd, scale=2.0), _f(rng, B, HKV, hd), _f(rng, B, HKV, hd)
        types = dict(k_type=cache_type(kt).id, v_type=cache_type(vt).id, rot_k=rk, rot_v=rv)
        rope = (_n_rot(hd), THETA, True, np.zeros(0, np.float32))
        for dpos, group in ((0, 1), (1, H // HKV)):
            want_q, want_c = q.copy(), [(a.copy(), b.copy()) for a, b in caches]
            want_o = np.stack([_step(lib, want_q[j : j + 1], k[j : j + 1], v[j : j + 1], *want_c[j], pos[j] + dpos,
                                     kt, vt, rk, rv)[0] for j in range(B)])
            got_q, got_c = q.copy(), [(a.copy(), b.copy()) for a, b in caches]
            got_o = np.full((B, H * hd), np.nan, np.float32)
            scratch = np.zeros(lib.attention_scratch_size(N_CTX, hd, group), np.float32)
            lib.attn_rows(got_q, k, v, [c[0] for c in got_c], [c[1] for c in got_c], pos, dpos, got_o, scratch,
                          *rope, **types)
            assert np.array_equal(got_q, want_q) and np.array_equal(got_o, want_o), (isa, dpos)
            for (gk, gv), (wk, wv) in zip(got_c, want_c, strict=True):
                assert np.array_equal(gk, wk) and np.array_equal(gv, wv), (isa, dpos)


# ---- 3. the rotation -------------------------------------------------------------------------------------------
def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@pytest.mark.parametrize("n", [64, 128, 256])
def test_hadamard_is_the_orthonormal_sylvester_matrix(n):
    """hadamard(x, n) multiplies each n values by H_n = [[H, H], [H, -H]] / sqrt(n): H H^T = I, H = H^T, so applying
    it twice gives x back within float32 rounding; chunks of n along the last axis; n = 0 leaves x."""
    h = rop.hadamard(np.eye(n, dtype=np.float32), n)
    assert h.dtype == np.float32
    np.testing.assert_allclose(h, _sylvester(n), rtol=0, atol=1e-7)
    np.testing.assert_allclose(h @ h.T, np.eye(n), rtol=0, atol=1e-5)
    rng = np.random.default_rng(n)
    x = _f(rng, 3, 2, 2 * n, scale=5.0)
    y = rop.hadamard(x, n)
    want = (x.reshape(-1, n).astype(np.float64) @ _sylvester(n).T).reshape(x.shape)
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-5 * np.abs(x).max())
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(rop.hadamard(y, n), x, rtol=0, atol=2e-5 * np.abs(x).max())
    assert not np.allclose(y, x)
    assert rop.hadamard(x, 0) is x


@pytest.mark.parametrize("hd,kt,vt,rotate,want", [
    (64, "q8_0", "q8_0", True, (64, 64)),
    (128, "q8_0", "q4_0", True, (128, 64)),
    (256, "q8_0", "q8_0", True, (256, 64)),  # K: the largest power of two from 64 dividing the head; V: 64
    (192, "q4_0", "q4_0", True, (64, 64)),
    (256, "q4_0", "f16", True, (256, 0)),  # only quantized types rotate
    (256, "f16", "q8_0", True, (0, 64)),
    (128, "f16", "f16", True, (0, 0)),
    (128, "f32", "f32", True, (0, 0)),
    (64, "q8_0", "q8_0", False, (0, 0)),  # cache_rotate=False (LLAMA_ATTN_ROT_DISABLE)
    (96, "q8_0", "q8_0", True, (0, 0)),  # 96 % 64 != 0
    (32, "q4_0", "q4_0", True, (0, 0)),
])
def test_kv_rotation_is_llama_cpp_rule(hd, kt, vt, rotate, want):
    args = SimpleNamespace(head_dim=hd, cache_type_k=kt, cache_type_v=vt, cache_rotate=rotate)
    assert kv_rotation(args) == want


def test_rotation_sizes_the_op_refuses(libs):
    """A rotation the op cannot take (not a power of two from 64 dividing the head, or of an unquantized type)
    raises rather than writing rows."""
    lib = libs[ISAS[-1]]
    rng = np.random.default_rng(0)
    hd = 64
    for kt, vt, rk, rv in (("q8_0", "q8_0", 32, 0), ("q8_0", "q8_0", 128, 0), ("f16", "q8_0", 64, 0),
                           ("q8_0", "f32", 0, 64), ("q4_0", "q4_0", 0, 48)):
        kc, vc = _caches(kt, vt, hd, 8)
        with pytest.raises(ValueError, match="rejected the arguments"):
            _step(lib, _f(rng, 1, H, hd), _f(rng, 1, HKV, hd), _f(rng, 1, HKV, hd), kc, vc, 0, kt, vt, rk, rv)
        assert not kc.any() and not vc.any()

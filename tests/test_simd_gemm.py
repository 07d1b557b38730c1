"""The SIMD library's float products of many rows (native/simd/gemm.c, kernels_gemm.h), which the vision tower's
F32/F16 matrices take on the AVX2 and AVX-512 units: against a float64 product, at edge sizes (partial row blocks,
partial panels, k past one block of 256), with row strides, and the same bits at any thread count and on both
units (each output sums its k in the same order)."""

import numpy as np
import pytest

from hybridinfer.backends.cpu.simd import SimdLib, supported_isas
from hybridinfer.errors import KernelArgumentError

HAVE = ("avx2", "avx512vnni")
SHAPES = ((1, 1, 1), (7, 33, 31), (13, 65, 300), (100, 70, 600), (25, 40, 257), (97, 16, 512))


def _case(M, N, K, seed=0):
    rng = np.random.default_rng([seed, M, N, K])
    return rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)


@pytest.mark.parametrize("isa", supported_isas())
def test_units_with_float_products_pack_and_the_others_say_none(isa):
    lib = SimdLib(isa, n_threads=1)
    try:
        p = lib.gemm_pack(np.ones((3, 5), np.float32))
        assert (p is not None) == (isa in HAVE) == lib.has_gemm
    finally:
        lib.close()


@pytest.mark.parametrize("isa", [i for i in supported_isas() if i in HAVE])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_products_match_float64_with_strides(isa, M, N, K):
    lib = SimdLib(isa, n_threads=2)
    try:
        x, w = _case(M, N, K)
        wide_x = np.full((M, K + 5), np.nan, np.float32)
        wide_x[:, :K] = x
        p = lib.gemm_pack(w)
        wide_t = np.zeros((K, N + 2), np.float32)  # Wᵀ as a matmul's right operand, rows strided
        wide_t[:, :N] = w.T
        assert np.array_equal(lib.gemm_pack(wide_t[:, :N], transposed=True), p)
        wide_y = np.full((M, N + 3), -7.0, np.float32)
        lib.gemm(wide_x[:, :K], p, N, wide_y[:, :N])
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        bound = 2e-6 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)) + 1e-6
        assert np.all(np.abs(wide_y[:, :N] - ref) <= bound)
        assert np.all(wide_y[:, N:] == -7.0)  # nothing past the n columns is written
    finally:
        lib.close()


def test_the_same_bits_at_any_thread_count_and_on_both_units():
    isas = [i for i in supported_isas() if i in HAVE]
    if not isas:
        pytest.skip("this CPU runs neither AVX2 nor AVX-512 (the units with float products)")
    x, w = _case(150, 200, 700, seed=3)
    outs = []
    for isa in isas:
        for t in (1, 3):
            lib = SimdLib(isa, n_threads=t)
            try:
                outs.append(lib.gemm(x, lib.gemm_pack(w), 200, np.empty((150, 200), np.float32)))
            finally:
                lib.close()
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])


def test_packed_weights_of_another_shape_are_refused():
    isas = [i for i in supported_isas() if i in HAVE]
    if not isas:
        pytest.skip("this CPU runs neither AVX2 nor AVX-512 (the units with float products)")
    lib = SimdLib(isas[0], n_threads=1)
    try:
        p = lib.gemm_pack(np.ones((40, 64), np.float32))
        with pytest.raises(KernelArgumentError, match=r"\[70, 64\]"):
            lib.gemm(np.ones((3, 64), np.float32), p, 70, np.empty((3, 70), np.float32))
    finally:
        lib.close()


@pytest.mark.parametrize("isa", [i for i in supported_isas() if i in HAVE])
@pytest.mark.parametrize("M,N,K", ((7, 33, 31), (25, 40, 257), (100, 70, 600)))
def test_bias_is_the_bits_of_adding_it_after(isa, M, N, K):
    """The bias added in the product's last pass over each tile is numpy's `out += bias` after it, bit for bit, also
    where the output rows are strided and with columns past a panel."""
    lib = SimdLib(isa, n_threads=3)
    try:
        x, w = _case(M, N, K, seed=5)
        bias = np.random.default_rng(1).standard_normal(N).astype(np.float32) * 10
        p = lib.gemm_pack(w)
        plain = lib.gemm(x, p, N, np.empty((M, N), np.float32))
        wide = np.full((M, N + 3), np.nan, np.float32)
        got = lib.gemm(x, p, N, wide[:, :N], bias)
        assert np.array_equal(got, plain + bias)
        assert np.isnan(wide[:, N:]).all()
        res_wide = np.random.default_rng(2).standard_normal((M, N + 4)).astype(np.float32)
        res = res_wide[:, 2:N + 2]  # strided rows
        assert np.array_equal(lib.gemm(x, p, N, np.empty((M, N), np.float32), bias, res), res + (plain + bias))
        assert np.array_equal(lib.gemm(x, p, N, np.empty((M, N), np.float32), None, res), res + plain)
        out = np.empty((M, N), np.float32)
        with pytest.raises(KernelArgumentError, match="share memory"):
            lib.gemm(x, p, N, out, bias, out)
        for bad in (bias[:-1], bias.astype(np.float64), list(bias)):
            with pytest.raises(KernelArgumentError, match=f"{N} contiguous float32"):
                lib.gemm(x, p, N, np.empty((M, N), np.float32), bad)
    finally:
        lib.close()

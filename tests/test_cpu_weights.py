"""Where the CPU backend reads its weights: the policy, the huge-page buffer, and that a copy changes no bit."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.cpu.backend import Mat
from hybridinfer.backends.cpu.simd import KQ_ZIPPED, base_type, supported_isas
from hybridinfer.backends.cpu.weights import choose_weights_mode, copy_mats, huge_page_buffer
from hybridinfer.engine.api import Engine


def test_policy():
    gib = 1 << 30
    assert choose_weights_mode("copy", 100 * gib, gib) == "copy"
    assert choose_weights_mode("mmap", 1, 100 * gib) == "mmap"
    assert choose_weights_mode("auto", 10 * gib, 20 * gib) == "copy"
    assert choose_weights_mode("auto", 10 * gib + 1, 20 * gib) == "mmap"
    assert choose_weights_mode("auto", 1, None) == "mmap"
    with pytest.raises(ValueError, match="'mlock'"):
        choose_weights_mode("mlock", 1, 1)


def test_huge_page_buffer_is_aligned_and_writable():
    b = huge_page_buffer(5 << 20 | 123)
    assert b.dtype == np.uint8 and b.nbytes == 5 << 20 | 123
    assert b.ctypes.data % (2 << 20) == 0
    assert not b.any()
    b[-1] = 7
    assert b[-1] == 7
    with pytest.raises(ValueError, match="positive"):
        huge_page_buffer(0)


def test_copy_mats_moves_bytes_into_one_buffer():
    rng = np.random.default_rng(0)
    owners = []
    for n in (100, 64, 3000):
        owners.append(({"m": Mat("w", rng.integers(0, 256, n, dtype=np.uint8), 8, 1, 32)}, "m"))
    before = [o["m"].raw.copy() for o, _ in owners]
    size = copy_mats(owners)
    assert size >= 100 + 64 + 3000
    bases = set()
    for (o, _), b in zip(owners, before, strict=True):
        assert np.array_equal(o["m"].raw, b)
        assert o["m"].raw.ctypes.data % 64 == 0
        bases.add(o["m"].raw.base.ctypes.data if o["m"].raw.base is not None else None)
    assert len(bases) == 1  # views of one buffer


@pytest.mark.parametrize("isa", [None, "ssse3"])
@pytest.mark.parametrize("arch,quant", [("qwen35moe", "q4_k_m"), ("qwen35", "q8_0")])
def test_copied_weights_give_the_same_logits(arch, quant, isa, oracle_gguf):
    """A copy changes no bit; on the SSSE3 unit the copy's K-quant matrices are also repacked (zipped)."""
    if isa is not None and isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa}")
    path = str(oracle_gguf(arch, quant))
    ids = [int(x) for x in np.random.default_rng(3).integers(0, 200, 12)]
    out = {}
    for mode in ("mmap", "copy"):
        eng = Engine.load(path, backend="cpu", n_ctx=64, weights=mode, n_threads=2, isa=isa)
        assert eng.backend.weights == mode
        assert (eng.backend.weights_bytes > 0) == (mode == "copy")
        zipped = [m.name for m in eng.backend.mats if m.qtype & KQ_ZIPPED]
        kq = [m.name for m in eng.backend.mats if base_type(m.qtype) in (12, 13, 14)]
        if mode == "copy" and eng.backend.simd.isa == "ssse3":
            assert zipped == kq and (quant == "q8_0" or kq)
        else:
            assert not zipped
        st = eng.new_state()
        pre = eng.backend.forward(ids[:8], st).copy()
        dec = np.stack([eng.backend.forward([t], st, all_logits=False)[0].copy() for t in ids[8:]])
        out[mode] = (pre, dec)
    assert np.array_equal(out["mmap"][0], out["copy"][0])
    assert np.array_equal(out["mmap"][1], out["copy"][1])


def test_bad_weights_mode_is_named(oracle_gguf):
    with pytest.raises(ValueError, match="'disk'"):
        Engine.load(str(oracle_gguf("qwen35", "q8_0")), backend="cpu", n_ctx=64, weights="disk")


def test_engine_takes_the_prefetch_setting(oracle_gguf):
    from hybridinfer.backends.cpu.simd import PREFETCH_BYTES

    path = str(oracle_gguf("qwen35", "q8_0"))
    assert Engine.load(path, backend="cpu", n_ctx=64, n_threads=2).backend.simd.prefetch == 0
    assert Engine.load(path, backend="cpu", n_ctx=64, n_threads=4).backend.simd.prefetch == PREFETCH_BYTES
    assert Engine.load(path, backend="cpu", n_ctx=64, n_threads=2, prefetch=8192).backend.simd.prefetch == 8192
    with pytest.raises(ValueError, match="prefetch"):
        Engine.load(path, backend="cpu", n_ctx=64, prefetch=-5)

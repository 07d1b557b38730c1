"""Typed attention's outputs over many shapes, saved by one build and compared bit for bit by another: the check that a
change to the kernels (kernels_fa.h, kernels_fa_tiled.h, attn.c) changed no bit, at the ISA units this CPU runs
(the AVX-512 unit included where it runs; the tests compare with llama.cpp only at the lengths and groupings they
cover). Head shapes (16 on 2 of 256, 4 on 2 of 64, 6 on 1 of 32), every K/V type pair kind, one-pass and split rows
with tails, 1 and 3 query rows, 1 to 3 threads (units of different row counts).

    git checkout main && python setup.py -q build_ext --inplace
    PYTHONPATH=. python bench/typed_attention_golden.py dump /tmp/fa_golden.npz
    git checkout <branch> && python setup.py -q build_ext --inplace
    PYTHONPATH=. python bench/typed_attention_golden.py check /tmp/fa_golden.npz [--isa avx512vnni]
"""

from __future__ import annotations

import argparse
import zlib

import numpy as np

from hybridinfer.backends import reference_ops as rop
from hybridinfer.backends.cpu.simd import SimdLib, supported_isas
from hybridinfer.format.quant_types import cache_row, cache_type

PAIRS = (("q8_0", "q8_0"), ("q4_0", "q8_0"), ("f16", "f16"), ("lm4", "lm3"), ("lm3", "q4_0"), ("q8_0", "f32"),
         ("f32", "f16"))
QUANT = ("q8_0", "q4_0", "lm3", "lm4")


def cases():
    for H, Hkv, hd in ((16, 2, 256), (4, 2, 64), (6, 1, 32)):
        for kt, vt in PAIRS:
            for n in ((37, 1024, 2100, 5000) if hd == 256 else (1, 5, 64, 300, 2048, 2049, 2100, 3000, 4100)):
                yield H, Hkv, hd, kt, vt, n


def inputs(case):
    """The case's caches and new rows (the same at every run: seeded by the case)."""
    H, Hkv, hd, kt, vt, n = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    out = []
    for T in (1, 3) if n > 3 else (1,):
        p = n - T
        kd, kr = cache_row(cache_type(kt).id, hd)
        vd, vr = cache_row(cache_type(vt).id, hd)
        kc, vc = np.zeros((n, Hkv, kr), kd), np.zeros((n, Hkv, vr), vd)
        if p:
            kc[:p] = rop.kv_encode(rng.standard_normal((p, Hkv, hd)).astype(np.float32), kt)
            vc[:p] = rop.kv_encode(rng.standard_normal((p, Hkv, hd)).astype(np.float32), vt)
        q = (rng.standard_normal((T, H, hd)) * 0.7).astype(np.float32)
        k, v = (rng.standard_normal((T, Hkv, hd)).astype(np.float32) for _ in range(2))
        out.append((T, p, kc, vc, q, k, v))
    return out


def run(isas) -> dict[str, np.ndarray]:
    res, data = {}, {}
    for isa in isas:
        for nt in (1, 2, 3):
            lib = SimdLib(isa, n_threads=nt)
            for case in cases():
                H, Hkv, hd, kt, vt, n = case
                if case not in data:
                    data[case] = inputs(case)
                outs = []
                for T, p, kc, vc, q, k, v in data[case]:
                    o = np.zeros((T, H * hd), np.float32)
                    scratch = np.zeros(lib.attention_scratch_size(n, hd, H // Hkv), np.float32)
                    rk = hd if kt in QUANT and hd >= 64 else 0
                    rv = 64 if vt in QUANT and hd >= 64 else 0
                    lib.attn_step(q.copy(), k, v, kc.copy(), vc.copy(), p, o, scratch, hd // 4, 1.0e4, True,
                                  np.zeros(0, np.float32), 1, cache_type(kt).id, cache_type(vt).id, rk, rv)
                    outs.append(o.ravel())
                res[f"{isa}/{H},{Hkv},{hd}/{kt},{vt}/{n}/{nt}"] = np.concatenate(outs)
            lib.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("dump", "check"))
    ap.add_argument("path")
    ap.add_argument("--isa", default=",".join(supported_isas()), help="units, comma separated (default: all here)")
    args = ap.parse_args()
    res = run(args.isa.split(","))
    if args.mode == "dump":
        np.savez(args.path, **res)
        print(f"{len(res)} cases saved to {args.path}")
        return
    want = np.load(args.path)
    checked = [key for key in res if key in want]
    bad = [key for key in checked if not np.array_equal(want[key].view(np.uint32), res[key].view(np.uint32))]
    for key in bad:
        print("differs:", key, float(np.abs(want[key] - res[key]).max()))
    print(f"{len(checked)} cases checked, {len(bad)} differ")
    raise SystemExit(1 if bad or not checked else 0)


if __name__ == "__main__":
    main()

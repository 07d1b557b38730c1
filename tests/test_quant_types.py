"""The one table of ggml types (format/quant_types.py) agrees with every other statement of the same facts: the C
enums, block structs and activation mapping of native/simd (read from its sources and asked of the built library),
the type ids, block sizes and kernels of native/cuda_sm20, the gguf package's sizes, and the maps the backends
derive from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridinfer.format import quant
from hybridinfer.format.quant_types import ACT_FORMATS, TYPES, act_of

ROOT = Path(__file__).resolve().parents[1]
SIMD, CUDA = ROOT / "native" / "simd", ROOT / "native" / "cuda_sm20"


def _c(path: Path) -> str:
    """C source without its comments."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", path.read_text(), flags=re.S)


def _enum(text: str, prefix: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(rf"\b{prefix}(\w+)\s*=\s*(-?\d+)", text)}


def test_the_table_is_ggmls():
    for q, t in TYPES.items():
        assert GGMLQuantizationType(q).name == t.name
        assert tuple(GGML_QUANT_SIZES[GGMLQuantizationType(q)]) == (t.block, t.nbytes), t.name
        assert quant.block_info(q) == (t.block, t.nbytes) and quant.type_name(q) == t.name
    assert quant.SUPPORTED_TYPES == frozenset(TYPES)


def test_the_table_matches_native_simd_enums_and_structs():
    internal = _c(SIMD / "hi_internal.h")
    ids = _enum(internal, "HI_T_")
    count = ids.pop("COUNT")
    cpu = {t.name: q for q, t in TYPES.items() if t.act is not None}
    assert ids == cpu, "HI_T_* must be the table's types with an activation format, by ggml id"
    assert count == max(ids.values()) + 1
    acts = _enum(internal, "HI_ACT_")
    assert acts.pop("NONE") == -1
    assert acts == {k.upper(): i for i, k in enumerate(ACT_FORMATS)}
    # hi_act_kind's switch: each weight type's activation format
    body = re.search(r"int hi_act_kind\(int qtype\)\s*\{(.*?)\n\}", _c(SIMD / "hi_cpu.c"), re.S)[1]
    mapped = {}
    for cases, act in re.findall(r"((?:case HI_T_\w+:\s*)+)return HI_ACT_(\w+);", body):
        for name in re.findall(r"HI_T_(\w+)", cases):
            mapped[name] = act
    assert mapped == {t.name: t.act.upper() for t in TYPES.values() if t.act is not None}
    # the block structs' sizes (blocks.h asserts them in C)
    sizes = {m[1]: int(m[2]) for m in re.finditer(r"sizeof\(block_(\w+)\)\s*==\s*(\d+)", _c(SIMD / "blocks.h"))}
    for t in TYPES.values():
        if t.block > 1 and t.act is not None:  # block_q4_0, block_q4_K, ...
            assert sizes[re.sub(r"_k$", "_K", t.kernel_name)] == t.nbytes, t.name
    for a in ACT_FORMATS.values():
        if a.block > 1:
            assert sizes[a.name] == a.nbytes


def test_the_built_library_sizes_rows_as_the_table():
    from hybridinfer.backends.cpu.simd import ACT_KINDS, KERNEL_TYPES, act_kind, act_row_bytes, weight_row_bytes

    assert KERNEL_TYPES == {q: t.act for q, t in TYPES.items() if t.act is not None}
    assert ACT_KINDS == tuple(ACT_FORMATS)
    n = 512
    for q, t in TYPES.items():
        if t.act is None:
            continue
        a = ACT_FORMATS[t.act]
        assert act_kind(q) == t.act == act_of(q)
        assert weight_row_bytes(q, n) == n // t.block * t.nbytes, t.name
        assert act_row_bytes(q, n) == n // a.block * a.nbytes, t.name


def test_the_table_matches_the_gpu_kernels():
    from hybridinfer.backends.gpu import k_elementwise, k_gemm
    from hybridinfer.backends.gpu.ptxas_table import USAGE

    common = _c(CUDA / "common.cuh")
    ids = {m[1]: int(m[2]) for m in re.finditer(r"#define HI_(\w+?)\s+(\d+)\s*$", common, re.M)
           if not m[1].endswith("_BYTES") and m[1] in {t.name for t in TYPES.values()}}
    nbytes = {m[1]: int(m[2]) for m in re.finditer(r"#define HI_(\w+)_BYTES\s+(\d+)", common)}
    for name, q in ids.items():
        assert TYPES[q].name == name
    for name, n in nbytes.items():
        assert next(t for t in TYPES.values() if t.name == name).nbytes == n
    gemm = dict(re.findall(r"^GEMM_TYPE\((\w+), HI_(\w+)\)", _c(CUDA / "gemm.cu"), re.M))
    embed = dict(re.findall(r"^EMBED_KERNEL\((\w+), HI_(\w+)\)", _c(CUDA / "elementwise.cu"), re.M))
    for kernels, flag, derived in ((gemm, "gpu_gemm", k_gemm.GEMM_TYPES), (embed, "gpu_embed",
                                                                            k_elementwise.EMBED_TYPES)):
        want = {t.kernel_name: t.name for t in TYPES.values() if getattr(t, flag)}
        assert kernels == want, flag
        assert set(kernels) <= {n.lower() for n in ids}, "every kernel's type has its HI_ id"
        assert derived == {q: t.kernel_name for q, t in TYPES.items() if getattr(t, flag)}
    for cls, usage in USAGE.items():  # ptxas measured a kernel of every type (at some tile) in each class
        assert {k.split("_b")[0][len("gemm_"):] for k in usage if k.startswith("gemm_")} == set(gemm), cls
        assert {k[len("embed_"):] for k in usage if k.startswith("embed_")} == set(embed), cls
    assert k_gemm._ALIGN == {q: t.gpu_align for q, t in TYPES.items()}


@pytest.mark.parametrize("q", sorted(TYPES))
def test_the_reference_picks_the_activation_quantizer_from_the_table(q):
    from hybridinfer.backends import actquant

    t = TYPES[q]
    assert actquant.supports(q) == (t.act in ("q8_0", "q8_1"))
    if actquant.supports(q):
        assert actquant.LEGACY[q] == (t.nbytes, t.act)

"""Every ggml type the engine reads, declared once: its block, the activation format a product with it quantizes
its input to, and the kernels each backend has for it.

The rest is derived from TYPES: format/quant.py's block sizes and supported set, the CPU kernel map
(backends/cpu/simd_native.KERNEL_TYPES: every type with an activation format has a native/simd kernel), the GPU
kernel maps (backends/gpu/k_gemm.GEMM_TYPES and _ALIGN, k_elementwise.EMBED_TYPES) and the reference's choice of
activation quantizer (actquant.py). tests/test_quant_types.py checks the table against the C enums and
block sizes of native/simd and native/cuda_sm20 and against the kernels they define.

Adding a type: its row here, its dequantization in quant.py (or quant_k.py), and in each backend that multiplies
it, its kernel (native/simd: HI_T_<NAME>; native/cuda_sm20: HI_<NAME> and GEMM_TYPE / EMBED_KERNEL).
"""

from __future__ import annotations

from dataclasses import dataclass

# ggml type ids (ggml.h `enum ggml_type`)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K = 12, 13, 14
BF16 = 30


@dataclass(frozen=True)
class ActFormat:
    """An activation row format (ggml's vec_dot_type): values per block and bytes per block."""

    name: str
    block: int
    nbytes: int


# in the order of native/simd's HI_ACT_* enum (its values are the indices)
ACT_FORMATS: dict[str, ActFormat] = {a.name: a for a in (
    ActFormat("f32", 1, 4), ActFormat("f16", 1, 2), ActFormat("q8_0", 32, 34), ActFormat("q8_1", 32, 36),
    ActFormat("q8_K", 256, 292))}


@dataclass(frozen=True)
class QuantType:
    """A ggml type. act: the activation format llama.cpp multiplies it with (its vec_dot_type), which is also the
    CPU backend's (native/simd has a kernel for every type with one; None: none). gpu_gemm / gpu_embed: whether
    native/cuda_sm20 has the product (gemm_<kernel name>_*) / the embedding lookup (embed_<kernel name>) for it;
    gpu_align: the device-pointer alignment those kernels' vector loads need. kv: whether a K/V cache may hold it
    (`-ctk`/`-ctv`, CACHE_TYPES below; every backend's attention reads it)."""

    id: int
    name: str
    block: int  # values per block
    nbytes: int  # bytes per block
    act: str | None = None
    gpu_gemm: bool = False
    gpu_embed: bool = False
    gpu_align: int = 2
    kv: bool = False

    @property
    def kernel_name(self) -> str:
        """The type in kernel names (gemm_q4_k_b64_n128, embed_q8_0)."""
        return self.name.lower()


TYPES: dict[int, QuantType] = {t.id: t for t in (
    QuantType(F32, "F32", 1, 4, "f32", gpu_gemm=True, gpu_embed=True, gpu_align=16, kv=True),
    QuantType(F16, "F16", 1, 2, "f16", gpu_gemm=True, gpu_embed=True, gpu_align=16, kv=True),
    QuantType(BF16, "BF16", 1, 2),
    QuantType(Q4_0, "Q4_0", 32, 18, "q8_0", gpu_gemm=True, gpu_embed=True, kv=True),
    QuantType(Q4_1, "Q4_1", 32, 20, "q8_1", gpu_embed=True, gpu_align=4),
    QuantType(Q5_0, "Q5_0", 32, 22, "q8_0"),
    QuantType(Q5_1, "Q5_1", 32, 24, "q8_1"),
    QuantType(Q8_0, "Q8_0", 32, 34, "q8_0", gpu_gemm=True, gpu_embed=True, kv=True),
    QuantType(Q4_K, "Q4_K", 256, 144, "q8_K", gpu_gemm=True, gpu_embed=True, gpu_align=16),
    QuantType(Q5_K, "Q5_K", 256, 176, "q8_K", gpu_gemm=True, gpu_embed=True, gpu_align=16),
    QuantType(Q6_K, "Q6_K", 256, 210, "q8_K", gpu_gemm=True, gpu_embed=True),
)}
assert all(t.act is None or t.act in ACT_FORMATS for t in TYPES.values())


def act_of(qtype: int) -> str | None:
    """The activation format a product with weights of `qtype` quantizes its input to (None: an unknown type or
    one no product kernel reads)."""
    t = TYPES.get(int(qtype))
    return None if t is None else t.act


# K/V cache types of this engine's own (no GGUF holds them, so not in TYPES; ids outside ggml's): rows rotated, then
# per 32 values an fp16 RMS scale and 3- or 4-bit Lloyd-Max codes of a unit Gaussian (native/simd/hi_internal.h,
# docs/numerics.md)
LM3, LM4 = 1003, 1004
LLOYD_MAX = {
    LM3: (-2.1520, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1520),
    LM4: (-2.7326, -2.0690, -1.6181, -1.2562, -0.9424, -0.6568, -0.3881, -0.1284,
          0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
}
CACHE_ONLY: dict[int, QuantType] = {t.id: t for t in (QuantType(LM3, "LM3", 32, 14, kv=True),
                                                      QuantType(LM4, "LM4", 32, 18, kv=True))}

# the K/V cache types by their llama.cpp names (`-ctk q8_0`), ggml's then this engine's
CACHE_TYPES: dict[str, QuantType] = {t.kernel_name: t for t in (*TYPES.values(), *CACHE_ONLY.values()) if t.kv}
CACHE_BY_ID: dict[int, QuantType] = {t.id: t for t in CACHE_TYPES.values()}


def cache_row(t: int, n: int):
    """(numpy dtype, length) of a row of n values kept in K/V cache type t (a ggml id, or lm3 / lm4's): n float32 or
    float16 values, or n / block blocks of a quantized type as bytes; a ValueError for another type or an n that does
    not divide into its blocks."""
    import numpy as np

    qt = CACHE_BY_ID.get(int(t))
    if qt is None:
        raise ValueError(f"ggml type {t} is not a K/V cache type ({', '.join(CACHE_TYPES)})")
    if qt.id in (F32, F16):
        return np.dtype(np.float32 if qt.id == F32 else np.float16), n
    if n % qt.block:
        raise ValueError(f"rows of {n} values do not divide into {qt.kernel_name} blocks of {qt.block}")
    return np.dtype(np.uint8), n // qt.block * qt.nbytes


def cache_type(name) -> QuantType:
    """A K/V cache type by its name (llama.cpp's f32, f16, q8_0, q4_0; this engine's lm3, lm4); a ValueError naming the
    choices otherwise."""
    t = CACHE_TYPES.get(str(name).lower()) if isinstance(name, str) else None
    if t is None:
        raise ValueError(f"K/V cache type {name!r} is not one of {', '.join(CACHE_TYPES)}")
    return t

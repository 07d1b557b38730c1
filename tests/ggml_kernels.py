"""Test helper: llama.cpp's own CPU kernels (libggml-cpu from llama-cpp-python) through ctypes, as an
oracle for activation quantization and quantized dot products."""

from __future__ import annotations

import ctypes
import os

import numpy as np

_VEC_DOT = {2: "q4_0_q8_0", 3: "q4_1_q8_1", 6: "q5_0_q8_0", 7: "q5_1_q8_1", 8: "q8_0_q8_0"}
_ACT = {2: ("q8_0", 34), 3: ("q8_1", 36), 6: ("q8_0", 34), 7: ("q8_1", 36), 8: ("q8_0", 34)}


def load():
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_cpu_init()  # fills the fp16 tables the kernels read
    for name in ("quantize_row_q8_0", "quantize_row_q8_1"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    for v in _VEC_DOT.values():
        f = getattr(lib, f"ggml_vec_dot_{v}")
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def quantize_act(lib, x: np.ndarray, kind: str, ref: bool = False) -> np.ndarray:
    """One row x (D,) float32 -> ggml's Q8_0 / Q8_1 blocks as bytes; ref: quantize_row_q8_*_ref (libggml-base),
    what ggml built without AVX quantizes with."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bb = 34 if kind == "q8_0" else 36
    y = np.zeros(x.size // 32 * bb, np.uint8)
    if ref:
        import llama_cpp

        base = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
        f = getattr(base, f"quantize_row_{kind}_ref")
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    else:
        f = getattr(lib, f"quantize_row_{kind}")
    f(x.ctypes.data, y.ctypes.data, x.size)
    return y


def matvec(lib, raw: np.ndarray, qtype: int, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    """W x with ggml's vec_dot for weight type `qtype` (activations quantized by ggml)."""
    kind, _ = _ACT[qtype]
    y = quantize_act(lib, x, kind)
    raw = np.ascontiguousarray(raw)
    rb = raw.size // rows
    f = getattr(lib, f"ggml_vec_dot_{_VEC_DOT[qtype]}")
    out = np.zeros(rows, np.float32)
    o = np.zeros(1, np.float32)
    for r in range(rows):
        f(cols, o.ctypes.data, 0, raw.ctypes.data + r * rb, 0, y.ctypes.data, 0, 1)
        out[r] = o[0]
    return out

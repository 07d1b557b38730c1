"""The native SIMD library `hybridinfer._simd` as `hybridinfer.backends.cpu.simd` uses it: loading the cffi module, the
ISA levels this CPU runs, the weight types with a kernel and their row sizes, and the argument checks that
`SimdLib`'s methods run on every array before C sees it (dtype, shape, row contiguity; errors name the
argument). The public names are re-exported by `hybridinfer.backends.cpu.simd`, which is the module to import.
"""

from __future__ import annotations

import numpy as np

from ...errors import BackendNotAvailableError, KernelArgumentError, UnsupportedTensorTypeError
from ...format.quant import type_name
from ...format.quant_types import ACT_FORMATS, TYPES

MAX_THREADS = 4096  # the pool size hi_ctx_new (native/simd/hi_ctx.c) refuses beyond

ISAS: tuple[str, ...] = ("scalar", "ssse3", "avx2", "avx512vnni")
ACT_KINDS: tuple[str, ...] = tuple(ACT_FORMATS)  # the C library's HI_ACT_* order
# weight types with a kernel -> activation kind: every type the table (format/quant_types.py) gives one
KERNEL_TYPES: dict[int, str] = {q: t.act for q, t in TYPES.items() if t.act is not None}
# a qtype flag: K-quant rows repacked by SimdLib.repack into the layout of a unit that reads them zipped
KQ_ZIPPED = 0x100
_KQ = tuple(q for q, kind in KERNEL_TYPES.items() if kind == "q8_K")  # the K-quants
# the llama.cpp operation a product stands for: decides the float shape of its K-quant rows (hi_simd.h)
# GGML_DECODE_ROWS: each row as a one-token MUL_MAT whatever the row count (several sequences' decode tokens)
GGML_NONE, GGML_MUL_MAT, GGML_MUL_MAT_ID, GGML_DECODE_ROWS = 0, 1, 2, 3
_FLOAT_DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float16)}
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_I32 = np.dtype(np.int32)

_mod = None


def _native():
    global _mod
    if _mod is None:
        try:
            from ... import _simd
        except ImportError as e:  # pragma: no cover - depends on the build
            raise BackendNotAvailableError(
                "the native SIMD library hybridinfer._simd is not built: `pip install -e .` (or "
                f"`python native/simd/build.py`) builds it ({e})") from e
        _mod = _simd
    return _mod


def supported_isas() -> list[str]:
    """The ISA levels this CPU runs, lowest first (always starts with "scalar")."""
    lib = _native().lib
    return [name for i, name in enumerate(ISAS) if lib.hi_isa_supported(i)]


def best_isa() -> str:
    """The widest ISA level this CPU (and OS) supports."""
    return ISAS[_native().lib.hi_best_isa()]


def _op(ggml_op) -> int:
    if type(ggml_op) is not int or not GGML_NONE <= ggml_op <= GGML_DECODE_ROWS:
        raise ValueError(f"ggml_op must be GGML_NONE, GGML_MUL_MAT, GGML_MUL_MAT_ID or GGML_DECODE_ROWS (0-3), "
                         f"got {ggml_op!r}")
    return ggml_op


def _qtype(qtype) -> int:
    try:
        q = int(qtype)
    except (TypeError, ValueError):
        raise TypeError(f"qtype must be a ggml type id (int), got {qtype!r}") from None
    if base_type(q) not in KERNEL_TYPES:
        names = ", ".join(type_name(t) for t in sorted(KERNEL_TYPES))
        raise UnsupportedTensorTypeError(
            f"ggml type {type_name(q)} (id {q}) has no SIMD kernel (kernels exist for {names})")
    return q


def base_type(qtype: int) -> int:
    """The ggml type of a qtype that may carry KQ_ZIPPED (a flagged type other than a K-quant stays invalid)."""
    b = qtype & ~KQ_ZIPPED
    return b if qtype & KQ_ZIPPED and b in _KQ else qtype


def act_kind(qtype) -> str:
    """The activation format a weight type multiplies: "f32", "f16", "q8_0", "q8_1" or "q8_K"."""
    return KERNEL_TYPES[base_type(_qtype(qtype))]


def act_row_bytes(qtype, n: int) -> int:
    """Bytes of one activation row of `n` values for weight type `qtype`."""
    q = _qtype(qtype)
    r = _native().lib.hi_act_row_bytes(q, int(n))
    if r < 0:
        raise ValueError(f"a row of {n} values is not a whole number of {act_kind(q)} blocks "
                         f"(weight type {type_name(q)})")
    return int(r)


def weight_row_bytes(qtype, n: int) -> int:
    """Bytes of one weight row of `n` values stored as `qtype`."""
    q = _qtype(qtype)
    r = _native().lib.hi_weight_row_bytes(q, int(n))
    if r < 0:
        raise ValueError(f"a {type_name(q)} row of {n} values is not a whole number of blocks")
    return int(r)


_SIZES: dict[tuple[int, int], tuple[int, int, int]] = {}


def _sizes(qtype, cols) -> tuple[int, int, int]:
    """(qtype as int, weight row bytes, activation row bytes) for a (qtype, cols) pair, cached."""
    try:
        return _SIZES[(qtype, cols)]
    except (KeyError, TypeError):
        pass
    q = _qtype(qtype)
    c = int(cols)
    if c < 1:
        raise ValueError(f"cols must be positive, got {cols}")
    r = (q, weight_row_bytes(q, c), act_row_bytes(q, c))
    if len(_SIZES) < 4096:
        _SIZES[(qtype, cols)] = r
    return r


# ------------------------------------------------------------------------------------------------
# argument checks


def _array(name: str, a, dtypes) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {a.dtype}")
    return a


def _rows(name: str, a: np.ndarray, width: int, T: int | None = None, writable: bool = False) -> tuple[int, int]:
    """Check a (T, width) array (or one (width,) row) whose rows are contiguous; returns (T, row stride in
    elements)."""
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is read-only")
    if a.ndim == 1:
        n, stride = 1, width
        if a.shape[0] != width:
            raise ValueError(f"{name} has shape {a.shape}, expected ({width},)")
        if a.strides[0] != a.itemsize:
            raise ValueError(f"{name} is not contiguous (strides {a.strides})")
    elif a.ndim == 2:
        n = a.shape[0]
        if a.shape[1] != width or (T is not None and n != T):
            raise ValueError(f"{name} has shape {a.shape}, expected ({T if T is not None else 'T'}, {width})")
        if n == 0:
            raise ValueError(f"{name} has no rows")
        if a.strides[1] != a.itemsize and width > 1:
            raise ValueError(f"{name} is not C-contiguous within rows (strides {a.strides})")
        stride = a.strides[0] // a.itemsize
        if n > 1 and (a.strides[0] % a.itemsize or stride < width):
            raise ValueError(f"{name} rows overlap or are not contiguous (strides {a.strides})")
        if n == 1:
            stride = width
    else:
        raise ValueError(f"{name} must be 1-D or 2-D, got shape {a.shape}")
    return n, stride


def _rows_fast(name: str, a, dtype: np.dtype, width: int, T: int | None = None,
               writable: bool = False) -> tuple[int, int]:
    """`_rows` with the dtype check, quick for well-formed arrays; the full checks (and their messages) on
    anything unusual."""
    if type(a) is np.ndarray and a.dtype is dtype and (not writable or a.flags.writeable):
        sh, st = a.shape, a.strides
        if len(sh) == 2:
            n = sh[0]
            if sh[1] == width and n and (T is None or n == T) and st[1] == a.itemsize:
                if n == 1:
                    return 1, width
                if st[0] >= width * a.itemsize and st[0] % a.itemsize == 0:
                    return n, st[0] // a.itemsize
        elif len(sh) == 1 and sh[0] == width and st[0] == a.itemsize and T in (None, 1):
            return 1, width
    return _rows(name, _array(name, a, (dtype,)), width, T, writable)


def _ptr(ffi, ctype: str, a: np.ndarray):
    """A C pointer to a's first element (ctype "float *" etc.); from_buffer (fast, keeps a alive for the
    call) for contiguous arrays, the address for row-strided views."""
    if a.flags.c_contiguous:
        return ffi.from_buffer(ctype[:-1] + "[]", a, require_writable=False)
    return ffi.cast(ctype, a.ctypes.data)


def _exact(name: str, a, shape: tuple, writable: bool = False) -> np.ndarray:
    """Check a C-contiguous float32 array of exactly `shape` (writable where asked); returns it."""
    a = _array(name, a, (_F32,))
    if a.shape != tuple(shape):
        raise ValueError(f"{name} has shape {a.shape}, expected {tuple(shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous (strides {a.strides})")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return a


def _vector(op: str, name: str, a, n: int) -> None:
    """Check one contiguous float32 vector of n values (a bias, a norm's weights) for op, naming both."""
    if not (isinstance(a, np.ndarray) and a.dtype == _F32 and a.shape == (n,) and a.flags.c_contiguous):
        raise KernelArgumentError(f"{op}: {name} must be {n} contiguous float32 values, got "
                                  f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")


def _weights(name: str, w, qtype: int, row_bytes: int, rows: int) -> tuple[np.ndarray, int]:
    """Check a weight buffer holding a whole number of `rows`-row matrices; returns (w, number of them)."""
    dtypes = (_U8, np.dtype(np.int8)) + ((_FLOAT_DTYPES[qtype],) if qtype in _FLOAT_DTYPES else ())
    qtype = base_type(qtype)
    w = _array(name, w, dtypes)
    if not w.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous")
    per = rows * row_bytes
    if w.nbytes == 0 or w.nbytes % per:
        raise ValueError(f"{name} has {w.nbytes} bytes, not a whole number of {rows} x {row_bytes}-byte "
                         f"{type_name(qtype)} matrices")
    return w, w.nbytes // per


def _one_matrix(name: str, w, qtype: int, cols: int, rows: int) -> np.ndarray:
    """Check a weight buffer holding exactly one rows x cols matrix of qtype."""
    if rows < 1 or cols < 1:
        raise ValueError(f"{name}: rows and cols must be positive, got {rows} x {cols}")
    w, n = _weights(name, w, qtype, weight_row_bytes(qtype, cols), rows)
    if n != 1:
        raise ValueError(f"{name} holds {n} matrices of {rows} x {cols}, expected one")
    return w


def _one_row(name: str, a, dtype: np.dtype, width: int, writable: bool = False) -> np.ndarray:
    """Check one contiguous row of `width` elements ((width,) or (1, width))."""
    a = _array(name, a, (dtype,))
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1:
        raise ValueError(f"{name} must be one row of shape ({width},), got {a.shape}")
    _rows(name, a, width, writable=writable)
    return a


def _ids(name: str, ids, n_expert: int) -> np.ndarray:
    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer expert ids, got dtype {a.dtype}")
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of expert ids, got shape {a.shape}")
    if a.size > 64:
        raise ValueError(f"{name} selects {a.size} experts, at most 64 are supported")
    if a.dtype != _I32 or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=np.int32)
    bad = (a < 0) | (a >= n_expert)
    if bad.any():
        raise ValueError(f"{name} holds expert id {int(a[bad][0])}, outside [0, {n_expert})")
    return a


def _check_rc(rc: int, what: str) -> None:
    if rc == 0:
        return
    if rc == -3:
        raise MemoryError(f"{what}: out of memory")
    raise ValueError(f"{what}: the native library rejected the arguments (code {rc})")

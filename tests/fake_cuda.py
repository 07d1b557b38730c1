"""pycuda and the vision tower's launchers stood in for by numpy, so the card's forward (backends/gpu/vision.py) runs
here without a card: buffers are numpy arrays filled with NaN (a value read before the forward wrote it, such as
padding left unzeroed, poisons the rows), each launcher's maths as its docstring states it, and the checks a
launcher makes on shapes (a product's rows must be as long as its padded weight rows). It tests the forward's
wiring (which buffer, which view, which padding), not the kernels: the gpu-marked tests do that on a card. Card
contexts are whatever object a test passes: loader.on_card makes one current, and LAUNCHES says which was current at
each product and each buffer made (the context a multi-card tower must run in)."""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np

from hybridinfer.format.quant_types import F16

CURRENT: list = []  # the card contexts loader.on_card has made current, innermost last
LAUNCHES: list = []  # the context current at each product and each buffer made (None: the process's first)


def _where() -> None:
    LAUNCHES.append(CURRENT[-1] if CURRENT else None)


@contextlib.contextmanager
def _on_card(ctx):
    CURRENT.append(ctx)
    try:
        yield
    finally:
        CURRENT.pop()


class _Arr(np.ndarray):
    def get(self):
        return np.array(self)


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def time_since(self, other) -> float:
        return 1.0  # ms


def _gemm(x, w, out=None, tile=None, stream=None, part=None):
    n, k = w.shape
    assert x.ndim == 2 and x.shape[1] == k, f"gemm: rows of {x.shape[1]} against weight rows of {k}"
    assert out.shape == (x.shape[0], n) and not np.shares_memory(out, x)
    _where()
    if part is not None:  # a split's scratch: free at this point, so clobbering it must change nothing downstream
        assert not np.shares_memory(part, x) and not np.shares_memory(part, out)
        part[...] = np.nan
    wf = w.data.view(np.float16 if w.qtype == F16 else np.float32).reshape(n, k).astype(np.float32)
    out[...] = x @ wf.T
    return out


def _layer_norm(x, w, b, eps, out, stream=None):
    d = w.shape[0]
    assert not np.shares_memory(x, out) and x.shape[1] >= d and out.shape[1] >= d
    xd = x[:, :d].astype(np.float64)
    mu = xd.mean(-1, keepdims=True)
    y = ((xd - mu) / np.sqrt(((xd - mu) ** 2).mean(-1, keepdims=True) + eps)).astype(np.float32)
    out[:, :d] = y * w + b
    out[:, d:] = 0
    return out


def _bias_act(x, out, b=None, act="store", n=None, stream=None):
    from hybridinfer.backends.vision import RefVisionOps

    cols = b.shape[0] if b is not None else (n if n is not None else x.shape[1])
    assert x.shape[0] == out.shape[0] and cols <= min(x.shape[1], out.shape[1])
    v = np.array(x[:, :cols]) + (b if b is not None else np.float32(0))
    if act in ("gelu_tanh", "gelu_erf"):
        v = getattr(RefVisionOps, act)(None, v)
    if act == "add":
        out[:, :cols] += v
    else:
        out[:, :cols] = v
        out[:, cols:] = 0
    return out


def _rope_split(y, b, cos, sin, out, stream=None):
    from hybridinfer.models.qwen3vl_vision import rotate

    _, t, h, hd = out.shape
    v = (y + b).reshape(t, 3, h, hd)
    out[0], out[1], out[2] = rotate(v[:, 0], cos, sin), rotate(v[:, 1], cos, sin), v[:, 2]
    return out


def _attention_full(q, k, v, out, scale, stream=None):
    assert not np.shares_memory(out, q)
    sc = np.einsum("thd,shd->hts", q, k) * np.float32(scale)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[...] = np.einsum("hts,shd->thd", p, v)


def _put(flat, host, offset=0):
    host = np.ascontiguousarray(host, dtype=np.float32)
    v = flat[offset:offset + host.size].reshape(host.shape)
    v[...] = host
    return v


def install(monkeypatch) -> None:
    """pycuda's modules and the launchers the tower calls replaced for the test (monkeypatch undoes it)."""
    from hybridinfer.backends.gpu import k_attention, k_elementwise, k_gemm, loader
    from hybridinfer.backends.gpu import vision as gv

    def empty(shape, dtype):
        _where()
        return np.full(shape, np.nan, dtype).view(_Arr)

    def to_gpu(a):
        _where()
        return np.array(a)

    CURRENT.clear()
    LAUNCHES.clear()
    gpuarray = types.SimpleNamespace(empty=empty, to_gpu=to_gpu)
    driver = types.SimpleNamespace(Event=_Event, Context=types.SimpleNamespace(synchronize=lambda: None))
    pkg = types.ModuleType("pycuda")
    pkg.gpuarray, pkg.driver = gpuarray, driver
    for name, mod in (("pycuda", pkg), ("pycuda.gpuarray", gpuarray), ("pycuda.driver", driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(loader, "init", lambda device=0: None)
    monkeypatch.setattr(loader, "on_this_thread", contextlib.nullcontext)
    monkeypatch.setattr(loader, "on_card", _on_card)
    monkeypatch.setattr(k_gemm, "gemm", _gemm)
    monkeypatch.setattr(k_gemm, "pick_tile", lambda *a, **k: (16, 128))
    monkeypatch.setattr(k_elementwise, "layer_norm", _layer_norm)
    monkeypatch.setattr(k_elementwise, "bias_act", _bias_act)
    monkeypatch.setattr(k_elementwise, "rope_split", _rope_split)
    monkeypatch.setattr(k_attention, "attention_full", _attention_full)
    monkeypatch.setattr(gv, "_put", _put)

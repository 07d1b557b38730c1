"""The loader's CPU-side parts: where kernel sources are found (source tree or the copy a wheel ships), and that
setup.py's build step puts every kernel source into the package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridinfer.backends.gpu import loader
from hybridinfer.errors import BackendNotAvailableError

ROOT = Path(__file__).resolve().parents[1]


def test_source_dir_prefers_the_tree_then_the_packaged_copy(monkeypatch, tmp_path):
    assert loader.source_dir() == ROOT / "native" / "cuda_sm20"
    pkg = tmp_path / "_cuda_sm20"
    pkg.mkdir()
    (pkg / "gemm.cu").write_text("// x\n")
    monkeypatch.setattr(loader, "SRC_DIR", tmp_path / "missing")
    monkeypatch.setattr(loader, "PKG_SRC_DIR", pkg)
    assert loader.source_dir() == pkg
    monkeypatch.setattr(loader, "PKG_SRC_DIR", tmp_path / "also-missing")
    with pytest.raises(BackendNotAvailableError, match="kernel sources not found"):
        loader.source_dir()


def test_build_py_ships_the_kernel_sources(tmp_path):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    shipped = {p.name for p in (tmp_path / "hybridinfer" / "_cuda_sm20").iterdir()}
    want = {p.name for p in (ROOT / "native" / "cuda_sm20").glob("*.cu*")}
    assert want and shipped == want


def test_gpu_backend_knows_when_its_copy_of_the_state_is_stale():
    """The card's copy is reused only for the very state object it wrote, at the same position and tokens; a
    new state (even one reusing a freed object's id), CPU decode or a restore makes it upload again."""
    import weakref

    import numpy as np

    from hybridinfer.backends.gpu.backend import GPUModel
    from hybridinfer.backends.gpu.walker import tokens_hash
    from hybridinfer.backends.state import DecoderState

    m = GPUModel.__new__(GPUModel)  # no card needed for the bookkeeping
    m._owner = None
    st = DecoderState(n_ctx=8, layer_types=("gdn",), tokens=np.zeros(8, np.int32), pos=3)
    st.tokens[:3] = [5, 6, 7]
    assert not m._holds(st)
    m._owner = (weakref.ref(st), st.pos, tokens_hash(st))
    assert m._holds(st)
    other = DecoderState(n_ctx=8, layer_types=("gdn",), tokens=st.tokens.copy(), pos=3)
    assert not m._holds(other)
    st.tokens[3], st.pos = 9, 4  # a CPU decode step
    assert not m._holds(st)
    st.pos = 3
    st.tokens[1] = 1  # restored to another prefix of the same length
    assert not m._holds(st)

"""The op registry (models/graph.OPS) is complete: every op has a test case and family file, a method on every
backend's ops class, and every piece it names exists; every architecture's description uses only registered ops."""

from __future__ import annotations

import ast
import importlib
import inspect
import os

import pytest
from backend_ops import CASES, OPS_CLASSES

import hybridinfer
from hybridinfer.models import ARCHITECTURES
from hybridinfer.models.graph import OPS, Ops

HERE = os.path.dirname(__file__)


def _resolve(ref: str):
    mod, _, attr = ref.partition(":")
    obj = importlib.import_module(f"hybridinfer.backends.{mod}")
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_op_has_cases_and_a_family_file():
    assert set(CASES) == set(OPS)
    for op, info in OPS.items():
        assert CASES[op], op
        assert os.path.exists(os.path.join(HERE, f"test_ops_{info.family}.py")), (op, info.family)


def test_the_vocabulary_protocol_lists_the_registered_ops():
    protocol = {n for n, _ in inspect.getmembers(Ops, inspect.isfunction) if not n.startswith("_")}
    assert protocol == set(OPS)


# ids by class name: a test id containing "gpu" would be skipped without a card (conftest), and this runs anywhere
@pytest.mark.parametrize("backend", sorted(OPS_CLASSES), ids=lambda b: OPS_CLASSES[b].split(":")[1])
def test_every_backend_implements_every_op(backend):
    mod, _, cls = OPS_CLASSES[backend].partition(":")
    src = os.path.join(os.path.dirname(hybridinfer.__file__), *mod.split(".")[1:]) + ".py"
    # read, not imported: the GPU ops import pycuda only when used, but this check runs everywhere
    tree = ast.parse(open(src).read())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    methods = {n.name for n in klass.body if isinstance(n, ast.FunctionDef)}
    missing = set(OPS) - methods
    assert not missing, (backend, missing)


def test_every_registered_piece_exists():
    from hybridinfer.backends.cpu.simd import SimdLib

    for op, info in OPS.items():
        for ref in info.reference:
            assert callable(_resolve(ref)), (op, ref)
        for name in info.cpu:
            assert callable(getattr(SimdLib, name)), (op, name)
        for ref in info.gpu:  # the launcher modules import pycuda lazily: their functions resolve without a card
            assert callable(_resolve(ref)), (op, ref)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_descriptions_use_registered_ops_only(arch):
    tree = ast.parse(inspect.getsource(ARCHITECTURES[arch]))
    used = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "ops"}
    assert used and used <= set(OPS), (arch, used - set(OPS))

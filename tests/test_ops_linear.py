"""The linear ops (models/graph.OPS, family "linear") on every backend against the reference (backend_ops.py)."""

from __future__ import annotations

import pytest
from backend_ops import CASES, backend_params, run_case

from hybridinfer.models.graph import OPS

CACHE: dict = {}
OPS_HERE = [(op, j) for op, info in OPS.items() if info.family == "linear" for j in range(len(CASES[op]))]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("op,case", OPS_HERE, ids=[f"{op}-{j}" for op, j in OPS_HERE])
def test_op_matches_reference(op, case, backend, oracle_gguf):
    run_case(op, CASES[op][case], backend, oracle_gguf, CACHE)

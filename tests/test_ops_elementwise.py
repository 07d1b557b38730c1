"""The elementwise ops (models/graph.OPS, family "elementwise") on every backend against the reference
(backend_ops.py)."""

from __future__ import annotations

from backend_ops import family_test

test_op_matches_reference = family_test("elementwise")

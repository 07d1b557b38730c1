"""The attention ops (models/graph.OPS, family "attention") on every backend against the reference (backend_ops.py)."""

from __future__ import annotations

from backend_ops import family_test

test_op_matches_reference = family_test("attention")

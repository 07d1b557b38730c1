"""Benchmarks behind `hybridinfer bench ...` and bench/*.py: each returns a dict, a markdown table and a plot."""

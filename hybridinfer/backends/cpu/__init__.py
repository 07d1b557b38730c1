"""CPU decode backend: quantized matrix products in C (simd.py), every other op in numba (ops*.py)."""

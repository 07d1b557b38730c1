"""Test oracles: plain-order and ggml-order references, the HF -> GGUF converter and the plain sampler that the
runtime package (hybridinfer/) is tested against. Importable from tests as `oracles.*` (tests/conftest.py puts
tests/ on sys.path); nothing under hybridinfer/ imports them (tests/test_layout.py checks)."""

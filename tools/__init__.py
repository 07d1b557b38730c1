"""Developer tools that run from the repository root (`python -m tools.sm20check ...`), not part of the installed
package: the sm_20 PTX scanner (sm20check) and the ptxas register/spill check (ptxcheck). tests/test_sm20.py,
tests/test_ptxas.py and bench/ptxas_report.py use them; hybridinfer/ imports neither."""

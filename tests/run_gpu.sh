#!/usr/bin/env bash
# The gpu-marked tests on the GPU machine (CUDA, Python 3.12, no package index), run through the device tool from the
# checkout's root with .whl (that host's wheels and the env.sh that installs them, staged into the checkout
# beforehand), .devcache/oracle (the oracle models, made here by tests/oracle_models.make_oracle_gguf: that machine
# has no llama.cpp quantizer) and hybridinfer/_simd.abi3.so (the native library, built here; abi3, so Python 3.12
# loads it) carried. Extra arguments go to pytest.
set -eu
source .whl/env.sh
export HYBRIDINFER_ORACLE_CACHE=$PWD/.devcache/oracle
[ -f hybridinfer/_simd.abi3.so ] || python3 setup.py -q build_ext --inplace
# the server tests need fastapi, which that machine lacks (none of them is gpu-marked)
python3 -m pytest -q -ra -p no:cacheprovider -m gpu --ignore-glob="tests/test_serve*" tests "$@"

#!/usr/bin/env bash
# The decode benchmark of issue 3 on the GPU machine's host CPU (run there through the device tool, with .whl and
# .llamabin carried: llama-bench built here from llama-cpp-python's sdist, -DGGML_NATIVE=OFF, one AVX-512 VNNI build
# and one SSE4.2-only build). Synthesizes the 35B-A3B Q4_K_M there (21 GB, too big to bring) and writes the tables
# to $OUT. WEIGHTS=copy,mmap times both weight placements; LLAMA_NO_MMAP=1 adds llama.cpp with -lm none; N tokens
# (default 32) are timed in SEGMENTS runs (default 8) with a bandwidth reading between each. MIX=issue synthesizes the
# type mix issue 3 describes instead of the one llama.cpp's quantizer gives a 256-expert model (its n_expert == 8
# rules: Q8_0 GDN qkv and attention k/v, Q5_K attention output), through llama-quantize's --tensor-type overrides.
set -eu
source .whl/env.sh
python3 native/simd/build.py > /dev/null
M=/tmp/m35${MIX:+_$MIX}.gguf
TT=""
[ "${MIX:-}" = issue ] && TT="--tensor-type attn_qkv=q8_0 --tensor-type attn_k=q8_0 --tensor-type attn_v=q8_0 --tensor-type attn_output=q5_k"
[ -f $M ] || python3 -m hybridinfer synth --arch qwen35moe --shape 35b-a3b --quant q4_k_m --seed 1 $TT -o $M
for t in ${THREADS:-16 8}; do
  python3 -m hybridinfer bench decode -m $M -t $t -n ${N:-32} --isa ${ISAS:-native,ssse3} --weights ${WEIGHTS:-auto} \
    --segments ${SEGMENTS:-8} ${LLAMA_NO_MMAP:+--llama-no-mmap} --llama-bench .llamabin/llama-bench-avx512 --llama-bench-sse .llamabin/llama-bench-sse --out-dir "${OUT:-bench/results}"
done

#!/usr/bin/env bash
# The prefill benchmark of issue 5 on the GPU machine (run through the device tool with .whl and .llamabin carried:
# .llamabin/llama-bench-avx512 (CPU build) and llama-bench-cuda.xz (CUDA build, sm_90, linked to the host's
# cuBLAS from its Python packages), both built here from llama-cpp-python 0.3.36's sdist). Synthesizes the
# 35B-A3B Q4_K_M there (21 GB) and writes the tables to $OUT.
set -eu
source .whl/env.sh
M=/tmp/m35.gguf
[ -f $M ] || python3 -m hybridinfer synth --arch qwen35moe --shape 35b-a3b --quant q4_k_m --seed 1 -o $M > /dev/null
CUDA_BENCH=
if [ -f .llamabin/llama-bench-cuda.xz ]; then
  xz -dc .llamabin/llama-bench-cuda.xz > /tmp/llama-bench-cuda && chmod +x /tmp/llama-bench-cuda
  libs=$(python3 - <<'PY'
import os, nvidia
print(":".join(r for p in nvidia.__path__ for r, _, _ in os.walk(p) if r.endswith("/lib")))
PY
)
  export LD_LIBRARY_PATH="$libs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  CUDA_BENCH=/tmp/llama-bench-cuda
fi
python3 -m hybridinfer bench prefill -m $M -t ${THREADS:-16} --prompts ${PROMPTS:-128,947,4096} \
  --vram-budget ${BUDGET:-6GiB} --llama-bench .llamabin/llama-bench-avx512 ${CUDA_BENCH:+--llama-bench-cuda $CUDA_BENCH} \
  --out-dir "${OUT:-bench/results}"

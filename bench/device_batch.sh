#!/usr/bin/env bash
# The multi-sequence decode benchmark of issue 20 on the GPU machine's host CPU (through the device tool, with .whl and
# .llamabin carried: llama-batched-bench and llama-bench built here from llama-cpp-python 0.3.36's sdist,
# -DGGML_NATIVE=OFF with AVX-512 VNNI, no AMX, and llama-bench-sse built the same with only SSE4.2). Synthesizes the
# model named by MODEL (9b: the dense Qwen3.5 9B, 35b-a3b: the MoE) in Q4_K_M there and writes the table, JSON and
# PNG to $OUT: batched decode against llama-batched-bench, then CPU prefill of PREFILL tokens against llama-bench.
set -eu
source .whl/env.sh
[ -f hybridinfer/_simd.abi3.so ] || python3 setup.py -q build_ext --inplace
MODEL=${MODEL:-9b}
ARCH=qwen35; [ "$MODEL" = 35b-a3b ] && ARCH=qwen35moe
M=/tmp/m-$MODEL.gguf
t0=$(date +%s)
[ -f $M ] || python3 -m hybridinfer synth --arch $ARCH --shape $MODEL --quant q4_k_m --seed 1 -o $M > /dev/null
echo "synth $MODEL: $(( $(date +%s) - t0 )) s"
python3 -m hybridinfer bench batch -m $M -t ${THREADS:-16} --batch-sizes ${SIZES:-1,2,4,8,16} --steps ${STEPS:-16} \
  --prompt-len ${PROMPT_LEN:-32} --llama-batched-bench .llamabin/llama-batched-bench \
  --prefill-tokens ${PREFILL:-512} --llama-bench .llamabin/llama-bench --llama-bench-sse .llamabin/llama-bench-sse \
  --out-dir "${OUT:-bench/results}"

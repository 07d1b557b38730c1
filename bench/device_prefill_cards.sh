#!/usr/bin/env bash
# bench prefill over several cards (issue 34) on the GPU machine (run through the device tool with .whl carried):
# the 35B-A3B Q4_K_M synthesized there (21 GB), prompts of 947 and 4,096 tokens with --card-profile fermi, on the
# first device alone and over DEVICES (default 0,1; 0,0 on a one-GPU host: two contexts on one card), each card
# under the same --vram-budget (default 5GiB, a Fermi card's). Writes the tables to $OUT.
set -eu
source .whl/env.sh
M=/tmp/m35.gguf
[ -f $M ] || python3 -m hybridinfer synth --arch qwen35moe --shape 35b-a3b --quant q4_k_m --seed 1 -o $M > /dev/null
python3 -m hybridinfer bench prefill -m $M -t ${THREADS:-16} --prompts ${PROMPTS:-947,4096} --card-profile fermi \
  --vram-budget ${BUDGET:-5GiB} --no-resident --devices ${DEVICES:-0,1} --out-dir "${OUT:-bench/results}"

#!/usr/bin/env bash
# Issue 34 part A on the GPU machine's host CPU: decode with the routed experts read from the GGUF under RAM budgets
# (run there through the device tool, with .whl and .llamabin carried as for device_decode.sh). Synthesizes the
# 35B-A3B Q4_K_M there (21 GB; SHAPE=122b-a10b for the ~70 GB one, which needs the 128 GiB disk of a larger kind)
# and writes the tables to $OUT. BUDGETS (default 6GiB,10GiB,16GiB), IO (default pread,direct), N tokens timed
# (default 32); llama-bench runs under each budget's memory limit (cgroup v2 memory.max, else systemd-run, else with
# FILL=1 the host's memory filled until the limit is left: --llama-fill-memory).
set -eu
source .whl/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -f hybridinfer/_simd.abi3.so ] || python3 setup.py -q build_ext --inplace
S=${SHAPE:-35b-a3b}
B=${BUDGETS:-6GiB,10GiB,16GiB}
M=/tmp/m${S}.gguf
[ -f $M ] || python3 -m hybridinfer synth --arch qwen35moe --shape $S --quant q4_k_m --seed 1 --no-mtp -o $M
python3 -m hybridinfer plan -m $M --card k40 --host-bw 100 --ram-budget ${B%%,*} | tail -1
python3 -m hybridinfer bench disk -m $M -t ${THREADS:-16} -n ${N:-32} --ram-budgets $B \
  --expert-io ${IO:-pread,direct} --llama-timeout ${LLAMA_TIMEOUT:-180} --llama-bench .llamabin/llama-bench ${FILL:+--llama-fill-memory} --out-dir "${OUT:-bench/results}"

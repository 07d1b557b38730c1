#!/usr/bin/env bash
# Issue 32's targets on the GPU machine's host CPU (through the device tool, with .whl, .llamabin/llama-server and
# hybridinfer/_simd.abi3.so carried): synthesizes the 35B-A3B and 9B shapes with their MTP block, then runs
# `bench spec` on each with llama-server's draft-mtp beside it. Tables, JSON, PNG to $OUT.
set -eu
source .whl/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
O=${OUT:-bench/results}
for shape in ${SHAPES:-35b-a3b 9b}; do
  arch=qwen35; [ "${shape#*-a}" != "$shape" ] && arch=qwen35moe
  M=/tmp/spec-$shape.gguf
  [ -f $M ] || python3 -m hybridinfer synth --arch $arch --shape $shape --quant q4_k_m --seed 1 -o $M > /dev/null
  python3 -m hybridinfer bench spec -m $M -t ${THREADS:-16} -n ${N:-48} -p 128 --draft-max ${KS:-1,2,3} \
    --acceptance ${ACC:-0,0.7,1} -r ${REPS:-2} --llama-server .llamabin/llama-server --out-dir $O
done

#!/usr/bin/env bash
# Full-depth faithfulness (issue 23 item 6) on the GPU machine, through the device tool with .whl and the static
# llama.cpp teacher-forcing program (bench/llama_teacher_forced.cpp, built here against llama-cpp-python 0.3.36's
# llama.cpp, AVX-512, as .llamabin/llama-teacher-forced) carried. Synthesizes the depth-scaled model named by MODEL
# (default 35b-a3b, Q4_K_M, `--residual-scale auto`) and scores N fixed tokens with the CPU backend, GPU prefill then
# CPU decode, llama.cpp in one batch and llama.cpp token by token; the pairwise table goes to stdout and $OUT.
set -eu
source .whl/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -f hybridinfer/_simd.abi3.so ] || python3 setup.py -q build_ext --inplace
MODEL=${MODEL:-35b-a3b}
ARCH=qwen35; [ "$MODEL" = 35b-a3b ] && ARCH=qwen35moe
RS=${RESIDUAL_SCALE:-auto}  # none: the plain random file, for contrast
M=/tmp/synth-$MODEL-$RS.gguf
FLAG="--residual-scale $RS"; [ "$RS" = none ] && FLAG=""
LTF=${LTF:-.llamabin/llama-teacher-forced}
t0=$(date +%s)
[ -f $M ] || python3 -m hybridinfer synth --arch $ARCH --shape "$MODEL" --quant q4_k_m --seed 1 \
  $FLAG -o $M > /dev/null
echo "synth $MODEL: $(( $(date +%s) - t0 )) s"
python3 bench/faithful_depth.py -m $M --llama-tf $LTF -n ${N:-64} --prefill ${PREFILL:-32} ${EXTRA:-} \
  --out "${OUT:-bench/results}"

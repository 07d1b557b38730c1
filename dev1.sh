set -u
source .whl/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlpil/*.whl 2>&1 | tail -1
lscpu | grep -E "Model name|^CPU\(s\)"
M=/tmp/m35.gguf
t0=$(date +%s)
python3 -m hybridinfer synth --arch qwen35moe --shape 35b-a3b --quant q4_k_m --seed 1 -o $M > /dev/null
echo "synth: $(( $(date +%s) - t0 )) s"
timeout 150 python3 bench/expert_exchange_probe.py $M 2>&1 | tail -12
echo "probe done $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m hybridinfer bench prefill -m $M -t 16 --prompts 947,4096 --card-profile fermi \
  --vram-budget 5GiB --no-resident --devices 0,1 --split-mode expert --out-dir $OUT 2>&1 | grep -E "^\| hybridinfer|^- " | head -12
echo "bench done $(( $(date +%s) - t0 )) s"
for s in "4304 1152" "1152 4320" "3456 1152" "1152 1152"; do set -- $s
  timeout 60 python3 bench/gpu_gemm_probe.py --T 784 --N $1 --K $2 --types F16 --also-T "" --card-profile fermi --no-moe --tiles all --reps 10 2>&1 | grep -E "gemm|default" | tail -3
done
echo "gemm done $(( $(date +%s) - t0 )) s"
timeout 240 python3 -m hybridinfer bench vision --synth -t 16 -r 3 --llama-mtmd-cli .llamabin/llama-mtmd-cli --out-dir $OUT 2>&1 | tail -8
echo "all done $(( $(date +%s) - t0 )) s"

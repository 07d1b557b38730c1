#!/usr/bin/env bash
# The serving benchmark of issue 21 on the GPU machine's host CPU (through the device tool, with .whl, .whlserve
# (fastapi, uvicorn, sse-starlette, openai and their dependencies for Python 3.12), .llamabin/llama-server (built
# here from llama-cpp-python 0.3.36's sdist, -DGGML_NATIVE=OFF, AVX-512 VNNI, no AMX), .devcache/vocab and
# hybridinfer/_simd.abi3.so carried). Synthesizes the 0.8B-shape Qwen3.5 in Q4_K_M with SmolLM2's vocabulary there
# (--quiet-pads: the padding up to Qwen's vocabulary size never wins, so every streamed token is text and the client's
# inter-token latency is per token, as with a trained model; without it most tokens are padding, no text, and deltas
# merge several tokens for both servers),
# then runs `bench serve` against llama-server, both servers rendering bench/qwen35_chat_template.jinja: chat at 1, 4
# and 16 clients with the agent workload sharing one system prompt and tool list (prompt tokens re-processed), then
# (AGENT2=1) the agent workload with one system prompt per conversation, whose first turns all start cold together
# (TTFT of cold and cached requests under the same load). Tables, JSON, PNG to $OUT (serve-*.md/json/png, agent2/).
set -eu
source .whl/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlserve/*.whl
[ -f hybridinfer/_simd.abi3.so ] || python3 setup.py -q build_ext --inplace
M=/tmp/q08q.gguf
[ -f $M ] || python3 -m hybridinfer synth --arch qwen35 --shape 0.8b --quant q4_k_m --seed 1 --quiet-pads \
  --vocab-from .devcache/vocab/smol_vocab.gguf -o $M > /dev/null
run() {
  python3 -m hybridinfer bench serve -m $M -t ${THREADS:-16} --max-seqs ${SEQS:-16} --max-tokens ${MAX_TOKENS:-64} \
    --conversations ${CONVS:-10} --turns ${TURNS:-5} --system-tokens 2000 \
    --chat-template-file bench/qwen35_chat_template.jinja --llama-server .llamabin/llama-server \
    --prefix-cache-ram ${CACHE:-4GiB} "$@"
}
O=${OUT:-bench/results}
run --concurrency ${CONC:-1,4,16} --requests ${REQUESTS:-4} --shared-system --out-dir $O
[ "${AGENT2:-1}" = 1 ] && run --concurrency 16 --requests 1 --out-dir $O/agent2

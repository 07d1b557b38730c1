"""HTTP serving: streaming clients' time to first token, inter-token latency and tok/s at 1, 4 and 16 clients,
and an agent workload's prefix reuse (10 conversations x 5 turns on a ~2,000-token system prompt with tools), with
llama.cpp's llama-server on the same GGUF in the same run.

    python bench/serve.py -m model.gguf -t 16 [--max-seqs 16] [--llama-server PATH] [--concurrency 1,4,16]
                          [--requests 4] [--conversations 10] [--turns 5]

Prints a markdown table and writes bench/results/serve-<name>-t<threads>.{json,png}.
"""

import sys

from hybridinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))

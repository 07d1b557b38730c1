"""A batch job end to end: 200 requests sharing a 2,000-token system prompt, each with a 30-100-token question and up
to 64 output tokens, through `hybridinfer batch` (one request at a time, the scheduler, 2 shards at once, each
--numa policy) and llama.cpp's llama-server (-np 8, prompt cache on) fed the same requests by an async client, on
the same GGUF and threads in the same run.

    python bench/batch.py -m model.gguf -t 16 [--requests 200] [--system-tokens 2000] [--max-tokens 64]
                          [--max-seqs 8] [--llama-server PATH] [--numa-policies off,interleave,bind:0,replicate,auto]

Prints a markdown table and writes bench/results/batch-job-<name>-t<threads>.{json,png}.
"""

import sys

from hybridinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "batch-job", *sys.argv[1:]]))

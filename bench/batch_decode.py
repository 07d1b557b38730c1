"""Batched decode (one token for each of B sequences per step) tok/s against B, with llama.cpp's
llama-batched-bench in the same run.

    python bench/batch_decode.py -m model.gguf -t 16 [--batch-sizes 1,2,4,8,16] [--steps 32]
                                 [--llama-batched-bench PATH]

Prints a markdown table and writes bench/results/batch-<name>-t<threads>.{json,png}.
"""

import sys

from hybridinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "batch", *sys.argv[1:]]))

"""Prefix reuse: time to first token cold and warm, re-processed tokens and snapshot bytes, with llama.cpp's
server on the same GGUF in the same run.

    python bench/prefix_reuse.py -m model.gguf -t 16 [--llama-server PATH] [--cache-dir DIR] [--n-prompts 100]

Prints a markdown table and writes bench/results/prefix-<name>.{json,png}.
"""

import sys

from hybridinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "prefix", *sys.argv[1:]]))

"""Decode tok/s vs the memory-bandwidth floor, with llama.cpp in the same run.

    python bench/decode.py -m model.gguf -t 16 [--isa native,ssse3] [--llama-bench PATH] [--llama-bench-sse PATH]

Prints a markdown table and writes bench/results/decode-<name>.{json,png}.
"""

import sys

from hybridinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))

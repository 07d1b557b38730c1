"""GPU prefill: tok/s under a VRAM budget and resident, time split, H2D GB/s vs pinned bandwidth, GEMM FLOP/s vs
the measured fp32 FMA peak, and llama.cpp (CPU-only and CUDA) in the same run.

    python bench/prefill.py -m model.gguf [--vram-budget 6GiB] [--prompts 128,947,4096] [--llama-bench PATH]
                            [--llama-bench-cuda PATH]

Prints a markdown table and writes bench/results/prefill-<name>.{json,png}.
"""

import sys

from hybridinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "prefill", *sys.argv[1:]]))

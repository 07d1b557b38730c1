"""Where a pass of the expert split spends its time, card by card (issue 34): the host seconds waiting for the
card's own work up to each exchange (and for its uploads of earlier partials), and for the other card, beside the
weights' copy time (the partials' uploads share the card's paced bus with the weights: CardLink). Run on a
two-GPU host: python3 bench/expert_exchange_probe.py MODEL.gguf (the 35B-A3B synth, fermi profile, 5 GiB a
card, 947 and 4,096 tokens)."""
import json
import sys

import numpy as np

from hybridinfer.backends.gpu.multi_gpu import open_cards
from hybridinfer.format.gguf_model import GGUFModel
from hybridinfer.models import model_args

gm = GGUFModel(sys.argv[1])
args = model_args(gm)
m = open_cards(gm, args, 4104, [0, 1], split_mode="expert", vram_budget=5 << 30, card_profile="fermi")
for c in m.cards:
    p = c.m.placement
    print("card", c.device, "own", c.m.own, "resident GiB", p.resident_bytes / 2**30,
          "stream GiB", p.stream_bytes_per_pass / 2**30, file=sys.stderr)
for T in (947, 4096):
    ids = [int(x) for x in np.random.default_rng(0).integers(0, args.n_vocab, T)]
    for _ in range(2):
        m.forward(ids, m.new_state(4104), all_logits=False)
    t = m.last_timing
    print(T, json.dumps({k: v for k, v in t.items() if k != "cards"}, default=str))
    for c in t["cards"]:
        print("  ", json.dumps(c, default=lambda x: round(x, 4) if isinstance(x, float) else str(x)))
m.close()

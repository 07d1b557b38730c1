"""`bench prefill --devices 0,1`: prefill on one card and on several (gpu/multi_gpu.py), each card under the same
budget and card profile; rows for the prefill benchmark's table (prefill.Row). The bytes each card streamed are
checked against its placement's count once a micro-batch (`counts_agree`); FLOPs are the engine's count over
every card and micro-batch (the head runs on each micro-batch's last row). Bus and FLOP/s columns sum the cards'
(each card's bytes over its own copy stream's busy time; FLOPs over the slowest card's compute span) against the
cards' summed bus rate and FMA peak; the floor is the slowest card's (`cards_floor`); VRAM is what the cards
allocated."""

from __future__ import annotations

import gc
import time

import numpy as np

from .prefill import Row, card_figures


def run_cards(path: str, prompts, devices: list[int], budget: int | None, card_profile: str | None = None,
              bus_bw: float | None = None, kv_stream: bool | None = None, seed: int = 0, split_modes=("auto",),
              bw: float = 6e9, peak: float = 1e13):
    """Rows of 1 card (devices[0]) and of all `devices` in each of `split_modes` (multi_gpu.open_cards's) for each
    prompt length; and one info dict a config. bw, peak: a card's bus rate and FMA peak (bytes/s, FLOP/s)."""
    from ...backends.gpu.backend import GPUModel
    from ...backends.gpu.multi_gpu import open_cards
    from ...format.gguf_model import GGUFModel
    from ...models import model_args

    gm = GGUFModel(path)
    args = model_args(gm)
    n_ctx = max(prompts) + 8
    each = f"--vram-budget {budget / 2**30:g}GiB each" if budget else "free memory each"
    rows, infos = [], []
    for devs, mode in [([devices[0]], None)] + [(devices, mode) for mode in split_modes]:
        t0 = time.perf_counter()
        m = (GPUModel(gm, args, n_ctx, vram_budget=budget, device=devs[0], bus_bw=bus_bw, card_profile=card_profile,
                      kv_stream=kv_stream) if mode is None else
             open_cards(gm, args, n_ctx, devs, split_mode=mode, vram_budget=budget, bus_bw=bus_bw,
                        card_profile=card_profile, kv_stream=kv_stream))
        load_s = time.perf_counter() - t0
        split = "" if mode is None else f", split {split_of(m)}" + (" (auto)" if mode == "auto" else "")
        label = f"{len(devs)} GPU(s), --devices {','.join(map(str, devs))}{split}, {each}"
        rng = np.random.default_rng(seed)
        for T in prompts:
            ids = [int(x) for x in rng.integers(0, args.n_vocab, T)]
            for _ in range(2):  # the first pass compiles kernels and warms the caches
                m.forward(ids, m.new_state(n_ctx), all_logits=False)
            t = m.last_timing
            if mode is None:
                want = m.placement.stream_bytes_per_pass
            else:
                want = sum(c.m.placement.stream_bytes_per_pass * c.totals["passes"] for c in m.cards)
            layer = mode is not None and split_of(m) == "layer"
            mb = f", {t['micro_batches']} micro-batches" if layer else ""
            fig = card_figures(t, bw, peak, T * args.n_embd * 4 if layer else 0)
            rows.append(Row("hybridinfer", label + mb,
                            T, T / t["wall_s"], t["wall_s"], t["copy_s"], t["gpu_s"],
                            max(0.0, t["wall_s"] - t["gpu_s"]), vram_peak_gib=m.allocated_bytes / 2**30,
                            flops=t["work"]["flops"], h2d_bytes=t["bytes_h2d"], counts_agree=t["bytes_h2d"] == want,
                            **fig))
        ps = [m.placement] if mode is None else [c.m.placement for c in m.cards]
        infos.append({"config": label, "budget": budget, "load_s": load_s, "allocated_gib": m.allocated_bytes / 2**30,
                      "stream_gib_per_pass": sum(p.stream_bytes_per_pass for p in ps) / 2**30,
                      "resident_gib": sum(p.resident_bytes for p in ps) / 2**30, "phases_s": {}, "host_s": {},
                      "chunk": m.chunk, "layers": [(c.m.first, c.m.end) for c in m.cards] if mode else None,
                      "experts": [c.m.own for c in m.cards] if mode else None})
        if mode is not None:
            m.close()
        del m
        gc.collect()
    return rows, infos


def split_of(m) -> str:
    """"expert" or "layer": how a model over several cards splits the prefill."""
    return "expert" if m.cards and m.cards[0].m.own is not None else "layer"

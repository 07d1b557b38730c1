"""Test oracle: token sampling over one row of logits in plain numpy (float64): penalties, top-k, top-p, min-p,
temperature, draw, in llama.cpp's order. The sampler in use (hybridinfer/engine/sampling.py) is tested against it."""

from __future__ import annotations

import numpy as np

from hybridinfer.engine.sampling import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: np.ndarray | None = None) -> int:
        p = self.p
        x = logits.astype(np.float64, copy=True)
        if history is not None and len(history) and (p.repeat_penalty != 1.0 or p.presence_penalty or
                                                     p.frequency_penalty):
            window = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history
            recent, count = np.unique(window, return_counts=True)
            r = x[recent]
            x[recent] = (np.where(r > 0, r / p.repeat_penalty, r * p.repeat_penalty) - count * p.frequency_penalty
                         - p.presence_penalty)
        if p.temperature == 0.0:
            return int(np.argmax(x))
        cand = np.argsort(-x, kind="stable")
        if p.top_k > 0:
            cand = cand[: p.top_k]
        lg = x[cand]
        prob = np.exp(lg - lg[0])
        prob /= prob.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(prob), p.top_p) + 1)
            cand, lg = cand[:keep], lg[:keep]
            prob = prob[:keep] / prob[:keep].sum()
        if p.min_p > 0.0:
            keep = prob >= p.min_p * prob[0]
            cand, lg = cand[keep], lg[keep]
        z = lg / p.temperature
        w = np.exp(z - z.max())
        w /= w.sum()
        return int(cand[self.rng.choice(len(cand), p=w)])

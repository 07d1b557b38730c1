"""Several prompts in one streamed GPU pass: each layer's weights cross the bus once for all of them.

The pass is the GPU walker's (walker.py), as for one prompt: each prompt's hidden rows sit at its own offset of the
hidden buffer and its K/V at its own rows of the cache; the mixer runs prompt after prompt, each continuing its own
state, and the FFN or MoE over all prompts' rows together. Here: the grouping of prompts into passes that fit the
buffers.
"""

from __future__ import annotations

import numpy as np

from . import loader
from .walker import item


def plan_groups(lengths: list[tuple[int, int]], n_ctx: int, n_rows: int | None = None) -> list[list[int]]:
    """Prompts (p0, T) in order, grouped into passes: in each, the new tokens fit the hidden buffer (n_rows rows,
    default n_ctx) and every prompt's whole K/V (p0 + T rows) fits the cache (n_ctx rows) beside the others'. A
    prompt longer than n_rows goes alone (GPUModel.forward cuts it into passes)."""
    n_rows = n_ctx if n_rows is None else n_rows
    groups: list[list[int]] = []
    rows = kv = 0
    for j, (p0, T) in enumerate(lengths):
        if groups and rows + T <= n_rows and kv + p0 + T <= n_ctx:
            groups[-1].append(j)
            rows, kv = rows + T, kv + p0 + T
        else:
            groups.append([j])
            rows, kv = T, p0 + T
    return groups


def forward_many(m, prompts) -> list[np.ndarray]:
    """Prefill each (ids, state, snapshot_at, on_snapshot) of `prompts` on GPUModel m in as few passes as the buffers
    allow; returns each prompt's last-token logits (1, n_vocab). States advance as one-prompt passes advance them."""
    items = [item(m, ids, st, at, cb) for ids, st, at, cb in prompts]
    out: list = [None] * len(items)
    with loader.on_this_thread():
        for group in plan_groups([(it.state.pos, len(it.ids)) for it in items], m.n_ctx, m.n_rows):
            if len(group) == 1:  # alone: in passes of its own where it is longer than one
                it = items[group[0]]
                out[group[0]] = m._forward(it.ids, it.state, False, it.snapshot_at, it.on_snapshot)
                continue
            for j, lg in zip(group, m.walk_items([items[j] for j in group]), strict=True):
                out[j] = lg
    return out


def in_passes(m, tokens, state, all_logits: bool, snapshot_at=(), on_snapshot=None):
    """A prompt on m (GPUModel, or expert_gpu's model over several cards) in one pass of m.walk_items, or where the
    K/V stream (backend.PassPlan) and it is longer than a pass's rows, in passes of m.n_rows tokens each continuing
    the last (a snapshot asked for where one ends is taken there)."""
    T = len(tokens)
    step = max(1, m.n_rows if state.pos + T > m.n_res else T)
    outs = []
    for r0 in range(0, T, step):
        lg = m.walk_items([item(m, tokens[r0 : r0 + step], state, snapshot_at, on_snapshot)], all_logits)[0]
        outs.append(lg)
        if r0 + step < T and on_snapshot is not None and state.pos in set(snapshot_at):
            on_snapshot(state, lg[-1])
    return np.concatenate(outs, axis=0) if all_logits and len(outs) > 1 else outs[-1]

"""The pipeline of a multi-card prefill: one worker thread a card, each walking its own range of layers over the
prompts' micro-batches in order, the hidden rows handed from one card to the next in host buffers (pinned, on real
cards). Nothing here touches CUDA: a card is anything with `label`, `device`, `host_rows(n, i)` (its i-th output
buffer of n rows) and `run(job, state, rows_in, out)` (multi_gpu.CardRunner on a card; tests use stand-ins).

Each card advances its own view of every sequence's DecoderState (`state_view`): the arrays are the host state's
own (a card writes only the layers it owns, so no two cards write one array) while the position and tokens are the
card's, because card 0 is a micro-batch or more ahead of card 1. The host state's position moves once the last card
is through a prompt.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, replace

import numpy as np

from ...errors import CardFailedError, HybridInferError
from ..state import DecoderState

IN_FLIGHT = 2  # row buffers a card hands on: it may run this many micro-batches ahead of the next card


@dataclass(frozen=True, eq=False)
class Job:
    """One micro-batch: prompt `seq`'s tokens from its position `p0` (relative to the prompt's first), `last`
    where it ends the prompt; all_logits: the last card keeps every row's logits, else the last row's."""

    seq: int
    ids: np.ndarray
    p0: int
    last: bool
    all_logits: bool = False


def micro_batches(lengths: list[int], rows: int) -> list[Job]:
    """Each prompt cut in order into micro-batches of at most `rows` tokens, as even as that allows (a 947-token
    prompt in 4 of 237 and 236 rather than three of 256 and one of 179, so no card waits on a short one)."""
    if rows < 1:
        raise ValueError(f"micro-batch rows must be at least 1, got {rows}")
    out = []
    for j, T in enumerate(lengths):
        n = max(1, -(-T // rows))
        cuts = [T * k // n for k in range(n + 1)]
        for k in range(n):
            out.append(Job(j, np.arange(cuts[k], cuts[k + 1]), cuts[k], k == n - 1))
    return out


def state_view(st: DecoderState) -> DecoderState:
    """A DecoderState sharing `st`'s arrays and image spans (the rows' rotary positions) with a position and tokens
    of its own."""
    return DecoderState(n_ctx=st.n_ctx, layer_types=st.layer_types, pos=st.pos, tokens=st.tokens.copy(),
                        arrays={k: list(v) for k, v in st.arrays.items()}, images=st.images)


class _Stopped(Exception):
    pass


class _Pool:
    """A card's output row buffers: taken before a run, given back once the next card has read them."""

    def __init__(self, bufs, stop: threading.Event):
        self.q: queue.Queue = queue.Queue()
        self.stop = stop
        for b in bufs:
            self.q.put(b)

    def take(self):
        while True:
            try:
                return self.q.get(timeout=0.05)
            except queue.Empty:
                if self.stop.is_set():
                    raise _Stopped from None

    def give(self, b) -> None:
        self.q.put(b)


def run_pipeline(cards, jobs: list[Job], prompts: list[tuple[np.ndarray, DecoderState]], n_rows: int,
                 views=None) -> dict:
    """Run `jobs` (micro_batches of `prompts`, (ids, state) each) through `cards` in order; returns the last card's
    output of each job, by job. views[k][j]: card k's view of prompt j's state (default: new ones). The states
    advance as one pass per prompt advances them; a card's failure is a CardFailedError naming it (device and name),
    raised once every card has stopped."""
    K = len(cards)
    stop = threading.Event()
    if views is None:
        views = [[state_view(st) for _, st in prompts] for _ in cards]
    inbox = [queue.Queue() for _ in cards]
    pools = [_Pool([c.host_rows(n_rows, i) for i in range(IN_FLIGHT)], stop) if k + 1 < K else None
             for k, c in enumerate(cards)]
    results: dict = {}
    errors: list[tuple[int, BaseException]] = []

    def work(k: int) -> None:
        card = cards[k]
        while True:
            got = inbox[k].get()
            if got is None:
                break
            job, rows, src = got
            try:
                if stop.is_set():
                    continue
                ids = prompts[job.seq][0][job.ids]
                out = pools[k].take() if pools[k] is not None else None
                if stop.is_set():  # another card failed while this one waited for a buffer
                    if out is not None:
                        pools[k].give(out)
                    continue
                res = card.run(replace(job, ids=ids), views[k][job.seq], rows, out)
                if k + 1 < K:
                    inbox[k + 1].put((job, res, out))
                else:
                    results[job] = res
            except _Stopped:
                pass
            except BaseException as e:  # noqa: BLE001 (any failure of a card stops the pipeline and is raised)
                errors.append((k, e))
                stop.set()
            finally:
                if src is not None:
                    pools[k - 1].give(src)  # the rows it read: free for the card before
        if k + 1 < K:
            inbox[k + 1].put(None)

    threads = [threading.Thread(target=work, args=(k,), name=f"hybridinfer-card-{k}", daemon=True)
               for k in range(K)]
    for t in threads:
        t.start()
    for job in jobs:
        inbox[0].put((job, None, None))
    inbox[0].put(None)
    for t in threads:
        t.join()
    if errors:
        k, e = min(errors, key=lambda x: x[0])
        c = cards[k]
        if isinstance(e, CardFailedError):
            raise e
        what = e if isinstance(e, HybridInferError) else f"{type(e).__name__}: {e}"
        raise CardFailedError(f"GPU prefill failed on {c.label}: {what}", c.device, getattr(c, "name", None)) from e
    for ids, st in prompts:
        st.tokens[st.pos : st.pos + len(ids)] = ids
        st.pos += len(ids)
    return results

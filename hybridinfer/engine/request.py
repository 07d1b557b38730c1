"""A request as the scheduler takes it, the sampler of its tokens, and the Handle its caller reads."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np

from .sampling import SamplingParams
from .textstream import Generation, TextStream, token_logprobs

_END = object()


@dataclass
class Request:
    """A prompt made into token ids, with everything that decides its tokens."""

    ids: list[int]
    params: SamplingParams
    max_tokens: int
    stops: list[str]
    # chat prompts: where the history (before the generation prompt) and the leading system messages end, the
    # positions a next turn or another conversation shares (an int or a tuple of them)
    turn_boundary: int | tuple[int, ...] | None = None
    # structured output: mask(logits) sets the logits of tokens it forbids next to -inf in place, accept(token)
    # advances it by the sampled token (hybridinfer.serving.protocol.grammar.JsonConstraint)
    constraint: object | None = None
    logprobs: int | None = None  # also record each token's log-probability and this many alternatives
    # with a prefix cache: snapshots at the end of the prompt and of the reply (for a next turn); a batch job's
    # requests have no next turn, so it turns them off (the shared prefixes are still saved)
    keep_ends: bool = True
    cache_salt: str | None = None  # the tenant (an API key's hash) whose prefix-cache snapshots it uses and makes
    # the prompt's images (models/mrope.ImageSpan, by row): their rows take the encoder's rows and their positions
    images: tuple = ()

    @property
    def key_ids(self) -> list[int]:
        """The ids as the prefix cache keys them: an image's rows as its digest's key id (two prompts that differ
        only in an image part where the image starts)."""
        if not self.images:
            return self.ids
        from .prefix.index import with_images

        return with_images(self.ids, self.images).tolist()


class TokenSampler:
    """One sequence's choice of each next token: the request's constraint, the numba sampler (its own rng and
    scratch), logprobs and text."""

    def __init__(self, req: Request, tokenizer, generation: Generation, n_vocab: int):
        from .sampling import SampleScratch, rng_new

        self.req, self.gen = req, generation
        self.text = TextStream(tokenizer, req.stops, generation)
        self.scratch, self.rng = SampleScratch(n_vocab), rng_new(req.params.seed)

    def __call__(self, logits: np.ndarray, state) -> tuple[int, str, bool]:
        """(token, text safe to emit, ended) for the sequence in `state` with these next-token logits (a
        constraint masks them in place). ended: an end-of-generation token, a stop string or max_tokens."""
        from .sampling import choose

        req, p, g = self.req, self.req.params, self.gen
        raw = logits.copy() if req.logprobs is not None and req.constraint is not None else logits
        if req.constraint is not None:
            req.constraint.mask(logits)
        t = choose(logits, p, state.tokens, state.pos, self.rng, self.scratch)
        if req.logprobs is not None and t not in self.text.stop_ids:
            if g.logprobs is None:
                g.logprobs = []
            g.logprobs.append(token_logprobs(raw, t, req.logprobs))
        piece, ended = self.text.push(t)
        if req.constraint is not None and not ended:
            req.constraint.accept(t)
        return t, piece, ended or len(g.tokens) >= req.max_tokens


class Handle:
    """A submitted request: iterate it for its text pieces, `result()` for the whole Generation, `cancel()`."""

    def __init__(self, sched, req: Request):
        self._sched, self.request = sched, req
        self._pieces: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self.generation = Generation("", [], len(req.ids), "length")
        self.error: BaseException | None = None
        self.cancelled = False

    def __iter__(self):
        while True:
            p = self._pieces.get()
            if p is _END:
                break
            yield p
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Stop the sequence at the next step; its state is freed there and its result says "cancelled"."""
        self.cancelled = True
        self._sched._wake()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Generation:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.generation

    def _put(self, piece: str) -> None:
        if piece:
            self._pieces.put(piece)

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._pieces.put(_END)
        self._done.set()

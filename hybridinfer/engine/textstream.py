"""One sequence's generated text: detokenized piece by piece, stop strings held back until they cannot match.

Shared by `Engine.stream` and the scheduler, so a sequence gives the same text whichever runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Generation:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length" | "cancelled"
    timings: dict = field(default_factory=dict)
    # with Request.logprobs: per generated token {"token", "logprob", "top": [(id, logprob), ...]}
    logprobs: list | None = None


def token_logprobs(logits: np.ndarray, t: int, top_n: int) -> dict:
    """The model's log-probability of token t (log-softmax of the raw logits, before any penalty, temperature or
    constraint) and the top_n most likely tokens with theirs, most likely first (ties: lower id)."""
    x = np.asarray(logits, np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top = np.argsort(-lp, kind="stable")[:top_n] if top_n > 0 else []
    return {"token": int(t), "logprob": float(lp[t]), "top": [(int(i), float(lp[i])) for i in top]}


class _NoText:
    """The stream decoder of a model without a vocabulary: token ids only."""

    def feed(self, t: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class TextStream:
    """Feed sampled tokens; `push` returns the text that is safe to emit (never a stop string or a prefix of one)
    and whether the sequence ended (an end-of-generation token or a stop string). `finish` returns what is left."""

    def __init__(self, tokenizer, stops: list[str], result: Generation):
        self.stop_ids = tokenizer.stop_ids if tokenizer is not None else frozenset()
        self.dec = tokenizer.stream_decoder() if tokenizer is not None else _NoText()
        self.stops, self.res = stops, result
        self.hold = max((len(s) for s in stops), default=0)
        self.text, self.emitted = "", 0

    def push(self, t: int) -> tuple[str, bool]:
        if t in self.stop_ids:
            self.res.finish_reason = "stop"
            return "", True
        self.res.tokens.append(t)
        self.text += self.dec.feed(t)
        cut = min((self.text.find(s) for s in self.stops if s in self.text), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.res.finish_reason = "stop"
            return "", True
        safe = len(self.text) - self.hold if self.hold else len(self.text)
        if safe > self.emitted:
            piece, self.emitted = self.text[self.emitted : safe], safe
            return piece, False
        return "", False

    def finish(self) -> str:
        """The rest of the text (held-back characters, bytes of a character cut off by the token limit)."""
        if self.res.finish_reason == "length":
            self.text += self.dec.flush()
        self.res.text = self.text
        piece, self.emitted = self.text[self.emitted :], len(self.text)
        return piece

"""Structured output: `response_format` json_object / json_schema enforced by llguidance on the model's vocabulary.

A `JsonConstraint` is what a sequence's sampler consults each step: `mask(logits)` sets the logits of tokens the
grammar forbids next to -inf (in place), `accept(token)` advances the grammar by the sampled token. The scheduler
calls both when a Request carries one (`Request.constraint`; see the serve report for the hook)."""

from __future__ import annotations

import threading

import numpy as np

from .errors import ApiError, bad_param

_VOCABS: dict[int, object] = {}
_LOCK = threading.Lock()


class _Vocab:
    """What llguidance's TokenizerWrapper reads of a tokenizer: token bytes, special ids, EOS, and a tokenize call."""

    def __init__(self, tok, n_vocab: int):
        self._tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.stop_ids)
        self.bos_token_id = tok.bos_id
        n = len(tok)
        self.tokens = [tok.token_bytes(i) for i in range(n)] + [b""] * max(0, n_vocab - n)
        self.special_token_ids = [i for i in range(n) if tok.is_special(i)]

    def __call__(self, text):
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")  # tells TokenizerWrapper to pass str
        return self._tok.encode(text, add_bos=False, parse_special=False)


def ll_tokenizer(engine):
    """llguidance's tokenizer of `engine`'s vocabulary, made once per tokenizer (it indexes every token)."""
    import llguidance

    tok = engine.tokenizer
    if tok is None:
        raise ApiError(400, "response_format needs a model with a vocabulary", param="response_format")
    with _LOCK:
        lt = _VOCABS.get(id(tok))
        if lt is None:
            v = _Vocab(tok, engine.args.n_vocab)
            lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(v), n_vocab=len(v.tokens),
                                        eos_token=sorted(tok.stop_ids) or [v.eos_token_id])
            _VOCABS[id(tok)] = lt
        return lt


def schema_of(response_format: dict | None) -> dict | None:
    """The JSON schema a response_format asks for: None for plain text, {"type": "object"} for json_object."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad_param("response_format.json_schema", "must be an object with a 'schema' object")
        return js.get("schema") or {"type": "object"}
    raise bad_param("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


class JsonConstraint:
    """One sequence's grammar state. Not thread-safe: the scheduler's worker alone calls it."""

    def __init__(self, engine, schema: dict, param: str = "response_format"):
        import llguidance

        lt = ll_tokenizer(engine)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise bad_param(param, f"is not a usable JSON schema: {e}") from None
        self.m = llguidance.LLMatcher(lt, grammar, log_level=0)
        if self.m.is_error():
            raise bad_param(param, f"is not a usable JSON schema: {self.m.get_error()}")
        self.n_vocab = engine.args.n_vocab
        self.stops = np.array(sorted(engine.tokenizer.stop_ids), dtype=np.int64)
        self._bits = np.zeros((lt.vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """A bool per token: may it come next?"""
        if self.m.is_error() or self.m.is_stopped():
            ok = np.zeros(self.n_vocab, dtype=bool)
            ok[self.stops] = True  # a finished (or broken) grammar lets the sequence end, nothing else
            return ok
        self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def mask(self, logits: np.ndarray) -> None:
        logits[~self.allowed()] = -np.inf

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False once the grammar is broken (it never is after `mask`)."""
        return bool(self.m.consume_token(int(token)))

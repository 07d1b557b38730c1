"""Structured output: `response_format` json_object / json_schema enforced by llguidance on the model's vocabulary.

A `JsonConstraint` is what a sequence's sampler consults each step: `mask(logits)` sets the logits of tokens the
grammar forbids next to -inf (in place), `accept(token)` advances the grammar by the sampled token. The scheduler
calls both when a Request carries one (`Request.constraint`; see the serve report for the hook).

A grammar that cannot produce an answer fails loudly, never as a "stop" with no JSON: one llguidance refuses to
compile, or that fails at its first step or the one after (a schema with no finite value such as {"$ref": "#"}, or
one past llguidance's complexity limits such as an anyOf of 3,000 objects), is a 400 naming response_format when the
request is made; one that fails later, while the answer is generated, ends its sequence with a ParameterError naming
response_format (a 400, or the error event of a stream that has begun)."""

from __future__ import annotations

import threading

import numpy as np

from ...errors import ParameterError
from .errors import ApiError, bad_param

# first tokens a new grammar is tried with, each in a copy of its matcher, before the request is accepted: llguidance
# finds most grammars it cannot run (limits, no finite value) at the first or second step
LOOKAHEAD_TOKENS = 16

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


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it appends."""
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


class JsonConstraint:
    """One sequence's grammar state: a JSON schema's, or (lark) a Lark grammar's in llguidance's dialect (a forced
    tool call's, protocol.toolgrammar). Not thread-safe: the scheduler's worker alone calls it. `limits`: fields of
    llguidance.LLParserLimits (max_items_in_row, step_lexer_fuel, ...) to use instead of llguidance's defaults."""

    def __init__(self, engine, schema: dict | None = None, param: str = "response_format", limits: dict | None = None,
                 *, lark: str | None = None):
        import llguidance

        lt = ll_tokenizer(engine)
        what = "JSON schema" if lark is None else "tool schema"
        try:
            grammar = (llguidance.LLMatcher.grammar_from_lark(lark) if lark is not None
                       else llguidance.LLMatcher.grammar_from_json_schema(schema))
        except ValueError as e:
            raise bad_param(param, f"is not a usable {what}: {e}") from None
        self.m = llguidance.LLMatcher(lt, grammar, log_level=0,
                                      limits=llguidance.LLParserLimits(**limits) if limits else None)
        if self.m.is_error():
            raise bad_param(param, f"is not a usable {what}: {_first_line(self.m.get_error())}")
        self.param, self.n_tokens = param, 0
        self.n_vocab = engine.args.n_vocab
        self.stops = np.array(sorted(engine.tokenizer.stop_ids), dtype=np.int64)
        self._bits = np.zeros((lt.vocab_size + 31) // 32, dtype=np.int32)
        self._check_start()

    def _check_start(self) -> None:
        """Refuse now a grammar that fails at its first step or, for up to LOOKAHEAD_TOKENS of its first tokens, the
        step after, or that allows nothing at all."""
        first = self._mask_of(self.m)
        if first is None:
            raise bad_param(self.param, f"cannot be satisfied (llguidance: {_first_line(self.m.get_error())})")
        starts = np.flatnonzero(first)
        starts = starts[~np.isin(starts, self.stops)]
        if starts.size == 0:
            raise bad_param(self.param, "cannot be satisfied: its grammar allows no output")
        for t in starts[:LOOKAHEAD_TOKENS]:
            m = self.m.deep_copy()
            if not m.consume_token(int(t)) or (not m.is_stopped() and self._mask_of(m) is None):
                raise bad_param(self.param, f"cannot be satisfied (llguidance: {_first_line(m.get_error())})")

    def _mask_of(self, m) -> np.ndarray | None:
        """A bool per token of `m`'s next step: may it come next? None when the matcher is in its error state."""
        if m.is_error():
            return None
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if m.is_error():
            return None
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def _failed(self) -> ParameterError:
        return ParameterError(f"{self.param}: the schema cannot be followed after {self.n_tokens} generated tokens "
                              f"(llguidance: {_first_line(self.m.get_error())})")

    def allowed(self) -> np.ndarray:
        """A bool per token: may it come next? A finished grammar lets the sequence end, nothing else; a broken one
        raises (the sequence fails with the error rather than end as if its answer were complete)."""
        if self.m.is_stopped() and not self.m.is_error():
            ok = np.zeros(self.n_vocab, dtype=bool)
            ok[self.stops] = True
            return ok
        ok = self._mask_of(self.m)
        if ok is None or not ok.any():
            raise self._failed()
        return ok

    def mask(self, logits: np.ndarray) -> None:
        logits[~self.allowed()] = -np.inf

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; a token the grammar refuses (never one `mask` allowed) raises."""
        if not self.m.consume_token(int(token)) or self.m.is_error():
            raise self._failed()
        self.n_tokens += 1
        return True

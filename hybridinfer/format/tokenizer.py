"""Byte-level BPE tokenizer built from a GGUF vocabulary, matching llama.cpp token for token.

The pieces, and where their rules come from (llama.cpp `src/llama-vocab.cpp`, `src/unicode.cpp`):

- Special tokens. Token types CONTROL (3) and USER_DEFINED (4), plus UNKNOWN (2), are cut out of the
  input as whole tokens before any pre-tokenization (`tokenizer_st_partition`): longest token text first,
  every occurrence. With `parse_special=False` only USER_DEFINED tokens are cut out (as llama.cpp and HF do).
- Pre-tokenizer. `tokenizer.ggml.pre` names a list of regexes; each splits every piece the previous one
  left, keeping unmatched text as pieces of its own. We run them with the `tokenizers` library (Oniguruma),
  using llama.cpp's spelling of each regex (ASCII-only case folding of the contractions).
- BPE. Lowest merge rank first, leftmost first on ties (the same in llama.cpp and `tokenizers`); the
  `llama-bpe` family first looks the whole word up in the vocabulary (`ignore_merges`).
- No normalization (llama.cpp applies none; HF's Qwen tokenizers add NFC, which llama.cpp does not).
- Special ids and end-of-generation ids follow llama.cpp's `llama_vocab::impl::load`, including its
  detection of `<|im_end|>`-like tokens by text (`special_eog_ids`).

Not supported: SentencePiece/WordPiece/UGM vocabularies, per-token LSTRIP/RSTRIP attributes (llama.cpp sets
them only for phi-3 and some embedding models), and llama.cpp's `clean_spaces` post-processing of
`llama_detokenize` (decoding here is the plain concatenation of token pieces, as in llama.cpp's streaming
`token_to_piece`; it is what every Qwen and SmolLM pre-tokenizer uses anyway).

The rules as data (the regex lists, token types, special-token texts, the byte table) are in
`hybridinfer.format.tokenizer_rules`; this module builds the tokenizer from them and re-exports their public names.
"""

from __future__ import annotations

import bisect
import codecs
from collections.abc import Iterable, Iterator, Mapping, Sequence

from ..errors import TokenizerError
from .tokenizer_rules import (
    _ALWAYS_RENDERED,
    _EOG_NAMES,
    _EOM_NAMES,
    _EOT_NAMES,
    _FIM_NAMES,
    _SPECIAL_KEYS,
    _TYPE_TO_ATTR,
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_NORMAL,
    ATTR_UNKNOWN,
    ATTR_UNUSED,
    ATTR_USER_DEFINED,
    PRE_TOKENIZERS,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNDEFINED,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    PreTokenizerSpec,
    _byte_decode,
    bytes_to_unicode,
)

__all__ = [
    "ATTR_BYTE",
    "ATTR_CONTROL",
    "ATTR_NORMAL",
    "ATTR_UNKNOWN",
    "ATTR_UNUSED",
    "ATTR_USER_DEFINED",
    "PRE_TOKENIZERS",
    "TOKEN_TYPE_BYTE",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNDEFINED",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_USER_DEFINED",
    "PreTokenizerSpec",
    "StreamDecoder",
    "Tokenizer",
    "bytes_to_unicode",
]


class Tokenizer:
    """llama.cpp-compatible byte-level BPE tokenizer over a GGUF vocabulary.

    Build it with `Tokenizer.from_metadata(md)` / `Tokenizer.from_gguf(gm)`; both return None for a
    GGUF without a vocabulary (`tokenizer.ggml.model` absent or "none"), whose models take token ids.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        pre: str | None = "default",
        special_ids: Mapping[str, int] | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
    ):
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if pre is None or pre == "":
            pre = "default"  # llama.cpp: "missing pre-tokenizer type, using: 'default'"
        spec = PRE_TOKENIZERS.get(pre)
        if spec is None:
            known = ", ".join(sorted(PRE_TOKENIZERS))
            raise TokenizerError(f"unknown pre-tokenizer type {pre!r} (tokenizer.ggml.pre); supported: {known}")
        if not tokens:
            raise TokenizerError("the vocabulary (tokenizer.ggml.tokens) is empty")
        n = len(tokens)
        if token_types is not None and len(token_types) < n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens")

        self.pre = pre
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._texts = texts
        self._to_id = {t: i for i, t in enumerate(texts)}  # duplicates: the last id wins, as in llama.cpp
        if token_types is None:
            attrs = [ATTR_NORMAL] * n
        else:
            attrs = [_TYPE_TO_ATTR.get(int(t), 0) for t in token_types[:n]]
        self._attrs = attrs

        ids: dict[str, int | None] = {role: None for role, _ in _SPECIAL_KEYS}
        for role, value in (special_ids or {}).items():
            if role not in ids:
                raise TokenizerError(f"unknown special token role {role!r}")
            if value is not None and 0 <= int(value) < n:
                ids[role] = int(value)
        self._detect_specials(ids)
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.eot_id: int | None = ids["eot"]
        self.eom_id: int | None = ids["eom"]
        self.unk_id: int | None = ids["unk"]
        self.pad_id: int | None = ids["pad"]
        self.special_ids: dict[str, int] = {k: v for k, v in ids.items() if v is not None}
        self.stop_ids: frozenset[int] = self._eog_ids(ids)
        self.add_bos: bool = spec.add_bos if add_bos is None else bool(add_bos)
        self.add_eos: bool = False if add_eos is None else bool(add_eos)

        # whole-token matches in the input, longest UTF-8 text first (llama.cpp `cache_special_tokens`)
        special = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        special.sort(key=lambda i: -len(texts[i].encode()))
        self._special_all = [(texts[i], i) for i in special]
        self._special_user = [(texts[i], i) for i in special if not attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)]

        vocab = self._to_id
        pairs: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        for m in merges:
            pos = m.find(" ", 1)
            if pos < 0:
                continue
            a, b = m[:pos], m[pos + 1 :]
            # `tokenizers` refuses merges whose parts or result are not tokens; llama.cpp would fall back to
            # byte tokens for such a merge, which no sane vocabulary needs.
            if (a, b) in seen or a not in vocab or b not in vocab or a + b not in vocab:
                continue
            seen.add((a, b))
            pairs.append((a, b))
        self.n_merges = len(pairs)
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges)
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        self._hf = hf
        self._pieces: list[bytes] | None = None
        self._max_token_bytes: int | None = None

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def from_metadata(cls, md: Mapping[str, object]) -> Tokenizer | None:
        """Build from GGUF metadata; None when the GGUF has no vocabulary (tokenizer model absent/"none")."""
        model = md.get("tokenizer.ggml.model")
        if model is None or model == "none":
            return None
        if model != "gpt2":
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); only byte-level BPE 'gpt2' is supported"
            )
        tokens = md.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("tokenizer.ggml.tokens is missing or empty")
        merges = md.get("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError("tokenizer.ggml.merges is missing (required for a 'gpt2' tokenizer)")
        special: dict[str, int] = {}
        for role, key in _SPECIAL_KEYS:
            v = md.get("tokenizer.ggml." + key)
            if v is not None and role not in special:
                special[role] = int(v)
        add_bos = md.get("tokenizer.ggml.add_bos_token")
        add_eos = md.get("tokenizer.ggml.add_eos_token")
        return cls(
            list(tokens),
            list(merges),
            md.get("tokenizer.ggml.token_type"),
            pre=md.get("tokenizer.ggml.pre"),
            special_ids=special,
            add_bos=None if add_bos is None else bool(add_bos),
            add_eos=None if add_eos is None else bool(add_eos),
        )

    @classmethod
    def from_gguf(cls, gm) -> Tokenizer | None:
        """Build from a `GGUFModel` (its `.metadata`)."""
        return cls.from_metadata(gm.metadata)

    def _detect_specials(self, ids: dict[str, int | None]) -> None:
        """Find EOT/EOM/FIM tokens by text where the metadata names none; mark them CONTROL."""
        by_role = {"eot": _EOT_NAMES, "eom": _EOM_NAMES, **_FIM_NAMES}
        for role, names in by_role.items():
            if ids[role] is not None:
                continue
            for name in names:
                i = self._to_id.get(name)
                if i is not None:
                    ids[role] = i
                    self._attrs[i] |= ATTR_CONTROL
                    break

    def _eog_ids(self, ids: dict[str, int | None]) -> frozenset[int]:
        """llama.cpp's `special_eog_ids`: the tokens that end generation."""
        attrs, to_id = self._attrs, self._to_id
        eog = {ids[r] for r in ("fim_pad", "fim_rep", "fim_sep") if ids[r] is not None}
        for name in _EOG_NAMES:
            i = to_id.get(name)
            if i is not None:
                eog.add(i)
                attrs[i] |= ATTR_CONTROL
        for name in _ALWAYS_RENDERED:
            i = to_id.get(name)
            if i is not None:
                attrs[i] = ATTR_USER_DEFINED
        eog |= {ids[r] for r in ("eos", "eot", "eom") if ids[r] is not None}
        texts = {self._texts[i]: i for i in eog}
        if "<|end|>" in texts and (
            ("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
            or ("<|flush|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
        ):  # gpt-oss / solar-open: <|end|> ends a message, not the generation
            eog.discard(texts["<|end|>"])
            attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            attrs[texts["</s>"]] = ATTR_NORMAL
        return frozenset(eog)

    # ------------------------------------------------------------------ vocabulary

    @property
    def n_vocab(self) -> int:
        return len(self._texts)

    def __len__(self) -> int:
        return len(self._texts)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the GGUF (byte-level form for normal tokens)."""
        self._check_id(token_id)
        return self._texts[token_id]

    def token_id(self, text: str) -> int | None:
        """The id of the token whose stored text is exactly `text`, or None."""
        return self._to_id.get(text)

    def is_special(self, token_id: int) -> bool:
        """CONTROL or UNKNOWN tokens: rendered only when `skip_special` is False."""
        self._check_id(token_id)
        return bool(self._attrs[token_id] & (ATTR_CONTROL | ATTR_UNKNOWN))

    def is_stop(self, token_id: int) -> bool:
        return token_id in self.stop_ids

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._texts):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{len(self._texts) - 1})")

    # ------------------------------------------------------------------ encoding

    @property
    def control_texts(self) -> tuple[str, ...]:
        """Texts of the tokens that only `parse_special` makes (CONTROL and UNKNOWN, e.g. `<|im_start|>`), longest
        first: what caller text must not be allowed to turn into."""
        return tuple(t for t, i in self._special_all if self._attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN))

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token: a text of n bytes is at least n / max_token_bytes tokens."""
        if self._max_token_bytes is None:
            if self._pieces is None:
                self._pieces = self._build_pieces()
            self._max_token_bytes = max(1, max(len(p) for p in self._pieces))
        return self._max_token_bytes

    def _partition(self, text: str, parse_special: bool, text_spans: Sequence[tuple[int, int]] = ()) -> list:
        """Cut special tokens out of `text` (llama.cpp `tokenizer_st_partition`): a list of ids and (offset, text)
        fragments. A CONTROL/UNKNOWN token text overlapping one of `text_spans` ([start, end) offsets) stays text,
        as without parse_special."""
        frags: list = [(0, text)]
        spans = sorted(text_spans)
        starts = [a for a, _ in spans]
        for stext, sid in self._special_all if parse_special else self._special_user:
            if stext not in text:
                continue
            guard = bool(spans) and bool(self._attrs[sid] & (ATTR_CONTROL | ATTR_UNKNOWN))
            out: list = []
            for f in frags:
                if isinstance(f, int) or stext not in f[1]:
                    out.append(f)
                    continue
                off, s = f
                start = pos = 0
                while (j := s.find(stext, pos)) >= 0:
                    if guard and _overlaps(spans, starts, off + j, off + j + len(stext)):
                        pos = j + 1
                        continue
                    if j > start:
                        out.append((off + start, s[start:j]))
                    out.append(sid)
                    start = pos = j + len(stext)
                if start < len(s):
                    out.append((off + start, s[start:]))
            frags = out
        return frags

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True, add_eos: bool | None = None,
        text_spans: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """Token ids of `text`. `add_bos`/`add_eos` None follow the GGUF (`tokenizer.ggml.add_bos_token`...).

        With `parse_special`, CONTROL/USER_DEFINED token texts in `text` become those tokens (never split), except
        CONTROL ones overlapping a `text_spans` range ([start, end) character offsets): caller text inside a chat
        template's markup, which is tokenized as text. The rest of the text is tokenized as one, so spans change
        nothing where they hold no control token's text.
        """
        out: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        if text:
            hf = self._hf
            for frag in self._partition(text, parse_special, text_spans):
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(hf.encode(frag[1], add_special_tokens=False).ids)
        if self.add_eos if add_eos is None else add_eos:
            if self.eos_id is None:
                raise TokenizerError("add_eos requested but the vocabulary has no EOS token")
            out.append(self.eos_id)
        return out

    def pre_tokenize(self, text: str) -> list[str]:
        """The words the pre-tokenizer cuts `text` into before BPE (special tokens not handled)."""
        return [text[a:b] for _, (a, b) in self._hf.pre_tokenizer.pre_tokenize_str(text)]

    def encode_batch(self, texts: Iterable[str], **kw) -> list[list[int]]:
        return [self.encode(t, **kw) for t in texts]

    # ------------------------------------------------------------------ decoding

    def _build_pieces(self) -> list[bytes]:
        pieces: list[bytes] = []
        append = pieces.append
        for text, attr in zip(self._texts, self._attrs, strict=True):
            if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
                append(text.encode())
            elif attr & ATTR_NORMAL:
                append(_byte_decode(text))
            elif attr & ATTR_BYTE:  # "<0xXX>"
                try:
                    append(bytes([int(text[3:5], 16)]))
                except ValueError:
                    append(b"")
            else:  # UNUSED / UNDEFINED: llama.cpp renders nothing
                append(b"")
        return pieces

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes token `token_id` stands for (llama.cpp `token_to_piece`)."""
        if self._pieces is None:
            self._pieces = self._build_pieces()
        if not 0 <= token_id < len(self._pieces):
            self._check_id(token_id)
        if skip_special and self._attrs[token_id] & (ATTR_CONTROL | ATTR_UNKNOWN):
            return b""
        return self._pieces[token_id]

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        return b"".join(self.token_bytes(int(i), skip_special) for i in ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD). `skip_special` drops CONTROL/UNKNOWN tokens."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


def _overlaps(spans: list[tuple[int, int]], starts: list[int], a: int, b: int) -> bool:
    """Whether [a, b) overlaps one of the sorted, disjoint `spans` (`starts`: their starts)."""
    i = bisect.bisect_right(starts, b - 1) - 1  # the last span starting before b
    return i >= 0 and spans[i][1] > a


class StreamDecoder:
    """Turns ids fed one at a time into text pieces, holding back incomplete UTF-8 sequences.

    The concatenation of every `feed()` result and the final `flush()` equals `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(self.tokenizer.token_bytes(int(token_id), self.skip_special))

    def flush(self) -> str:
        """Text still held back (an incomplete sequence at the end becomes U+FFFD); resets the decoder."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    def pending(self) -> bool:
        """Whether bytes of an incomplete character are held back."""
        return bool(self._dec.getstate()[0])

    def decode_iter(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield the non-empty pieces of `ids`, then what `flush()` releases."""
        for i in ids:
            piece = self.feed(i)
            if piece:
                yield piece
        tail = self.flush()
        if tail:
            yield tail

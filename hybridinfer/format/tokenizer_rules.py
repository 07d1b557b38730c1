"""The llama.cpp rules the tokenizer (`hybridinfer.format.tokenizer`) follows, as data: GGUF token types and their
llama.cpp attributes, the pre-tokenizer regex lists by `tokenizer.ggml.pre` name, the texts by which
llama.cpp detects end-of-generation and FIM tokens, the special-id metadata keys, and GPT-2's byte-level
character table. Sources: llama.cpp `src/llama-vocab.cpp`, `src/unicode.cpp`, `src/unicode-data.cpp`.
"""

from __future__ import annotations

from dataclasses import dataclass

# GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# llama.cpp `llama_token_attr` bits (a token's type becomes one of them; detection by text may add CONTROL).
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
}

# ---------------------------------------------------------------------------------------------------------
# Pre-tokenizers: llama.cpp's regex lists (`llm_tokenizer_bpe`), by `tokenizer.ggml.pre` name.

# llama.cpp classifies code points with its own tables (`unicode-data.cpp`, Unicode 15.x); Oniguruma in
# `tokenizers` knows Unicode 16.0. The code points Unicode 16.0 assigned are "undefined" to llama.cpp, which
# treats them like punctuation (neither letter, mark, digit nor space), so our classes treat them the same.
_UNICODE16_NEW = (
    "897 1B4E-1B4F 1B7F 1C89-1C8A 2427-2429 31E4-31E5 A7CB-A7CD A7DA-A7DC 105C0-105F3 10D40-10D65 10D69-10D85 "
    "10D8E-10D8F 10EC2-10EC4 10EFC 11380-11389 1138B 1138E 11390-113B5 113B7-113C0 113C2 113C5 113C7-113CA "
    "113CC-113D5 113D7-113D8 113E1-113E2 116D0-116E3 11BC0-11BE1 11BF0-11BF9 11F5A 13460-143FA 16100-16139 "
    "16D40-16D79 18CFF 1CC00-1CCF9 1CD00-1CEB3 1E5D0-1E5FA 1E5FF 1F8B2-1F8BB 1F8C0-1F8C1 1FA89 1FA8F 1FABE "
    "1FAC6 1FADC 1FADF 1FAE9 1FBCB-1FBEF"
)
_X = "".join("-".join(f"\\x{{{c}}}" for c in r.split("-")) for r in _UNICODE16_NEW.split())
_L = rf"[\p{{L}}&&[^{_X}]]"  # \p{L} as llama.cpp sees it
_N = rf"[\p{{N}}&&[^{_X}]]"
_P = rf"[\p{{P}}&&[^{_X}]]"
_LM = rf"[[\p{{L}}\p{{M}}]&&[^{_X}]]"
_NOT_RN_L_N = rf"[{_X}[^\r\n\p{{L}}\p{{N}}]]"
_NOT_S_L_N = rf"[{_X}[^\s\p{{L}}\p{{N}}]]"
_NOT_S_L_M_N = rf"[{_X}[^\s\p{{L}}\p{{M}}\p{{N}}]]"

# The regexes below are llama.cpp's, with \p{..} classes spelled as above.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
_RX_GPT2 = rf"'s|'t|'re|'ve|'m|'ll|'d| ?{_L}+| ?{_N}+| ?{_NOT_S_L_N}+|\s+(?!\S)"
# (?i:'s|..)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
_RX_LLAMA3 = rf"{_CONTRACTIONS}|{_NOT_RN_L_N}?{_L}+|{_N}{{1,3}}| ?{_NOT_S_L_N}+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# (?i:'s|..)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
_RX_QWEN2 = rf"{_CONTRACTIONS}|{_NOT_RN_L_N}?{_L}+|{_N}| ?{_NOT_S_L_N}+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# (?i:'s|..)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
_RX_QWEN35 = rf"{_CONTRACTIONS}|{_NOT_RN_L_N}?{_LM}+|{_N}| ?{_NOT_S_L_M_N}+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp pre-tokenizes for one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token skips the merges (llama3 family)
    add_bos: bool = False  # llama.cpp's default when `tokenizer.ggml.add_bos_token` is absent


_DEFAULT = PreTokenizerSpec((rf"(?:{_P}|[\$\+<=>\^~\|])+", _RX_GPT2, rf"{_N}+", "[0-9][0-9][0-9]"))
_GPT2 = PreTokenizerSpec((_RX_GPT2,))
_SMOLLM = PreTokenizerSpec((_N, _RX_GPT2))
_LLAMA3 = PreTokenizerSpec((_RX_LLAMA3,), ignore_merges=True, add_bos=True)
_DBRX = PreTokenizerSpec((_RX_LLAMA3,))
_QWEN2 = PreTokenizerSpec((_RX_QWEN2,))
_QWEN35 = PreTokenizerSpec((_RX_QWEN35,))

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {"default": _DEFAULT, "qwen35": _QWEN35}
for _names, _spec in (
    # "gpt2" is our alias: llama.cpp itself knows only "gpt-2".
    (("gpt2", "gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais",
      "trillion", "granite-docling"), _GPT2),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"), _SMOLLM),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), _LLAMA3),
    (("dbrx", "smaug-bpe"), _DBRX),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
      "grok-2"), _QWEN2),
):
    for _n in _names:
        PRE_TOKENIZERS[_n] = _spec

# ---------------------------------------------------------------------------------------------------------
# Special-token detection by text (llama.cpp `llama_vocab::impl::load`).

_EOT_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_NAMES = ("<|eom_id|>",)
_FIM_NAMES = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: USER_DEFINED

# metadata key suffix -> special role; later keys win only where earlier ones are absent (deprecated names)
_SPECIAL_KEYS = (
    ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"), ("eom", "eom_token_id"),
    ("unk", "unknown_token_id"), ("sep", "seperator_token_id"), ("pad", "padding_token_id"),
    ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"), ("fim_suf", "fim_suf_token_id"),
    ("fim_mid", "fim_mid_token_id"), ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
    ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"), ("fim_suf", "suffix_token_id"),
    ("fim_mid", "middle_token_id"),
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE_TABLE = {ord(c): chr(b) for b, c in _BYTE_TO_CHAR.items()}  # str.translate -> latin-1 chars


def _byte_decode(text: str) -> bytes:
    """A byte-level token's text -> the bytes it stands for."""
    try:
        return text.translate(_CHAR_TO_BYTE_TABLE).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the byte table: keep it as UTF-8
        return b"".join(
            bytes([ord(c)]) if ord(c) < 256 else c.encode() for c in text.translate(_CHAR_TO_BYTE_TABLE)
        )

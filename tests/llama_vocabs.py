"""Test helper: llama.cpp's own tokenizer test vocabularies (`models/ggml-vocab-*.gguf` with `.inp` inputs
and `.out` expected ids), taken from the llama-cpp-python source distribution of the installed version and
cached under ~/.cache/hybridinfer."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata


def vocab_dir() -> str | None:
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None
    cache = os.path.join(os.path.expanduser("~"), ".cache", "hybridinfer", f"llama-vocabs-{version}")
    if os.path.exists(os.path.join(cache, "ggml-vocab-qwen35.gguf.out")):
        return cache
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={version}", "-d", tmp], capture_output=True, text=True)
        sdists = [f for f in os.listdir(tmp) if f.endswith(".tar.gz")]
        if r.returncode != 0 or not sdists:
            return None
        os.makedirs(cache, exist_ok=True)
        with tarfile.open(os.path.join(tmp, sdists[0])) as tf:
            for m in tf.getmembers():
                name = os.path.basename(m.name)
                if "/vendor/llama.cpp/models/" in m.name and name.startswith("ggml-vocab-") and m.isfile():
                    with tf.extractfile(m) as src, open(os.path.join(cache, name), "wb") as dst:
                        dst.write(src.read())
    return cache


def cases(path: str) -> list[tuple[str, list[int]]]:
    """(input text, expected ids) pairs of one vocabulary's llama.cpp test file."""
    with open(path + ".inp", encoding="utf-8") as f:
        inputs = f.read().split("\n__ggml_vocab_test__\n")
    with open(path + ".out", encoding="utf-8") as f:
        outputs = f.read().split("\n")
    if inputs and inputs[-1].endswith("\n__ggml_vocab_test__"):
        inputs[-1] = inputs[-1][: -len("\n__ggml_vocab_test__")]
    return [(t, [int(x) for x in o.split()]) for t, o in zip(inputs, outputs, strict=False)]

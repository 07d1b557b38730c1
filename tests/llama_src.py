"""Test helper: llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py`, its `conversion/` package and the
`gguf-py` it imports) from the llama-cpp-python source distribution of the installed version, cached under
~/.cache/hybridinfer; HYBRIDINFER_LLAMA_CPP_SRC names an unpacked llama.cpp tree instead. `convert` runs it on an
HF checkpoint folder in a subprocess (its vendored gguf-py must not meet the installed one in this process)."""

from __future__ import annotations

import os
import subprocess
import sys

from llama_sdist import each_vendored_file, installed_version

_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# The converter reads the tokenizer from the checkpoint (tokenizer.json and a hash of its pre-tokenizer); the tiny
# test checkpoints have none, so its set_vocab writes the "none" vocabulary (token ids only), as
# tests/oracles/convert_hf.py does. Everything else (names, shapes, types, metadata) is the converter's own.
_DRIVER = """
import runpy, sys
root = sys.argv[1]
sys.path.insert(0, root)
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
import conversion.base as base
base.TextModel.set_vocab = lambda self: self._set_vocab_none()
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def source_dir() -> str | None:
    env = os.environ.get("HYBRIDINFER_LLAMA_CPP_SRC")
    if env:
        return env if os.path.exists(os.path.join(env, "convert_hf_to_gguf.py")) else None
    version = installed_version()
    if version is None:
        return None
    cache = os.path.join(os.path.expanduser("~"), ".cache", "hybridinfer", f"llama-src-{version}")
    if os.path.exists(os.path.join(cache, "convert_hf_to_gguf.py")):
        return cache
    part = cache + f".tmp{os.getpid()}"

    def take(rel: str, read) -> None:
        if any(rel.startswith(p) if p.endswith("/") else rel == p for p in _PARTS):
            dst = os.path.join(part, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as out:
                out.write(read())

    if not each_vendored_file(version, take):
        return None
    os.replace(part, cache)
    return cache


def convert(src: str, hf_dir: str, out: str, outtype: str = "f32", *extra: str) -> None:
    """llama.cpp's converter on the checkpoint folder hf_dir, writing out (a RuntimeError with its log if it fails);
    `extra`: more of its flags (`--mmproj`)."""
    r = subprocess.run([sys.executable, "-c", _DRIVER, src, hf_dir, *extra, "--outtype", outtype, "--outfile", out],
                       capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}):\n{r.stderr[-4000:]}")

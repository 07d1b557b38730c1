"""Test helper: the llama-cpp-python source distribution of the installed version, fetched once by pip (no
binary) for the helpers that take files out of its vendored llama.cpp tree (llama_vocabs.py, llama_src.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata


def installed_version() -> str | None:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def each_vendored_file(version: str, take) -> bool:
    """take(path inside vendor/llama.cpp/, read()) for every file of the sdist's llama.cpp tree; False when the
    sdist could not be had (no network, no such version)."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={version}", "-d", tmp], capture_output=True, text=True)
        sdists = [f for f in os.listdir(tmp) if f.endswith(".tar.gz")]
        if r.returncode != 0 or not sdists:
            return False
        with tarfile.open(os.path.join(tmp, sdists[0])) as tf:
            for m in tf.getmembers():
                _, sep, rel = m.name.partition("/vendor/llama.cpp/")
                if sep and m.isfile():
                    take(rel, lambda m=m: tf.extractfile(m).read())
    return True

"""A cache of the built native extensions (hybridinfer._simd, the GPU backend's _pace), keyed by everything they
are built from, so that `pip install -e .[serve]` after `pip install -e .` copies the library built the first time
instead of compiling it again (two minutes on two cores) while its sources are unchanged. setup.py's build_ext
uses it; the key is a hash of the extension's name and file name, the platform, the cffi version (it writes the
C glue), the compiler variables and every file of its source folders, so any change there is a miss and a fresh
build. The cache lives in $XDG_CACHE_HOME/hybridinfer/build (~/.cache/...); HYBRIDINFER_BUILD_CACHE=0 turns it
off."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# each extension's source folder (what its build script reads); an extension not named here hashes all of native/
SOURCES = {"hybridinfer._simd": [os.path.join(HERE, "simd")],
           "hybridinfer.backends.gpu._pace": [os.path.join(HERE, "pace")]}
# the compiler variables distutils reads: a build under other flags is another library
COMPILER_ENV = ("CC", "CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED", "ARCHFLAGS")


def source_key(ext_name: str, out_name: str, src_dirs: list[str], env=None, extra: tuple[str, ...] = ()) -> str:
    """The cache key of one extension: a SHA-256 over its names, the platform, `extra` (e.g. cffi's version),
    the compiler variables of `env` (default os.environ) and the relative path and content of every file under
    src_dirs (byte-compiled Python left out)."""
    env = os.environ if env is None else env
    h = hashlib.sha256()
    for part in (ext_name, out_name, sysconfig.get_platform(), sys.implementation.name, *extra):
        h.update(part.encode() + b"\0")
    for var in COMPILER_ENV:
        h.update(f"{var}={env.get(var, '')}".encode() + b"\0")
    for d in src_dirs:
        for root, dirs, files in os.walk(d):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for name in sorted(files):
                if name.endswith((".pyc", ".pyo", ".so", ".o")):
                    continue
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, d).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def cache_dir(env=None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hybridinfer", "build")


def enabled(env=None) -> bool:
    env = os.environ if env is None else env
    return env.get("HYBRIDINFER_BUILD_CACHE", "1") != "0"


def _entry(root: str, key: str, out_path: str) -> str:
    return os.path.join(root, key, os.path.basename(out_path))


def fetch(key: str, out_path: str, root: str) -> bool:
    """Copy the cached build of `key` to out_path; False (nothing done) when there is none."""
    src = _entry(root, key, out_path)
    if not os.path.isfile(src):
        return False
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    shutil.copy(src, out_path)  # a fresh mtime: setuptools then copies it over an older in-place build
    return True


def store(key: str, out_path: str, root: str) -> None:
    """Keep a copy of the built out_path under `key` (written beside, then renamed: a reader never sees half of
    it). A cache that cannot be written is no error: the next install compiles again."""
    dst = _entry(root, key, out_path)
    tmp = None
    try:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dst), prefix=".part-")
        os.close(fd)
        shutil.copy2(out_path, tmp)
        os.replace(tmp, dst)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)

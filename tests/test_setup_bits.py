"""Set-up: the native build cache's key (native/build_cache.py: what setup.py's build_ext reuses a library by),
its fetch and store; `batch --ray` without Ray installed (a one-line error before the model loads, and batch runs
without Ray); the CPU backend's progress bar while it copies and repacks the weights."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("build_cache", os.path.join(ROOT, "native", "build_cache.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tree(d, files: dict[str, bytes]) -> str:
    for name, data in files.items():
        p = os.path.join(d, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    return str(d)


def test_key_follows_every_input(bc, tmp_path):
    src = _tree(tmp_path / "simd", {"a.c": b"int a;", "b.h": b"#define B 1", "sub/c.h": b"x"})
    env = {"CC": "gcc"}
    key = bc.source_key("pkg._simd", "_simd.abi3.so", [src], env, ("1.17",))
    assert key == bc.source_key("pkg._simd", "_simd.abi3.so", [src], dict(env), ("1.17",))  # stable
    # byte-compiled files and __pycache__ are no source
    _tree(tmp_path / "simd", {"__pycache__/build.cpython-311.pyc": b"\0", "x.pyc": b"\1"})
    assert bc.source_key("pkg._simd", "_simd.abi3.so", [src], env, ("1.17",)) == key
    others = [
        bc.source_key("pkg._pace", "_simd.abi3.so", [src], env, ("1.17",)),
        bc.source_key("pkg._simd", "_simd.cpython-311.so", [src], env, ("1.17",)),
        bc.source_key("pkg._simd", "_simd.abi3.so", [src], {"CC": "clang"}, ("1.17",)),
        bc.source_key("pkg._simd", "_simd.abi3.so", [src], dict(env, CFLAGS="-march=native"), ("1.17",)),
        bc.source_key("pkg._simd", "_simd.abi3.so", [src], env, ("1.18",)),
    ]
    _tree(tmp_path / "simd", {"sub/c.h": b"y"})  # one byte of one header
    others.append(bc.source_key("pkg._simd", "_simd.abi3.so", [src], env, ("1.17",)))
    _tree(tmp_path / "simd", {"sub/c.h": b"x", "new.c": b""})  # back, and a new (empty) file
    others.append(bc.source_key("pkg._simd", "_simd.abi3.so", [src], env, ("1.17",)))
    os.rename(os.path.join(src, "new.c"), os.path.join(src, "renamed.c"))
    others.append(bc.source_key("pkg._simd", "_simd.abi3.so", [src], env, ("1.17",)))
    assert len({key, *others}) == len(others) + 1, "an input left the key unchanged"
    os.remove(os.path.join(src, "renamed.c"))
    assert bc.source_key("pkg._simd", "_simd.abi3.so", [src], env, ("1.17",)) == key


def test_the_repository_sources_are_keyed(bc):
    names = set(bc.SOURCES)
    assert names == {"hybridinfer._simd", "hybridinfer.backends.gpu._pace"}
    for ext, dirs in bc.SOURCES.items():
        assert all(os.path.isfile(os.path.join(d, "build.py")) for d in dirs), ext
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert '"build_ext": CachedBuildExt' in f.read()


def test_fetch_and_store(bc, tmp_path):
    root, out = str(tmp_path / "cache"), tmp_path / "build" / "_simd.abi3.so"
    assert not bc.fetch("k1", str(out), root) and not out.exists()
    out.parent.mkdir()
    out.write_bytes(b"\x7fELF library")
    bc.store("k1", str(out), root)
    again = tmp_path / "other" / "_simd.abi3.so"
    assert bc.fetch("k1", str(again), root) and again.read_bytes() == b"\x7fELF library"
    assert not bc.fetch("k2", str(again), root)
    # a fetched library is as new as the fetch: setuptools copies build/ over an in-place library only when newer,
    # so a cache entry keeping its old time left a stale in-place library after the sources changed
    entry = os.path.join(root, "k1", "_simd.abi3.so")
    os.utime(entry, (1_000_000_000, 1_000_000_000))
    assert bc.fetch("k1", str(again), root) and os.path.getmtime(again) > os.path.getmtime(entry) + 1e6
    assert os.listdir(os.path.join(root, "k1")) == ["_simd.abi3.so"]  # no partial file left beside it
    bc.store("k3", str(out), str(tmp_path / "build" / "_simd.abi3.so"))  # an unwritable cache: no error
    assert bc.cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/hybridinfer/build"
    assert not bc.enabled({"HYBRIDINFER_BUILD_CACHE": "0"}) and bc.enabled({})


def test_ray_missing_is_one_line_and_batch_runs_without_it(smollm_path, tmp_path, monkeypatch, capsys):
    pytest.importorskip("pydantic")
    from batch_records import write_job

    from hybridinfer.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does where Ray is not installed
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, [{"custom_id": "a", "prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0}])
    assert main(["batch", str(job), "-o", str(out), "-m", smollm_path, "--ray", "local"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--ray needs Ray" in err and ".[ray]" in err, err
    assert not out.exists()
    assert main(["batch", str(job), "-o", str(out), "-m", smollm_path, "--backend", "cpu", "--progress", "none",
                 "--prefix-cache-ram", "0"]) == 0
    rec = json.loads(out.read_text())
    assert rec["custom_id"] == "a" and rec["response"]["status_code"] == 200


def test_weights_copy_progress_bar(tmp_path, capfd):
    from hybridinfer.engine.api import Engine
    from hybridinfer.tools.synth import synth_model

    path = synth_model(tmp_path / "m.gguf", "llama", dict(n_embd=64, n_layer=2, n_head=2, n_ff=64, n_vocab=300),
                       quant="q8_0", seed=1)["path"]
    capfd.readouterr()
    for progress in (True, False):
        with Engine.load(str(path), backend="cpu", weights="copy", progress=progress) as eng:
            assert eng.backend.weights == "copy"
        err = capfd.readouterr().err
        assert ("copying" in err and "weights" in err and "B/s" in err) == progress, err


def _extras() -> set[str]:
    import ast

    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    value = next(k.value for k in call.keywords if k.arg == "extras_require")
    return {ast.literal_eval(k) for k in value.keys}


def test_extras_named_by_ci_and_docker_exist():
    import re

    extras = _extras()
    assert "ray" in extras and "batch" in extras
    with open(os.path.join(ROOT, "setup.py")) as f:  # batch without Ray: --ray's 240 MB only in .[ray]
        text = f.read()
    assert re.search(r'"batch": \[[^\]]*\]', text) and "ray" not in re.search(r'"batch": \[[^\]]*\]', text).group()
    named = {}
    for rel in (".ci/run", "docker/Dockerfile.cpu", "docker/Dockerfile.cuda"):
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        named[rel] = {e for group in re.findall(r'"\.\[([a-z,]+)\]"', text) for e in group.split(",")}
        assert named[rel] and named[rel] <= extras, (rel, named[rel] - extras)
        if rel.startswith("docker/"):
            # the Python python_requires names (3.11), and the command as the entry point
            assert 'ENTRYPOINT ["hybridinfer"]' in text and re.search(r"python:?3\.11", text), rel
    assert "ray" in named[".ci/run"]  # the --ray test keeps running in CI
    with open(os.path.join(ROOT, ".ci/run")) as f:
        ci = f.read()
    assert "docker info" in ci and "docker/Dockerfile.cpu" in ci and "docker/Dockerfile.cuda" in ci

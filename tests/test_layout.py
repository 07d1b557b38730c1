"""The runtime package imports no test oracle and no plotting or training library: every module under hybridinfer/
is imported in a fresh interpreter, then sys.modules is checked (benchmarks import matplotlib inside their plot
functions only, so importing them must not load it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = r"""
import importlib, json, os, pkgutil, sys
import hybridinfer
names = [m.name for m in pkgutil.walk_packages(hybridinfer.__path__, "hybridinfer.")
         if not m.name.endswith(".__main__")]  # __main__ runs the CLI
# a module that needs an extra that is not installed here (serve, batch, gpu) is left out, not failed
OPTIONAL = {"fastapi", "uvicorn", "sse_starlette", "pydantic", "prometheus_client", "llguidance", "ray", "pycuda"}
for n in names:
    try:
        importlib.import_module(n)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL:
            raise
tests = os.path.join(sys.argv[1], "tests") + os.sep
print(json.dumps({"names": names, "modules": {k: getattr(v, "__file__", None) or "" for k, v in sys.modules.items()},
                  "tests": tests}))
"""

FORBIDDEN = ("matplotlib", "torch", "transformers", "oracles")


def test_runtime_imports_no_oracle_nor_plotting():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _PROBE, ROOT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    names = got["names"]
    # the walk really covered the package: the CPU backend, the GPU launchers, the server and the benchmarks
    for n in ("hybridinfer.backends.cpu.backend", "hybridinfer.backends.gpu.loader", "hybridinfer.engine.sampling",
              "hybridinfer.cli"):
        assert n in names
    assert any(n.startswith("hybridinfer.tools.benchmarks.") for n in names)
    mods = got["modules"]
    loaded = sorted(k for k in mods if k.split(".")[0] in FORBIDDEN)
    assert loaded == [], f"runtime import pulled in {loaded}"
    from_tests = sorted(k for k, f in mods.items() if f.startswith(got["tests"]))
    assert from_tests == [], f"runtime import loaded modules from tests/: {from_tests}"
    assert not any(k.startswith("tools.") or k == "tools" for k in mods)


def test_benchmarks_without_matplotlib(monkeypatch, tmp_path, capsys):
    """matplotlib is the `bench` extra: without it every benchmark's plot returns False and writes nothing, and
    `hybridinfer bench` still writes its JSON with one note line instead of the PNG."""
    import importlib
    import pkgutil

    from hybridinfer.cli.bench import _save_bench
    from hybridinfer.tools import benchmarks

    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` raises ImportError
    plots = []
    for m in pkgutil.iter_modules(benchmarks.__path__, "hybridinfer.tools.benchmarks."):
        plot = getattr(importlib.import_module(m.name), "plot", None)
        if plot is not None:
            png = tmp_path / (m.name + ".png")
            assert plot({} if "prefix" not in m.name else [], str(png)) is False, m.name
            assert not png.exists()
            plots.append(m.name)
    assert len(plots) >= 6, plots  # decode, batch, prefill, prefix, serve, batch-job
    from hybridinfer.tools.benchmarks import decode

    _save_bench(str(tmp_path), "b", '{"x": 1}', lambda png: decode.plot({}, png))
    out = capsys.readouterr().out
    assert (tmp_path / "b.json").read_text() == '{"x": 1}' and not (tmp_path / "b.png").exists()
    assert [ln for ln in out.splitlines() if "matplotlib" in ln] == [f"wrote {tmp_path / 'b'}.json (no plot: "
                                                                   "matplotlib missing)"]


def test_every_backend_entry_point_says_decode_stays_on_the_cpu():
    """backend "gpu" is the prefill device: each place a user picks a backend says decode stays on the CPU."""
    import argparse

    from hybridinfer import backends
    from hybridinfer.cli import build_parser
    from hybridinfer.engine.api import Engine

    def backend_helps(parser, path=()):
        for act in parser._actions:
            if "--backend" in act.option_strings:
                yield path, act.help or ""
            if isinstance(act, argparse._SubParsersAction):
                for name, sub in act.choices.items():
                    yield from backend_helps(sub, path + (name,))

    helps = list(backend_helps(build_parser()))
    assert {("run",), ("chat",), ("serve",), ("batch",), ("bench", "serve")} <= {p for p, _ in helps}, helps
    for path, h in helps:
        assert "gpu (prefill on the card; decode stays on the CPU)" in h, (path, h)
    for doc in (Engine.load.__doc__, backends.__doc__, backends.GPUPrefillCPUDecode.__doc__):
        assert '"gpu"' in doc and "decode" in doc and "CPU" in doc
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "`gpu`: prefill on the card, decode on the CPU" in readme


LAYERS = ("errors", "format", "models", "backends", "engine", "serving", "tools", "cli")  # bottom to top


def _imports(path, root) -> list[tuple[int, list[str]]]:
    """(line, dotted target as parts) of every `from ... import` of a hybridinfer module in the file, at any depth
    (imports inside functions too), relative ones resolved."""
    import ast

    parts = path.relative_to(root).parts
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                target = list(parts[:-1])[: len(parts) - n.level] + (n.module.split(".") if n.module else [])
            elif n.module and n.module.startswith("hybridinfer."):
                target = n.module.split(".")
            else:
                continue
            # `from . import x`: the names may be modules
            out += [(n.lineno, target + [a.name]) for a in n.names] if not n.module else [(n.lineno, target)]
        elif isinstance(n, ast.Import):
            out += [(n.lineno, a.name.split(".")) for a in n.names if a.name.startswith("hybridinfer.")]
    return out


def test_layers_import_only_downwards():
    """Each folder of the package imports only itself and the layers below it (README's Layout)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rank = {k: i for i, k in enumerate(LAYERS)}
    bad = []
    for p in sorted((root / "hybridinfer").rglob("*.py")):
        parts = p.relative_to(root).parts
        if len(parts) < 3 or parts[1] not in rank:
            continue
        for line, target in _imports(p, root):
            if len(target) > 1 and rank.get(target[1], -1) > rank[parts[1]]:
                bad.append(f"{'/'.join(parts)}:{line} imports {'.'.join(target)}")
    assert not bad, "\n".join(bad)
    assert sorted(d.name for d in (root / "hybridinfer").iterdir() if d.is_dir() and d.name != "__pycache__"
                  and not d.name.startswith("_")) == sorted(LAYERS[1:])


def test_backends_keep_to_their_own_code():
    """The GPU backend imports nothing of the CPU backend (bus pacing is its own native module, native/pace), and
    the numpy reference and its activation quantizer (actquant*.py) import no backend: read from every import in
    their sources, and from what importing them loads in a fresh interpreter."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    backends = root / "hybridinfer" / "backends"
    rules = [(p, ("cpu",)) for p in sorted((backends / "gpu").rglob("*.py"))]
    rules += [(backends / f, ("cpu", "gpu")) for f in ("reference.py", "reference_ops.py", "actquant.py",
                                                        "actquant_k.py")]
    bad = [f"{p.relative_to(root)}:{line} imports {'.'.join(t)}" for p, banned in rules for line, t in _imports(p, root)
           if t[:2] == ["hybridinfer", "backends"] and len(t) > 2 and t[2] in banned]
    assert not bad, "\n".join(bad)
    assert _imports(backends / "gpu" / "k_pace.py", root), "the scan reads imports inside functions too"
    probe = ("import json, sys; import hybridinfer.backends.reference, hybridinfer.backends.gpu.k_pace, "
             "hybridinfer.backends.gpu.streamer; print(json.dumps(sorted(sys.modules)))")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "hybridinfer.backends.reference" in loaded
    assert [m for m in loaded if m.startswith("hybridinfer.backends.cpu")] == []

"""Models by name (-hf REPO[:QUANT|:FILE], Engine.load(hf=...)) against a Hugging Face Hub served on loopback
(tests/fake_hub.py, HF_ENDPOINT pointed at it) with GGUFs made here: download, a transfer resumed after the
connection dropped, cache hits, offline mode, and the typed errors of a missing repository, file or quant. Each
run is a fresh process, as huggingface_hub reads its environment when it is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fake_hub import FakeHub

from hybridinfer.errors import HubError
from hybridinfer.format.hub import HubSpec, available_quants, parse_spec, pick_files, quant_tag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "acme/Tiny-GGUF"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model

    d = tmp_path_factory.mktemp("hub")
    small = synth_model(d / "small.gguf", "llama", dict(n_embd=64, n_layer=1, n_head=2, n_ff=64, n_vocab=300),
                        quant="q8_0", seed=1)["path"]
    # over huggingface_hub's 10 MiB read chunk, so a transfer cut past it resumes with a Range request
    big = synth_model(d / "big.gguf", "llama", dict(n_embd=256, n_layer=1, n_head=2, n_ff=256, n_vocab=8000),
                      quant="f32", seed=2)["path"]
    # a vision projector for the small model's width: -hf fetches it beside the model, as llama.cpp's does
    from hybridinfer.tools.synth_vision import synth_mmproj

    synth_mmproj(d / "mmproj.gguf", 64, {"depth": 1, "hidden": 32, "heads": 2, "ff": 64, "pos_side": 4})
    with open(small, "rb") as f, open(big, "rb") as g, open(d / "mmproj.gguf", "rb") as m:
        return {"small": f.read(), "big": g.read(), "mmproj": m.read()}


@pytest.fixture
def hub(ggufs):
    repos = {REPO: {"Tiny-Q8_0.gguf": ggufs["small"], "Tiny-F32.gguf": ggufs["big"],
                    "mmproj-Tiny-F16.gguf": ggufs["mmproj"], "README.md": b"# tiny\n"}}
    with FakeHub(repos) as h:
        yield h


def _env(hub, home, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), PYTHONPATH=ROOT, HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def _cli(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridinfer", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _file_line(out: str) -> str:
    line = next(ln for ln in out.splitlines() if ln.startswith("file:"))
    return line.split()[1]


def test_download_then_cache_hit_then_offline(hub, tmp_path, ggufs):
    env = _env(hub, tmp_path)
    r = _cli(env, "info", "-hf", f"{REPO}:q8_0")  # the tag in any case
    assert r.returncode == 0, r.stderr
    path = _file_line(r.stdout)
    assert path.startswith(str(tmp_path)) and path.endswith("Tiny-Q8_0.gguf"), path
    with open(path, "rb") as f:
        assert f.read() == ggufs["small"]
    assert hub.gets(REPO, "Tiny-Q8_0.gguf") == [None]

    r = _cli(env, "info", "-hf", REPO, "-hff", "Tiny-Q8_0.gguf")  # the same file by name: from the cache
    assert r.returncode == 0, r.stderr
    assert _file_line(r.stdout) == path
    assert hub.gets(REPO, "Tiny-Q8_0.gguf") == [None], "a cached file was downloaded again"

    before = len(hub.log)
    r = _cli(dict(env, HF_HUB_OFFLINE="1"), "info", "-hf", f"{REPO}:Q8_0")
    assert r.returncode == 0, r.stderr
    assert _file_line(r.stdout) == path
    assert len(hub.log) == before, f"offline mode reached the hub: {hub.log[before:]}"

    # offline, a quant the cache does not hold: a one-line error naming it, nothing asked of the hub
    r = _cli(dict(env, HF_HUB_OFFLINE="1"), "info", "-hf", f"{REPO}:F32")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "F32" in r.stderr and "HF_HUB_OFFLINE" in r.stderr and "Q8_0" in r.stderr, r.stderr
    r = _cli(dict(env, HF_HUB_OFFLINE="1"), "info", "-hf", "acme/Other-GGUF")
    assert r.returncode == 2 and "acme/Other-GGUF is not in the cache" in r.stderr, r.stderr
    assert len(hub.log) == before


def test_interrupted_transfer_resumes(hub, tmp_path, ggufs):
    cut = 10 * 1024 * 1024 + 4096
    assert len(ggufs["big"]) > cut + 1024
    hub.cut_next_get[f"{REPO}/Tiny-F32.gguf"] = cut
    r = _cli(_env(hub, tmp_path), "info", "-hf", f"{REPO}:f32")
    assert r.returncode == 0, r.stderr
    first, again = hub.gets(REPO, "Tiny-F32.gguf")
    # the second request asks for the rest: from what was written (whole read chunks), not from the start
    assert first is None and again.startswith("bytes=") and 0 < int(again[6:].rstrip("-")) <= cut, again
    with open(_file_line(r.stdout), "rb") as f:
        assert f.read() == ggufs["big"]


def test_missing_repo_file_quant_are_typed_errors(hub, tmp_path):
    env = _env(hub, tmp_path)
    for args, want in ((["-hf", "acme/Nothing-GGUF"], "no model repository acme/Nothing-GGUF"),
                       (["-hf", f"{REPO}:Q5_K_S"], "has no Q5_K_S GGUF; its quants: F32, Q8_0"),
                       (["-hf", f"{REPO}:Tiny-Q2_K.gguf"], "has no file 'Tiny-Q2_K.gguf'; its GGUF files: "
                                                           "Tiny-F32.gguf, Tiny-Q8_0.gguf"),
                       (["-hf", "not-a-repo"], "-hf wants OWNER/REPO")):
        r = _cli(env, "info", *args)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], (args, r.stderr)
    assert not any(m == "GET" and "/resolve/" in p for m, p, _ in hub.log), "a file was fetched for an error"
    for args in (["-m", "x.gguf", "-hf", REPO], ["-hff", "Tiny-Q8_0.gguf"]):
        r = _cli(env, "info", *args)
        assert r.returncode == 2 and ("-hf" in r.stderr), (args, r.stderr)


def test_engine_load_hf_generates_and_sends_the_token(hub, tmp_path):
    code = ("from hybridinfer.engine.api import Engine\n"
            f"with Engine.load(hf={REPO + ':Q8_0'!r}, backend='cpu', hf_token='hf_test') as eng:\n"
            "    print(eng.gm.path, eng.image_encoder is not None)\n"
            "    print(len(eng.generate([1, 2, 3], max_tokens=3, temperature=0).tokens))\n"
            f"with Engine.load(hf={REPO + ':Q8_0'!r}, backend='cpu', hf_token='hf_test', mmproj=False) as eng:\n"
            "    print(eng.image_encoder is None)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(hub, tmp_path),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    path, tower, n, without = r.stdout.split()
    # the projector beside the model came with it (llama.cpp's -hf), and mmproj=False leaves it out
    assert path.endswith("Tiny-Q8_0.gguf") and tower == "True" and n == "3" and without == "True"
    files = [a for (m, p, _), a in zip(hub.log, hub.auth, strict=True) if "/resolve/" in p or "/tree/" in p]
    assert files and all(a == "Bearer hf_test" for a in files), files


def test_parse_spec():
    assert parse_spec("a/b") == HubSpec("a/b")
    assert parse_spec("a/b:q4_k_m") == HubSpec("a/b", "q4_k_m")
    assert parse_spec("a/b:sub/x-Q8_0.gguf") == HubSpec("a/b", None, "sub/x-Q8_0.gguf")
    assert parse_spec("a/b:Q8_0", file="y.gguf") == HubSpec("a/b", None, "y.gguf")
    for bad in ("a", "a/b/c", "/b", "a b/c", ""):
        with pytest.raises(HubError, match="OWNER/REPO"):
            parse_spec(bad)


def test_pick_files_as_llama_cpp():
    files = ["README.md", "Qwen3.5-9B-Q4_K_M.gguf", "Qwen3.5-9B-Q4_K_S.gguf", "Qwen3.5-9B-UD-Q4_K_XL.gguf",
             "Qwen3.5-9B-Q8_0.gguf", "mmproj-F16.gguf", "BF16/Qwen3.5-9B-BF16-00001-of-00002.gguf",
             "BF16/Qwen3.5-9B-BF16-00002-of-00002.gguf"]
    assert pick_files(parse_spec("q/m"), files) == ["Qwen3.5-9B-Q4_K_M.gguf"]  # the default quant
    assert pick_files(parse_spec("q/m:q4_k_s"), files) == ["Qwen3.5-9B-Q4_K_S.gguf"]
    assert pick_files(parse_spec("q/m:Q4_K_XL"), files) == ["Qwen3.5-9B-UD-Q4_K_XL.gguf"]
    assert pick_files(parse_spec("q/m:bf16"), files) == ["BF16/Qwen3.5-9B-BF16-00001-of-00002.gguf",
                                                         "BF16/Qwen3.5-9B-BF16-00002-of-00002.gguf"]
    # no Q4_K_M: the first GGUF (never the vision projector)
    assert pick_files(parse_spec("q/m"), ["mmproj-a.gguf", "m-Q8_0.gguf", "m-F16.gguf"]) == ["m-F16.gguf"]
    with pytest.raises(HubError, match="its quants: BF16, Q4_K_M, Q4_K_S, Q8_0, UD-Q4_K_XL"):
        pick_files(parse_spec("q/m:IQ2_XXS"), files)
    with pytest.raises(HubError, match="holds no GGUF"):
        pick_files(parse_spec("q/m"), ["README.md", "model.safetensors"])
    assert quant_tag("x/Qwen3.5-35B-A3B-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL"
    assert quant_tag("model.gguf") is None
    assert available_quants(["a-Q8_0.gguf", "a-q4_0.gguf"]) == ["q4_0", "Q8_0"]


def test_split_gguf_is_refused_before_download(hub, tmp_path, ggufs):
    hub.repos["acme/Split-GGUF"] = {"S-Q8_0-00001-of-00002.gguf": ggufs["small"],
                                    "S-Q8_0-00002-of-00002.gguf": ggufs["small"]}
    r = _cli(_env(hub, tmp_path), "info", "-hf", "acme/Split-GGUF:Q8_0")
    assert r.returncode == 2 and "split GGUF in 2 parts" in r.stderr, r.stderr
    assert not any("/resolve/" in p for _, p, _ in hub.log)


def test_best_mmproj_as_llama_cpp():
    """The vision projector beside a model, as llama.cpp's -hf picks it: a folder the model sits in (deepest first),
    the exact quant tag asked for, else the closest width to the model's."""
    from hybridinfer.format.hub import best_mmproj

    files = ["Qwen3.5-9B-Q4_K_M.gguf", "mmproj-F16.gguf", "mmproj-F32.gguf", "mmproj-BF16.gguf",
             "Q8_0/Qwen3.5-9B-Q8_0.gguf", "Q8_0/mmproj-Q8_0.gguf", "other/mmproj-F16.gguf", "README.md"]
    assert best_mmproj(files, "Qwen3.5-9B-Q4_K_M.gguf") in ("mmproj-F16.gguf", "mmproj-BF16.gguf")
    assert best_mmproj(files, "Qwen3.5-9B-Q4_K_M.gguf", "F32") == "mmproj-F32.gguf"  # the exact tag asked for
    assert best_mmproj(files, "Q8_0/Qwen3.5-9B-Q8_0.gguf") == "Q8_0/mmproj-Q8_0.gguf"  # its own folder first
    assert best_mmproj(["m-Q4_K_M.gguf", "sub/mmproj-F16.gguf"], "m-Q4_K_M.gguf") is None  # not beside it
    assert best_mmproj(["m-Q4_K_M.gguf"], "m-Q4_K_M.gguf") is None


def test_resolve_pair_fetches_the_projector_beside_the_model(hub, tmp_path, ggufs):
    """resolve_pair downloads the repository's mmproj beside the model (in a process of its own, on the fake hub,
    as the other transfers here: the suite's own process may be offline)."""
    code = ("from hybridinfer.format.hub import resolve_pair\n"
            f"m, mm = resolve_pair({REPO + ':Q8_0'!r}, progress=False)\n"
            f"m2, none = resolve_pair({REPO + ':Q8_0'!r}, progress=False, mmproj=False)\n"
            "print(m); print(mm); print(m2 == m and none is None)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(hub, tmp_path),
                       timeout=120)
    assert r.returncode == 0, r.stderr
    model, mm, same = r.stdout.split()
    assert model.endswith("Tiny-Q8_0.gguf") and mm.endswith("mmproj-Tiny-F16.gguf") and same == "True"
    with open(mm, "rb") as f:
        assert f.read() == ggufs["mmproj"]


def test_cli_takes_the_projector_unless_told_not_to(monkeypatch):
    """-hf puts the repository's mmproj in --mmproj's place unless --mmproj names one or --no-mmproj is given; a
    command without --mmproj (info) never asks for it."""
    import argparse

    import hybridinfer.format.hub as hub_mod
    from hybridinfer.cli.args import resolve_hf

    asked = []

    def fake(repo, file=None, token=None, progress=True, mmproj=True):
        asked.append(mmproj)
        return "/m/model.gguf", ("/m/mmproj.gguf" if mmproj else None)

    monkeypatch.setattr(hub_mod, "resolve_pair", fake)
    base = dict(hf_repo=REPO, hf_file=None, hf_token=None, model=None, progress="none")
    for extra, want_asked, want_mm in (({"mmproj": None}, True, "/m/mmproj.gguf"),
                                       ({"mmproj": "/mine.gguf"}, False, "/mine.gguf"),
                                       ({"mmproj": None, "no_mmproj": True}, False, None), ({}, False, "absent")):
        a = argparse.Namespace(**base, **extra)
        resolve_hf(a)
        assert a.model == "/m/model.gguf" and asked[-1] is want_asked
        assert getattr(a, "mmproj", "absent") == want_mm

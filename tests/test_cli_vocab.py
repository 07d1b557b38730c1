"""llama.cpp's vocabulary on the command line: --version, -np/--parallel, -f/--file and `-p -` / `-f -` (stdin),
-t/--threads on every engine command, one temperature story in --help, and llama-server's LLAMA_ARG_*
environment variables for `serve` (a flag given wins; a bad value names its variable)."""

from __future__ import annotations

import inspect
import io
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hybridinfer import __version__
from hybridinfer.cli import _read_prompt, build_parser, main
from hybridinfer.engine.api import Engine
from hybridinfer.errors import ParameterError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_COMMANDS = (["run", "-p", "x"], ["chat"], ["logits", "--text", "x", "-o", "o.npy"], ["serve"],
                   ["batch", "in.jsonl", "-o", "out.jsonl"])


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hybridinfer {__version__}"


@pytest.mark.parametrize("cmd", ENGINE_COMMANDS, ids=lambda c: c[0])
def test_parallel_and_threads_on_every_engine_command(cmd):
    p = build_parser()
    assert p.parse_args(cmd).max_seqs == 8
    assert p.parse_args(cmd + ["-np", "3"]).max_seqs == 3
    assert p.parse_args(cmd + ["--parallel", "5"]).max_seqs == 5
    assert p.parse_args(cmd + ["--max-seqs", "6"]).max_seqs == 6
    assert p.parse_args(cmd + ["-t", "2"]).threads == 2
    assert p.parse_args(cmd + ["--threads", "3"]).threads == 3
    assert p.parse_args(cmd + ["-c", "512"]).n_ctx == 512
    # -np does not swallow -n (max new tokens) where both exist
    if cmd[0] in ("run", "chat"):
        a = p.parse_args(cmd + ["-n", "7", "-np", "2"])
        assert (a.n, a.max_seqs) == (7, 2)


def test_plan_takes_threads():
    a = build_parser().parse_args(["plan", "--shape", "0.8b", "--card", "k80", "-t", "2"])
    assert a.threads == 2 and build_parser().parse_args(["plan", "--shape", "0.8b", "--card", "k80"]).threads is None


def _args(prompt=None, file=None):
    return SimpleNamespace(prompt=prompt, file=file)


def test_read_prompt(tmp_path, monkeypatch):
    assert _read_prompt(_args("hello")) == "hello"
    f = tmp_path / "p.txt"
    f.write_bytes("Bonjour, où est la gare ?\n".encode())
    assert _read_prompt(_args(file=str(f))) == "Bonjour, où est la gare ?"  # one trailing newline dropped
    f.write_bytes(b"two\n\n")
    assert _read_prompt(_args(file=str(f))) == "two\n"
    for args in (_args("-"), _args(file="-")):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"from stdin\n")))
        assert _read_prompt(args) == "from stdin"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))
    with pytest.raises(ParameterError, match="stdin is not UTF-8"):
        _read_prompt(_args(file="-"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    with pytest.raises(ParameterError, match="empty prompt"):
        _read_prompt(_args("-"))
    with pytest.raises(ParameterError, match="nothing.txt"):
        _read_prompt(_args(file=str(tmp_path / "nothing.txt")))
    with pytest.raises(ParameterError, match="is a directory"):
        _read_prompt(_args(file=str(tmp_path)))


def _run(*args, stdin: bytes = b"") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    return subprocess.run([sys.executable, "-m", "hybridinfer", "run", "--backend", "cpu", "--raw", "-n", "4",
                           "--prefix-cache-ram", "0", *args], input=stdin, capture_output=True, timeout=300,
                          env=dict(env, PYTHONPATH=ROOT))


def test_prompt_from_file_and_stdin_answers_as_p(tmp_path):
    text = "The capital of France is"
    want = _run("-p", text)
    assert want.returncode == 0 and want.stdout.strip(), want.stderr
    f = tmp_path / "prompt.txt"
    f.write_text(text + "\n")
    for got in (_run("-f", str(f)), _run("-p", "-", stdin=(text + "\n").encode()),
                _run("-f", "-", stdin=text.encode())):
        assert got.returncode == 0, got.stderr
        assert got.stdout == want.stdout
    r = _run("-p", "x", "-f", str(f))
    assert r.returncode == 2 and b"not allowed with" in r.stderr


def test_one_temperature_story():
    helptext = " ".join(build_parser()._subparsers._group_actions[0].choices["run"].format_help().split())
    assert "(default 0: greedy" in helptext and "0.8" in helptext
    # what the help says of the library and the server: 0.8 where the caller gives no temperature
    assert inspect.signature(Engine.make_request).parameters["temperature"].default == 0.8


@pytest.fixture
def serve_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("LLAMA_") or k == "HYBRIDINFER_API_KEY":
            monkeypatch.delenv(k)
    env = {"LLAMA_ARG_CTX_SIZE": "384", "LLAMA_ARG_PORT": "9123", "LLAMA_ARG_HOST": "127.0.0.2",
           "LLAMA_ARG_THREADS": "2", "LLAMA_ARG_N_PARALLEL": "3", "LLAMA_ARG_BATCH": "64",
           "LLAMA_ARG_CACHE_TYPE_K": "f16", "LLAMA_ARG_MODEL": "/models/x.gguf"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return monkeypatch


def test_llama_arg_environment(serve_env, capsys):
    a = build_parser().parse_args(["serve"])
    assert (a.n_ctx, a.port, a.host, a.threads, a.max_seqs, a.step_tokens, a.cache_type_k, a.model) == (
        384, 9123, "127.0.0.2", 2, 3, 64, "f16", "/models/x.gguf")
    a = build_parser().parse_args(["serve", "-c", "512", "--port", "80", "-np", "1", "-m", "y.gguf"])
    assert (a.n_ctx, a.port, a.max_seqs, a.model) == (512, 80, 1, "y.gguf")  # a flag given wins
    # the other commands read no LLAMA_ARG_* (llama-server's variables are the server's)
    assert build_parser().parse_args(["run", "-p", "x"]).n_ctx is None
    helptext = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for var in ("LLAMA_ARG_CTX_SIZE", "LLAMA_ARG_PORT", "LLAMA_ARG_N_PARALLEL", "LLAMA_ARG_ALIAS", "LLAMA_API_KEY"):
        assert var in helptext, var
    serve_env.setenv("LLAMA_ARG_PORT", "http")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "LLAMA_ARG_PORT" in err and "'http'" in err and len(err.strip().splitlines()) == 1, err


def test_llama_alias_and_api_key_reach_the_app(serve_env, monkeypatch):
    import hybridinfer.serving.serve as serve_pkg

    pytest.importorskip("fastapi")
    seen = {}
    monkeypatch.setattr(serve_pkg, "create_app", lambda engine, **kw: seen.update(kw) or engine.close())
    monkeypatch.setattr(serve_pkg, "serve", lambda app, host, port, log_level: seen.update(host=host, port=port))
    for k in ("LLAMA_ARG_MODEL", "LLAMA_ARG_CACHE_TYPE_K"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("LLAMA_ARG_ALIAS", "qwen")
    monkeypatch.setenv("LLAMA_API_KEY", "sekrit")
    assert main(["serve", "--backend", "cpu", "--prefix-cache-ram", "0"]) == 0
    assert seen["model_name"] == ["qwen"] and seen["api_key"] == ["sekrit"]
    assert (seen["host"], seen["port"]) == ("127.0.0.2", 9123)
    assert main(["serve", "--backend", "cpu", "--prefix-cache-ram", "0", "--alias", "mine"]) == 0
    assert seen["model_name"] == ["mine"]  # the flag, not the variable


def test_llama_hf_repo_environment_never_beats_a_flag(serve_env):
    import hybridinfer.format.hub as hub
    from hybridinfer.cli.args import resolve_hf

    asked = []
    serve_env.setattr(hub, "resolve_pair",
                      lambda repo, file=None, **kw: (asked.append((repo, file)) or f"/c/{repo}.gguf", None))
    serve_env.delenv("LLAMA_ARG_MODEL")
    serve_env.setenv("LLAMA_ARG_HF_REPO", "acme/env-GGUF:Q8_0")
    serve_env.setenv("LLAMA_ARG_HF_FILE", "x.gguf")
    for argv, model, want in ((["serve"], "/c/acme/env-GGUF:Q8_0.gguf", [("acme/env-GGUF:Q8_0", "x.gguf")]),
                              (["serve", "-m", "mine.gguf"], "mine.gguf", []),
                              (["serve", "-hf", "acme/flag-GGUF"], "/c/acme/flag-GGUF.gguf",
                               [("acme/flag-GGUF", None)])):
        asked.clear()
        a = build_parser().parse_args(argv)
        resolve_hf(a)
        assert (a.model, asked) == (model, want), argv
    helptext = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "LLAMA_ARG_HF_REPO" in helptext and "LLAMA_ARG_HF_FILE" in helptext

"""Every bad value a user can give the command line: status 2, exactly one line on stderr naming the value, no
traceback. Run in-process on the embedded SmolLM2 (`--backend cpu`; most cases fail before the model loads)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from bounded import bounded

from hybridinfer.cli import UsageError, main

RUN = ["run", "--backend", "cpu"]
LOGITS = ["logits", "--backend", "cpu"]
SYNTH = ["synth", "--arch", "llama"]
SHAPE = '{"n_embd": 64, "n_layer": 1, "n_head": 2, "n_ff": 64, "n_vocab": 300%s}'

# (argv with {tmp} for a fresh folder, {file} for a regular file, {bad} for a GGUF with head_count 0;
#  text the one line must contain)
CASES = [
    (RUN + ["--raw", "-p", ""], "''"),
    (RUN + ["-p", ""], "''"),
    (RUN + ["-n", "-3", "-p", "hi"], "-3"),
    (RUN + ["-n", "x", "-p", "hi"], "'x'"),
    (RUN + ["-n", "2.5", "-p", "hi"], "'2.5'"),
    (RUN + ["--temp", "-1", "-p", "hi"], "-1"),
    (RUN + ["--temp", "nan", "-p", "hi"], "'nan'"),
    (RUN + ["--temp", "inf", "-p", "hi"], "'inf'"),
    (RUN + ["--top-p", "0", "-p", "hi"], "top_p must be in (0, 1], got 0.0"),
    (RUN + ["--top-p", "1.5", "-p", "hi"], "1.5"),
    (RUN + ["--top-k", "-5", "-p", "hi"], "'-5'"),
    (RUN + ["--top-k", "2.5", "-p", "hi"], "'2.5'"),
    (RUN + ["--min-p", "1", "-p", "hi"], "min_p must be in [0, 1), got 1.0"),
    (RUN + ["--repeat-penalty", "0", "-p", "hi"], "repeat_penalty must be > 0, got 0.0"),
    (RUN + ["--repeat-penalty", "nan", "-p", "hi"], "'nan'"),
    (RUN + ["--seed", "x", "-p", "hi"], "'x'"),
    (RUN + ["--stop", "", "-p", "hi"], "''"),
    (RUN + ["-t", "0", "-p", "hi"], "'0'"),
    (RUN + ["-t", "-4", "-p", "hi"], "'-4'"),
    (RUN + ["--isa", "bogus", "-p", "hi"], "'bogus'"),
    (RUN + ["--snapshot-stride", "-1", "-p", "hi"], "'-1'"),
    (RUN + ["--n-ctx", "0", "-p", "hi"], "'0'"),
    (RUN + ["--n-ctx", "-5", "-p", "hi"], "'-5'"),
    (RUN + ["--n-ctx", "8", "-p", "hi"], "n_ctx=8"),
    (RUN + ["--state-budget", "1KiB", "-p", "hi"], "state budget of 1024 bytes"),
    (RUN + ["--max-seqs", "0", "-p", "hi"], "'0'"),
    (RUN + ["--vram-budget", "garbage", "-p", "hi"], "'garbage'"),
    (RUN + ["--vram-budget", "inf", "-p", "hi"], "'inf'"),
    (RUN + ["--prefix-cache-ram", "-1", "-p", "hi"], "'-1'"),
    (RUN + ["--prefix-cache-disk", "12 parsecs", "-p", "hi"], "'12 parsecs'"),
    (RUN + ["--backend", "tpu", "-p", "hi"], "'tpu'"),
    (RUN + ["-m", "{tmp}/missing.gguf", "-p", "hi"], "missing.gguf"),
    (RUN + ["-m", "{tmp}", "-p", "hi"], "{tmp}"),
    (RUN + ["-m", "{file}", "-p", "hi"], "{file}"),
    (RUN + ["-m", "{bad}", "-p", "hi"], "head_count = 0"),
    (RUN + ["--prefix-cache-dir", "{file}", "-p", "hi"], "{file}"),
    (RUN + ["--prefix-cache-dir", "{file}/sub", "-p", "hi"], "{file}/sub"),
    (["chat", "--backend", "cpu", "--temp", "-2"], "-2"),
    (["chat", "--backend", "cpu", "--stop", ""], "''"),
    (LOGITS + ["--text", "", "-o", "{tmp}/o.npy"], "''"),
    (LOGITS + ["--tokens", "1,2,999999", "-o", "{tmp}/o.npy"], "999999"),
    (LOGITS + ["--tokens", "1,x", "-o", "{tmp}/o.npy"], "'1,x'"),
    (LOGITS + ["--tokens", ",", "-o", "{tmp}/o.npy"], "','"),
    (LOGITS + ["--tokens", "1,2", "-o", "{tmp}/nowhere/o.npy"], "{tmp}/nowhere"),
    (LOGITS + ["--tokens", "1,2", "-o", "{tmp}"], "{tmp}"),
    (["info", "-m", "{tmp}/missing.gguf"], "missing.gguf"),
    (["info", "-m", "{bad}"], "head_count = 0"),
    (SYNTH + ["--shape", "{bad", "-o", "{tmp}/s.gguf"], "'{bad'"),
    (SYNTH + ["--shape", SHAPE % "", "-o", "{tmp}"], "{tmp}"),
    (SYNTH + ["--shape", SHAPE % "", "-o", "{tmp}/nowhere/s.gguf"], "{tmp}/nowhere"),
    (SYNTH + ["--shape", SHAPE % ', "tied": "false"', "-o", "{tmp}/s.gguf"], "'false'"),
    (SYNTH + ["--shape", SHAPE % ', "rms_eps": -1', "-o", "{tmp}/s.gguf"], "-1"),
    (SYNTH + ["--shape", SHAPE % ', "rope_theta": "1e4"', "-o", "{tmp}/s.gguf"], "'1e4'"),
    (SYNTH + ["--shape", SHAPE % ', "n_layer": 0', "-o", "{tmp}/s.gguf"], "n_layer"),
    (SYNTH + ["--shape", SHAPE % ', "n_vocab": 100000000000000000000', "-o", "{tmp}/s.gguf"],
     "'n_vocab' must be a positive integer at most 2147483647, got 100000000000000000000"),
    (SYNTH + ["--shape", SHAPE % ', "n_head": 128', "-o", "{tmp}/s.gguf"], "head_dim"),
    (SYNTH + ["--shape", "70b", "-o", "{tmp}/s.gguf"], "'70b'"),
    (["synth", "--arch", "mamba", "--shape", "0.8b", "-o", "{tmp}/s.gguf"], "'mamba'"),
    (["synth", "--arch", "qwen35", "--shape", "0.8b", "--quant", "q3", "-o", "{tmp}/s.gguf"], "'q3'"),
    (SYNTH + ["--shape", SHAPE % "", "--seed", "-1", "-o", "{tmp}/s.gguf"], "'-1'"),
    (["bench", "prefill", "-m", "{tmp}/m.gguf", "--prompts", "128,x"], "'128,x'"),
    (["bench", "decode", "-m", "{tmp}/m.gguf", "-t", "0"], "'0'"),
    (["bench", "prefix", "-m", "{tmp}/m.gguf", "--n-prompts", "0"], "'0'"),
    (["run", "-p", "hi", "--bogus-flag"], "--bogus-flag"),
    ([], "required"),
    # issue 29: bytes that are not UTF-8 (Python gives them as lone surrogates), ints past int64, a port past 65535
    (RUN + ["-p", "\udcff\udcfe"], "'\\udcff\\udcfe'"),
    (RUN + ["--system", "a\ud800", "-p", "hi"], "'a\\ud800'"),
    (RUN + ["--seed", "18446744073709551616", "-p", "hi"], "'18446744073709551616'"),
    (RUN + ["--seed", "-9223372036854775809", "-p", "hi"], "'-9223372036854775809'"),
    (RUN + ["-n", "9" * 5000, "-p", "hi"], "'99999"),
    (RUN + ["--prefix-cache-ram", "9223372036854775808", "-p", "hi"], "'9223372036854775808'"),
    (RUN + ["--state-budget", "1e19", "-p", "hi"], "'1e19'"),
    (RUN + ["-t", "9223372036854775807", "-p", "hi"], "must be <= 4096, got '9223372036854775807'"),
    (["serve", "--port", "70000"], "'70000'"),  # (port 0 and the other serve flags: the walk below, parse only)
    (["serve", "--port", "http"], "'http'"),
    (["plan", "--card", "k80", "--shape", "0.8b", "--host-bw", "10", "--prompts", "0"], "'0'"),
    (["plan", "--card", "k80", "--shape", "0.8b", "--host-bw", "10", "--prompts", "128,9223372036854775808"],
     "'128,9223372036854775808'"),
    (["bench", "prefill", "-m", "{tmp}/m.gguf", "--prompts", "9223372036854775808"], "'9223372036854775808'"),
    (["bench", "batch-job", "--seed", "1.5"], "'1.5'"),
    (["info", "-m", "{tmp}/\udcff.gguf"], "'{tmp}/\\udcff.gguf'"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from gguf_edit import rewrite

    from hybridinfer.tools.synth import synth_model

    d = tmp_path_factory.mktemp("cli")
    plain = d / "plain.txt"
    plain.write_text("not a model\n")
    good = synth_model(d / "good.gguf", "llama", dict(n_embd=64, n_layer=1, n_head=2, n_ff=64, n_vocab=300),
                       quant="q8_0")["path"]
    bad = d / "bad.gguf"
    rewrite(str(good), str(bad), meta={"llama.attention.head_count": 0})
    return {"file": str(plain), "bad": str(bad), "good": str(good)}


def _one_error_line(err: str, want: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert want in lines[0], (want, lines[0])
    assert "error" in lines[0]


@pytest.mark.parametrize(("argv", "want"), CASES, ids=[" ".join(a)[:70] for a, _ in CASES])
def test_bad_value_is_one_line_and_status_2(argv, want, tmp_path, paths, capsys, monkeypatch):
    monkeypatch.delenv("HYBRIDINFER_ISA", raising=False)
    monkeypatch.delenv("HYBRIDINFER_PREFIX_CACHE_DIR", raising=False)
    subst = {"{tmp}": str(tmp_path), "{file}": paths["file"], "{bad}": paths["bad"]}

    def fill(s: str) -> str:
        for k, v in subst.items():
            s = s.replace(k, v)
        return s

    rc = main([fill(x) if not x.startswith('{"') else x for x in argv])
    _one_error_line(capsys.readouterr().err, fill(want))
    assert rc == 2


def _subparsers(parser, path=()):
    """(argv prefix, parser) of every command and subcommand."""
    import argparse

    for act in parser._actions:
        if isinstance(act, argparse._SubParsersAction):
            for name, sub in act.choices.items():
                yield path + (name,), sub
                yield from _subparsers(sub, path + (name,))


def _bad_values(t) -> list[str]:
    """Values the flag's type must refuse: garbage always, then each end of its range passed by one."""
    from hybridinfer.cli.args import INT64_MAX, _finite, gb_per_s, parse_size

    bad = ["x", ""]
    if getattr(t, "bounds", None):
        lo, hi = t.bounds
        bad += [str(lo - 1), str(hi + 1), "2.5", "9" * 5000]
    elif t in (_finite, gb_per_s):
        bad += ["nan", "-inf", "1e400"]
    elif t is parse_size:
        bad += ["-1", str(INT64_MAX + 1), "1e400"]
    return bad


def test_every_numeric_flag_is_checked_at_parse_time(capsys):
    """Each typed flag of every command (run, chat, logits, serve, batch, bench *, info, plan, synth), given garbage
    or one past either end of its range: status 2 and one line naming the value, before anything runs. No flag takes
    a bare int or float (unbounded, or nan)."""
    from hybridinfer.cli import build_parser

    parser = build_parser()  # one parser for every try: main() would build it anew each time (1000 tries)
    tried, failed = 0, []
    for path, sub in _subparsers(parser):
        for act in sub._actions:
            if not act.option_strings or act.type is None:
                continue
            assert act.type not in (int, float), (path, act.option_strings)
            for value in _bad_values(act.type):
                argv = [*path, f"{act.option_strings[-1]}={value}"]  # "=": a value may start with "-"
                try:
                    parser.parse_args(argv)
                    rc = 0
                except UsageError as e:  # what main() turns into status 2
                    rc = e.code
                err = capsys.readouterr().err
                lines = [ln for ln in err.splitlines() if ln.strip()]
                tried += 1
                if rc != 2 or len(lines) != 1 or "Traceback" in err or repr(value)[:60] not in lines[0]:
                    failed.append((argv[:-1], value[:20], rc, err[-300:]))
    assert tried > 150, tried  # the walk reached every command's flags
    assert not failed, failed


def test_top_k_past_int64_is_refused_not_hung(capsys):
    """The issue's `run --top-k 9223372036854775808`, which hung the sampler's scheduler: one line before any model
    loads (bounded in time, so a regression fails here instead of hanging)."""
    got = bounded(lambda: main(RUN + ["--top-k", "9223372036854775808", "-p", "hi"]), timeout=120)
    assert got.get("value") == 2, got
    _one_error_line(capsys.readouterr().err, "argument --top-k: must be <= 9223372036854775807, got "
                                             "'9223372036854775808'")


def test_undecodable_argument_bytes_in_a_real_process():
    """The bytes a shell passes for $'\\xff\\xfe': one line and status 2 before any model is read."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "hybridinfer", "run", "--backend", "cpu", "-p", b"\xff\xfe"],
                       capture_output=True, env=env, timeout=120)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err
    _one_error_line(err, "not UTF-8 text: '\\udcff\\udcfe'")


def test_chat_line_that_is_not_utf8_is_skipped():
    """A chat line of bytes that are not UTF-8: one error line, the line skipped, the session going on."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "hybridinfer", "chat", "--backend", "cpu", "-n", "2", "--stats"],
                       input=b"bad \xff\xfe\nHi\n/exit\n", capture_output=True, env=env, timeout=300)
    err = r.stderr.decode("utf-8", "replace").splitlines()
    assert r.returncode == 0 and "Traceback" not in r.stderr.decode(), err
    assert err[0] == "hybridinfer: error: the line is not UTF-8 text, skipped: 'bad \\udcff\\udcfe'", err
    assert len(err) == 2 and err[1].startswith("[prompt "), err  # "Hi" was answered


def test_environment_values_are_checked(capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDINFER_ISA", "sse9")
    assert main(RUN + ["-p", "hi"]) == 2
    _one_error_line(capsys.readouterr().err, "'sse9'")


def test_tensor_type_usage_error(tmp_path, capsys):
    # a usage error raised past argparse: SystemExit with status 2 (the process exits 2), its text the message
    with pytest.raises(UsageError) as ei:
        main(SYNTH + ["--shape", SHAPE % "", "--tensor-type", "attn_q", "-o", str(tmp_path / "s.gguf")])
    assert ei.value.code == 2 and "PATTERN=TYPE" in str(ei.value)
    _one_error_line(capsys.readouterr().err, "'attn_q'")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes any folder")
def test_unreadable_prefix_cache_dir(tmp_path, capsys):
    d = tmp_path / "locked"
    d.mkdir(mode=0o000)
    try:
        assert main(RUN + ["--prefix-cache-dir", str(d), "-p", "hi", "-n", "1"]) == 2
    finally:
        d.chmod(0o700)
    _one_error_line(capsys.readouterr().err, str(d))


def test_good_values_still_run(tmp_path, capsys):
    out = tmp_path / "o.npy"
    assert main(LOGITS + ["--tokens", "1,2,3", "-o", str(out)]) == 0 and out.exists()
    assert main(RUN + ["--raw", "-p", "Hi", "-n", "2", "--top-k", "0", "--seed", "-7", "--temp", "0.5"]) == 0
    # the ends of the int64 flags' ranges run (top_k past the vocabulary is no limit, a seed is 64 bits)
    assert main(RUN + ["--raw", "-p", "Hi", "-n", "2", "--top-k", str(2**63 - 1), "--seed", str(2**64 - 1),
                       "--temp", "0.5"]) == 0
    assert capsys.readouterr().err == ""


def test_closed_pipe_is_quiet(tmp_path):
    err = tmp_path / "err.txt"
    cmd = (f"{sys.executable} -m hybridinfer run --backend cpu --raw -p '1, 2, 3, 4,' -n 48 2>{err} | head -c 1; "
           "exit ${PIPESTATUS[0]}")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert len(r.stdout) == 1
    assert err.read_text() == ""
    assert r.returncode in (0, 141)  # 0 only if the whole answer fit the pipe before head closed it


# --- the library's own checks (what the CLI relies on, for API users too) ------------------------------------------

@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "0.5", None, True])
def test_sampling_params_reject_non_finite(name, value):
    from hybridinfer.engine.sampling import SamplingParams
    from hybridinfer.errors import HybridInferError, ParameterError

    with pytest.raises(ParameterError, match=name) as ei:
        SamplingParams(**{name: value})
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, HybridInferError)
    assert repr(value) in str(ei.value)


@pytest.mark.parametrize(("kw", "pattern"), [
    (dict(n_ctx=0), "n_ctx must be >= 1, got 0"),
    (dict(n_ctx=2.5), "n_ctx must be an integer, got 2.5"),
    (dict(prefill_chunk=0), "prefill_chunk must be >= 1, got 0"),
    (dict(snapshot_stride=-1), "snapshot_stride must be >= 0, got -1"),
    (dict(backend="cpu", n_threads=0), "n_threads must be >= 1, got 0"),
    (dict(backend="cpu", n_threads=2**40), "n_threads must be <= 4096, got 1099511627776"),
    (dict(backend="cpu", isa="sse9"), "'sse9'"),
])
def test_engine_load_checks_values_before_opening(tmp_path, kw, pattern):
    from hybridinfer.engine.api import Engine
    from hybridinfer.errors import ParameterError

    with pytest.raises(ParameterError, match=pattern):
        Engine.load(str(tmp_path / "never-opened.gguf"), **kw)


def test_engine_stream_checks_values(paths, tmp_path):
    from hybridinfer.engine.api import Engine
    from hybridinfer.errors import ParameterError

    eng = Engine.load(paths["good"], backend="reference", n_ctx=64)
    for kw, pattern in [(dict(max_tokens=-1), "max_tokens must be >= 0, got -1"),
                        (dict(max_tokens=2.5), "max_tokens must be an integer, got 2.5"),
                        (dict(max_tokens=True), "max_tokens must be an integer, got True"),
                        (dict(stop=""), "non-empty str, got ''"), (dict(stop=["ok", 3]), "got 3"),
                        (dict(temperature=float("nan")), "temperature must be a finite number, got nan")]:
        with pytest.raises(ParameterError, match=pattern):
            eng.generate("hi", **kw)
    with pytest.raises(ParameterError, match="prompt '' gives no tokens"):
        eng.generate("", max_tokens=1)
    with pytest.raises(ParameterError, match="token id 300 is outside the vocabulary"):
        eng.generate([1, 300], max_tokens=1)
    with pytest.raises(ParameterError, match="token id -2"):
        eng.logits([-2])
    with pytest.raises(ParameterError, match="prefix cache folder .*not a directory"):
        Engine.load(paths["good"], backend="reference", prefix_cache={"disk_dir": paths["file"]})
    with pytest.raises(ParameterError, match="ram_bytes"):
        Engine.load(paths["good"], backend="reference", prefix_cache={"ram_bytes": -1})
    assert eng.generate("hi", max_tokens=2, temperature=0).finish_reason in ("stop", "length")

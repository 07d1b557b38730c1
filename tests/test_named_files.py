"""Files a user names, read or written (issue 29): a FIFO or a device is refused before it is opened for reading (no
hang on a FIFO with no writer, no endless read of /dev/zero), a template file is size-limited, `logits -o` writes
exactly the name given and says a failed write in one line, and a model whose weights are NaN is refused at load.
Every read that could block runs in a thread bounded in time, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest
from bounded import bounded

from hybridinfer.cli import main

RUN = ["run", "--backend", "cpu", "-p", "hi", "-n", "1"]


def _one_line(err: str, *want: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    for w in want:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def fifo(tmp_path):
    path = str(tmp_path / "pipe")
    os.mkfifo(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model

    d = tmp_path_factory.mktemp("named")
    # a vocabulary large enough that token_embd (139 KB) is sampled, not read whole
    return synth_model(d / "tiny.gguf", "llama", dict(n_embd=64, n_layer=1, n_head=2, n_ff=64, n_vocab=2048),
                       quant="q8_0")["path"]


# --- reading: FIFOs and devices --------------------------------------------------------------------------------------

def test_engine_load_refuses_a_fifo(fifo):
    from hybridinfer.engine.api import Engine
    from hybridinfer.errors import GGUFError

    got = bounded(lambda: Engine.load(fifo, backend="reference"), fifo)
    assert isinstance(got.get("error"), GGUFError), got
    assert f"cannot open model file {fifo!r}: it is a FIFO, not a regular file" in str(got["error"])


@pytest.mark.parametrize("argv", [["info", "-m", "{path}"], ["info", "{path}"], RUN + ["-m", "{path}"],
                                  ["logits", "--backend", "cpu", "--tokens", "1", "-o", "{tmp}/o.npy", "-m", "{path}"],
                                  RUN + ["--chat-template-file", "{path}"]],
                         ids=["info -m", "info", "run -m", "logits -m", "run --chat-template-file"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_cli_refuses_fifos_and_devices(argv, kind, fifo, tmp_path, capsys):
    # /dev/null, not /dev/zero: a regression must fail here, not read an endless device in this process
    path = fifo if kind == "fifo" else "/dev/null"
    argv = [a.replace("{path}", path).replace("{tmp}", str(tmp_path)) for a in argv]
    got = bounded(lambda: main(argv), fifo)
    assert got.get("value") == 2, got
    _one_line(capsys.readouterr().err, repr(path), "a FIFO" if kind == "fifo" else "a character device",
              "not a regular file")


def test_template_of_dev_zero_is_refused_before_reading(tmp_path):
    """The issue's `--chat-template-file /dev/zero`, which read until the OOM killer came: in a process whose address
    space is capped at 4 GiB, so that even a regression ends in a MemoryError here, not in the machine's swap."""
    cap = 4 << 30

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "hybridinfer", *RUN, "--chat-template-file", "/dev/zero"],
                       capture_output=True, text=True, env=env, preexec_fn=limit, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    _one_line(r.stderr, "--chat-template-file '/dev/zero' is a character device, not a regular file")


def test_template_file_size_is_limited(tmp_path, smollm_path, capsys):
    from hybridinfer.format.chat_template import MAX_TEMPLATE_FILE_BYTES, read_template_file

    big = tmp_path / "big.jinja"
    big.write_bytes(b"{# #}" + b" " * MAX_TEMPLATE_FILE_BYTES)
    assert main(RUN + ["-m", smollm_path, "--chat-template-file", str(big)]) == 2
    _one_line(capsys.readouterr().err, repr(str(big)), f"over the limit of {MAX_TEMPLATE_FILE_BYTES} bytes")
    # at the limit it is read, its newlines as text mode reads them
    ok = tmp_path / "ok.jinja"
    ok.write_bytes(b"a\r\nb\rc" + b" " * (MAX_TEMPLATE_FILE_BYTES - 6))
    assert read_template_file(str(ok)).startswith("a\nb\nc ")


def test_prefix_cache_still_refuses_fifos(fifo):
    """The cache's reader, now the shared one: its own typed error, a miss to the store."""
    from hybridinfer.engine.prefix.snapshot import NotAFileError, read_header

    got = bounded(lambda: read_header(fifo), fifo)
    assert isinstance(got.get("error"), NotAFileError) and "a FIFO" in str(got["error"]), got


# --- writing: logits -o ----------------------------------------------------------------------------------------------

LOGITS = ["logits", "--backend", "cpu", "--tokens", "1,2,3", "-o"]


def test_logits_writes_exactly_the_name_given(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(LOGITS + [str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: logits (3, ")
    assert not (tmp_path / "out.npy").exists()
    assert np.load(out).shape[0] == 3


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/full"])
def test_logits_refuses_an_output_that_is_not_a_regular_file(kind, fifo, tmp_path, capsys):
    path = fifo
    if kind != "fifo":
        path = str(tmp_path / "full")
        os.symlink("/dev/full", path)
    got = bounded(lambda: main(LOGITS + [path]), fifo)
    assert got.get("value") == 2, got
    _one_line(capsys.readouterr().err, repr(path), "not a regular file")
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in {fifo, path})  # no .npy beside


def test_logits_write_error_is_one_line(tmp_path):
    """A write that fails (here a file-size limit, as a full disk fails it): one line naming the file, status 2, no
    partial file left."""
    out = tmp_path / "o.npy"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write returns EFBIG instead of the signal killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "hybridinfer", *LOGITS, str(out)], capture_output=True, text=True,
                       env=env, preexec_fn=limit, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    _one_line(r.stderr, repr(str(out)), "File too large")
    assert not out.exists()


# --- a damaged model: NaN weights ------------------------------------------------------------------------------------

def _damaged(src: str, dst: str) -> str:
    """A copy of `src` whose whole tensor data region is 0xFF bytes (NaN in every float and every block scale)."""
    from hybridinfer.format.gguf_model import GGUFModel

    start = GGUFModel(src).data_offset
    with open(src, "rb") as f:
        data = bytearray(f.read())
    data[start:] = b"\xff" * (len(data) - start)
    with open(dst, "wb") as f:
        f.write(data)
    return dst


def test_model_of_nan_weights_is_refused(tiny, tmp_path, capsys):
    from hybridinfer.engine.api import Engine
    from hybridinfer.errors import NonFiniteWeightsError

    bad = _damaged(tiny, str(tmp_path / "ff.gguf"))
    with pytest.raises(NonFiniteWeightsError, match=r"tensor '.+' \(\w+\) holds nan"):
        Engine.load(bad, backend="reference")
    assert main(["run", "--backend", "cpu", "-m", bad, "-p", "hi", "-n", "1"]) == 2
    _one_line(capsys.readouterr().err, repr(bad), "holds nan", "damaged")
    assert main(["info", "-m", bad]) == 0  # info describes it, and says so
    assert "weights:       damaged:" in capsys.readouterr().out
    Engine.load(tiny, backend="reference")  # the intact file loads


@pytest.mark.parametrize(("name", "where"), [("blk.0.attn_norm.weight", 5), ("blk.0.ffn_down.weight", -1),
                                             ("token_embd.weight", None)])
def test_one_non_finite_value_is_named(tiny, tmp_path, name, where):
    """One NaN or inf in a small float tensor (anywhere in it), or a NaN scale in a quantized block the sample
    covers (its last block): refused, naming that tensor."""
    from gguf_edit import rewrite

    from hybridinfer.errors import NonFiniteWeightsError
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.format.quant import block_info, dequantize

    gm = GGUFModel(tiny)
    t = gm.tensors[name]
    if where is not None:
        vals = dequantize(t.raw(), t.qtype, t.shape).copy()
        vals.reshape(-1)[where] = np.inf if where < 0 else np.nan
        rewrite(tiny, str(tmp_path / "m.gguf"), replace={name: vals})
        path = str(tmp_path / "m.gguf")
    else:  # the last Q8_0 block's f16 scale set to NaN, in place
        _, bs = block_info(t.qtype)
        path = str(tmp_path / "m.gguf")
        with open(tiny, "rb") as f:
            data = bytearray(f.read())
        data[t.offset + t.nbytes - bs:t.offset + t.nbytes - bs + 2] = np.float16(np.nan).tobytes()
        with open(path, "wb") as f:
            f.write(data)
    with pytest.raises(NonFiniteWeightsError, match=rf"tensor {name!r}"):
        GGUFModel(path).check_finite()

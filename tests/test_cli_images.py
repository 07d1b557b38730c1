"""`hybridinfer run --image FILE` and `/image FILE` in `hybridinfer chat`, in-process, with a fake vision tower attached
to the engine the CLI loads (tests/fake_vision.py): the answer is Engine.generate's for the same image; a missing
file and a model without a vision tower are clean errors."""

from __future__ import annotations

import io
import sys

import pytest
from fake_vision import FakeEncoder, png
from test_image_engine import SHAPE

import hybridinfer.cli as cli
from hybridinfer.cli import main
from hybridinfer.engine.api import Engine


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model

    d = tmp_path_factory.mktemp("cli_images")
    model, img = d / "q.gguf", d / "cat.png"
    synth_model(str(model), "qwen35", SHAPE, "q4_k_m", seed=5)
    img.write_bytes(png(96, 64, seed=8))
    return str(model), str(img)


@pytest.fixture
def with_tower(monkeypatch):
    real = cli._engine

    def engine(a, quiet=False):
        eng = real(a, quiet)
        eng.image_encoder = FakeEncoder(eng.args.n_embd)
        return eng

    monkeypatch.setattr(cli, "_engine", engine)


def _want(model, img, text, n=4) -> str:
    eng = Engine.load(model, backend="cpu", n_ctx=256)
    eng.image_encoder = FakeEncoder(eng.args.n_embd)
    try:
        msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]
        return eng.generate(msgs, max_tokens=n, temperature=0).text
    finally:
        eng.close()


def test_run_and_chat_with_an_image(files, with_tower, capsys, monkeypatch):
    model, img = files
    want = _want(model, img, "what is it?")
    base = ["-m", model, "--backend", "cpu", "-c", "256", "-n", "4"]
    assert main(["run", *base, "--image", img, "-p", "what is it?"]) == 0
    assert capsys.readouterr().out == want + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"/image {img}\nwhat is it?\n/exit\n"))
    assert main(["chat", *base]) == 0
    assert capsys.readouterr().out == want + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("/image /nonexistent.png\n/exit\n"))
    assert main(["chat", *base]) == 0  # said, and the session goes on
    assert "cannot read image file" in capsys.readouterr().err


def test_run_image_errors(files, capsys):
    model, img = files
    base = ["-m", model, "--backend", "cpu", "-c", "256", "-n", "2", "-p", "hi"]
    assert main(["run", *base, "--image", img]) == 2  # no vision tower loaded
    assert "--mmproj" in capsys.readouterr().err

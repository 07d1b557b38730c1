"""`hybridinfer serve`: flags and environment reach the app; a warning for a non-loopback bind without a key; the
real command answers on 127.0.0.1 and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import hybridinfer.serving.serve as serve_pkg  # noqa: E402
from hybridinfer.cli import main  # noqa: E402


@pytest.fixture
def captured(monkeypatch):
    """The app's arguments and the address the command would bind, with nothing bound."""
    seen = {}
    make = serve_pkg.create_app

    def create_app(engine, **kw):
        seen.update(kw, engine=engine)
        return make(engine, **kw)

    monkeypatch.setattr(serve_pkg, "create_app", create_app)
    monkeypatch.setattr(serve_pkg, "serve", lambda app, host, port, log_level: seen.update(host=host, port=port))
    return seen


def test_serve_flags(captured, capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDINFER_API_KEY", "from-env")
    args = ["serve", "--backend", "cpu", "--n-ctx", "256", "--max-seqs", "2", "--max-queue", "3",
            "--prefix-cache-ram", "0"]
    assert main(args) == 0
    assert captured["api_key"] == ["from-env"] and captured["max_queue"] == 3 and captured["host"] == "127.0.0.1"
    assert captured["port"] == 8080 and captured["engine"].max_seqs == 2 and captured["engine"].n_ctx == 256
    assert captured["close_engine"] is True  # the server's shutdown closes the engine (its lifespan)
    assert "warning" not in capsys.readouterr().err
    assert main(args + ["--api-key", "flag", "--host", "0.0.0.0", "--port", "9"]) == 0
    assert captured["api_key"] == ["flag"] and "warning" not in capsys.readouterr().err
    monkeypatch.delenv("HYBRIDINFER_API_KEY")
    assert main(args + ["--host", "0.0.0.0", "--model-name", "m"]) == 0
    err = capsys.readouterr().err
    assert "warning: serving on 0.0.0.0 without an API key" in err and captured["model_name"] == ["m"]
    assert captured["strict_model_name"] is False
    assert main(args + ["--alias", "a", "-a", "b", "--strict-model-name"]) == 0
    assert captured["model_name"] == ["a", "b"] and captured["strict_model_name"] is True
    assert main(["serve", "--port", "-1"]) == 2


def test_serve_command_answers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HYBRIDINFER_API_KEY": "k"}
    p = subprocess.Popen([sys.executable, "-m", "hybridinfer", "serve", "--backend", "cpu", "--n-ctx", "256",
                          "--port", str(port), "--log-level", "warning"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            assert p.poll() is None, p.communicate()[1]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate(timeout=10)
    # uvicorn shuts down gracefully, then re-raises the signal it caught, so the status is SIGTERM's
    assert p.returncode in (0, -signal.SIGTERM) and "Traceback" not in err, err

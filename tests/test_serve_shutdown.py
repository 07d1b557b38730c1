"""Issue 29, item 9: SIGTERM ends the open streams of `hybridinfer serve` with an error event (and OpenAI's
`[DONE]`) instead of cutting them, and the server exits cleanly. A real server in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

COUNT = "1, 2, 3, 4, 5,"  # greedy SmolLM2 counts on to any length: a stream that runs until stopped


def _serve() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDINFER_API_KEY"}
    p = subprocess.Popen([sys.executable, "-m", "hybridinfer", "serve", "--backend", "cpu", "--n-ctx", "512",
                          "--port", str(port), "--log-level", "warning", "--model-name", "smol"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
    while True:
        assert p.poll() is None, p.communicate()[1]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


async def _streams(p: subprocess.Popen, url: str) -> list[list[str]]:
    """Open three streams (chat, completions, messages), read a few events of each, SIGTERM the server, and read
    each to its end."""
    bodies = [("/v1/chat/completions", {"messages": [{"role": "user", "content": COUNT}]}),
              ("/v1/completions", {"prompt": COUNT}),
              ("/v1/messages", {"messages": [{"role": "user", "content": COUNT}]})]
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async def one(path: str, body: dict, started: asyncio.Event, go: asyncio.Event) -> list[str]:
            body = {"model": "smol", "max_tokens": 400, "temperature": 0, "stream": True, **body}
            async with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if sum(x.startswith("data: ") for x in lines) == 4:
                        started.set()
                        await go.wait()
                return lines

        started = [asyncio.Event() for _ in bodies]
        go = asyncio.Event()
        tasks = [asyncio.create_task(one(path, body, s, go)) for (path, body), s in zip(bodies, started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        p.send_signal(signal.SIGTERM)
        go.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)


def test_sigterm_ends_streams_with_an_error_event():
    p, url = _serve()
    try:
        t0 = time.monotonic()
        chat, completion, messages = asyncio.run(_streams(p, url))
        # uvicorn shuts down gracefully, then re-raises the signal it caught, so the status is SIGTERM's
        _, err = p.communicate(timeout=30)
        assert p.returncode in (0, -signal.SIGTERM) and "Traceback" not in err, err
        assert time.monotonic() - t0 < 30
        for lines in (chat, completion):
            data = [x[6:] for x in lines if x.startswith("data: ")]
            assert data[-1] == "[DONE]", data[-3:]
            err = json.loads(data[-2])["error"]
            assert err["code"] == "server_shutting_down" and "shutting down" in err["message"]
            assert not any('"finish_reason":"length"' in d for d in data)  # cut short, not finished
        events = [x[7:] for x in messages if x.startswith("event: ")]
        assert events[-1] == "error" and "message_stop" not in events
        last = json.loads([x[6:] for x in messages if x.startswith("data: ")][-1])
        assert last["type"] == "error" and last["error"]["type"] == "overloaded_error"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

"""Speculative decoding through the entry points: `hybridinfer run --spec-type ngram` and the server give the same
text as without drafts, and the server counts drafted and accepted tokens on /metrics. SmolLM2 told to repeat a
sentence copies its prompt, which prompt lookup drafts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.isa  # greedy answers: re-run at every ISA level (.ci/run)
ISA = os.environ.get("HYBRIDINFER_ISA")
PROMPT = ("Copy this text exactly: the quick brown fox jumps over the lazy dog and the lazy dog sleeps in the sun. "
          "Copy: the quick brown fox jumps over")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridinfer", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_cli_run_with_ngram_drafts_says_the_same():
    base = ["run", "--raw", "-p", PROMPT, "-n", "24", "--temp", "0", "--backend", "cpu"]
    plain, spec = _cli(*base), _cli(*base, "--spec-type", "ngram", "--draft-max", "4")
    assert plain.returncode == 0 and spec.returncode == 0, (plain.stderr, spec.stderr)
    assert plain.stdout.strip() and spec.stdout == plain.stdout
    bad = _cli(*base, "--draft-max", "5")
    assert bad.returncode != 0 and "--draft-max" in bad.stderr


def test_server_counts_drafts_and_answers_the_same(smollm_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from hybridinfer.serving.serve import create_app

    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    texts, metrics = [], ""
    for spec in ("none", "ngram"):
        eng = Engine.load(smollm_path, backend="cpu", n_ctx=256, isa=ISA, spec_type=spec, draft_max=4)
        with TestClient(create_app(eng, close_engine=True), base_url="http://127.0.0.1") as client:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            metrics = client.get("/metrics").text
    assert texts[0] and texts[1] == texts[0]
    drafted = float(re.search(r"^hybridinfer_draft_tokens_total (\S+)$", metrics, re.M).group(1))
    accepted = float(re.search(r"^hybridinfer_draft_tokens_accepted_total (\S+)$", metrics, re.M).group(1))
    assert drafted > 0 and 0 < accepted <= drafted, (drafted, accepted)

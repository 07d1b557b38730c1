"""Model names in `serve` and `batch`: one loaded model answers whatever `model` a request names (as llama-server),
reporting its own name; --strict-model-name requires the served name or an alias (a 404, an error line in a
batch); -a/--alias, repeatable, with --model-name kept as its synonym."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from batch_records import write_job  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from hybridinfer.cli import build_parser  # noqa: E402
from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.batch import run_job  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402

STEM = "SmolLM2-135M-Instruct.Q4_1"
Q = [{"role": "user", "content": "Hi"}]
CHAT, MSGS = "/v1/chat/completions", "/v1/messages"


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=256, max_seqs=2)
    yield eng
    eng.close()


def _ask(client, path: str, model: str):
    body = {"model": model, "messages": Q, "max_tokens": 2, "temperature": 0}
    return client.post(path, json=body)


def test_any_name_answered_with_the_served_one(engine):
    with TestClient(create_app(engine), base_url="http://127.0.0.1") as c:
        for path, asked in ((CHAT, "gpt-4o"), (MSGS, "claude-sonnet-4"), (CHAT, STEM)):
            r = _ask(c, path, asked)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == STEM
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [STEM]
        assert c.get("/v1/models/gpt-4o").json()["id"] == STEM


def test_aliases_and_strict(engine):
    app = create_app(engine, model_name=["qwen", "qwen-latest"], strict_model_name=True)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        for path in (CHAT, MSGS):
            r = _ask(c, path, "gpt-4o")
            assert r.status_code == 404 and "'qwen', 'qwen-latest'" in r.text, r.text
            assert _ask(c, path, STEM).status_code == 404  # the file's name is no alias once aliases are given
            r = _ask(c, path, "qwen-latest")
            assert r.status_code == 200 and r.json()["model"] == "qwen", r.text
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["qwen", "qwen-latest"]
        assert c.get("/v1/models/qwen-latest").json()["id"] == "qwen-latest"
        assert c.get("/v1/models/gpt-4o").status_code == 404
    with pytest.raises(ValueError, match="non-empty"):
        create_app(engine, model_name=["a", ""])


def test_batch_answers_any_name_unless_strict(engine, tmp_path):
    job = tmp_path / "job.jsonl"
    write_job(job, [{"custom_id": f"r{i}", "method": "POST", "url": CHAT,
                     "body": {"model": m, "messages": Q, "max_tokens": 2, "temperature": 0}}
                    for i, m in enumerate(("gpt-4o-mini", "mine"))])
    out = tmp_path / "lenient.jsonl"
    s = run_job(engine, str(job), str(out))
    recs = {json.loads(x)["custom_id"]: json.loads(x) for x in out.read_text().splitlines()}
    assert s["by_status"] == {"200": 2}
    assert {r["response"]["body"]["model"] for r in recs.values()} == {STEM}

    out = tmp_path / "strict.jsonl"
    s = run_job(engine, str(job), str(out), model_name=["mine"], strict_model_name=True)
    recs = {json.loads(x)["custom_id"]: json.loads(x) for x in out.read_text().splitlines()}
    assert s["by_status"] == {"200": 1, "404": 1}
    assert recs["r0"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert recs["r1"]["response"]["body"]["model"] == "mine"


@pytest.mark.parametrize("cmd", [["serve"], ["batch", "in.jsonl", "-o", "out.jsonl"]])
def test_alias_flags(cmd):
    a = build_parser().parse_args(cmd)
    assert a.alias == [] and a.strict_model_name is False
    a = build_parser().parse_args(cmd + ["-a", "x", "--model-name", "y", "--alias", "z", "--strict-model-name"])
    assert a.alias == ["x", "y", "z"] and a.strict_model_name is True
    helptext = build_parser()._subparsers._group_actions[0].choices[cmd[0]].format_help()
    assert "--model-name" in helptext and "--strict-model-name" in helptext and "llama-server" in helptext

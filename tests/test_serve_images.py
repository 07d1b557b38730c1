"""Images through the server, with the official `openai` and `anthropic` clients, live on loopback with a tiny
synthetic Qwen3.5 and a fake vision tower (tests/fake_vision.py): OpenAI `image_url` data: URLs and Anthropic base64
image blocks, plain and streamed, answer what Engine.generate answers for the same image; remote URLs, bad data and
a model without a vision tower get their 400 and the server goes on; /v1/models and /props say whether the model
takes images."""

from __future__ import annotations

import base64

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from fake_vision import FakeEncoder, png  # noqa: E402
from test_image_engine import SHAPE  # noqa: E402
from test_serve_api import an_client, oa_client, running  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402

MODEL = "tiny-vl"
IMG = png(96, 64, seed=5)
B64 = base64.b64encode(IMG).decode()
DATA_URL = "data:image/png;base64," + B64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model

    path = str(tmp_path_factory.mktemp("serve_images") / "q.gguf")
    synth_model(path, "qwen35", SHAPE, "q4_k_m", seed=4)
    eng = Engine.load(path, backend="cpu", n_ctx=256, n_threads=2, max_seqs=2)
    eng.image_encoder = FakeEncoder(eng.args.n_embd)
    with running(create_app(eng, model_name=MODEL)) as url:
        yield eng, url
    eng.close()


def _want(eng, text="what is it?", n=5) -> str:
    msgs = [{"role": "user", "content": [{"type": "image", "image": IMG}, {"type": "text", "text": text}]}]
    return eng.generate(msgs, max_tokens=n, temperature=0).text


def test_openai_image_url_plain_and_streamed(server):
    eng, url = server
    oa = oa_client(url)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}},
                                         {"type": "text", "text": "what is it?"}]}]
    want = _want(eng)
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens > 2 * 3  # the image's 2 x 3 rows are prompt tokens
    chunks = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_anthropic_base64_image_plain_and_streamed(server):
    eng, url = server
    an = an_client(url)
    msgs = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
        {"type": "text", "text": "what is it?"}]}]
    want = _want(eng)
    r = an.messages.create(model=MODEL, max_tokens=5, messages=msgs, extra_body={"temperature": 0})
    assert "".join(b.text for b in r.content if b.type == "text") == want
    with an.messages.stream(model=MODEL, max_tokens=5, messages=msgs, extra_body={"temperature": 0}) as s:
        assert "".join(s.text_stream) == want


def _bad(oa, url_or_data, match):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_or_data}},
                                         {"type": "text", "text": "hi"}]}]
    with pytest.raises(openai.BadRequestError, match=match):
        oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)


def test_bad_images_get_400_and_the_server_goes_on(server):
    eng, url = server
    oa = oa_client(url)
    _bad(oa, "https://example.com/cat.png", "--allow-remote-images")
    _bad(oa, "data:image/png;base64,!!!!", "base64")
    _bad(oa, "data:image/png;base64," + base64.b64encode(b"junk bytes").decode(),
         r"messages\[0\]\.content\[0\]: not an image")
    _bad(oa, "data:image/png;base64," + base64.b64encode(IMG[:80]).decode(), "corrupt or truncated")
    an = an_client(url)
    with pytest.raises(anthropic.BadRequestError, match="source"):
        an.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "x"}}]}])
    import httpx

    models = oa.models.list().data
    assert models[0].model_extra["capabilities"] == ["completion", "multimodal"]
    assert httpx.get(url + "/props").json()["modalities"]["vision"] is True
    enc, eng.image_encoder = eng.image_encoder, None
    try:
        _bad(oa, DATA_URL, "--mmproj")
        assert "multimodal" not in oa.models.list().data[0].model_extra["capabilities"]
    finally:
        eng.image_encoder = enc
    with pytest.raises(openai.BadRequestError, match="user messages"):
        oa.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]},
            {"role": "user", "content": "and?"}])
    r = oa.chat.completions.create(model=MODEL, max_tokens=2, messages=[  # two user turns in a row, one an image
        {"role": "user", "content": "hello"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]}])
    assert r.choices[0].finish_reason in ("length", "stop")


def test_batch_image_line_and_a_bad_one(server, tmp_path):
    import json

    from batch_records import records, write_job

    from hybridinfer.serving.batch import run_job

    eng, _ = server
    body = lambda url: {"model": MODEL, "max_tokens": 5, "temperature": 0, "messages": [  # noqa: E731
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "what is it?"}]}]}
    line = lambda cid, b: {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": b}  # noqa: E731
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, [line("img", body(DATA_URL)), line("remote", body("http://example.com/x.png")),
                    line("text", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})])
    run_job(eng, str(job), str(out))
    recs = {r["custom_id"]: r for r in records(out).values()}
    assert recs["img"]["response"]["status_code"] == 200
    assert recs["img"]["response"]["body"]["choices"][0]["message"]["content"] == _want(eng)
    bad = recs["remote"]["response"]
    assert bad["status_code"] == 400 and "remote image URLs are not allowed" in json.dumps(bad["body"])
    assert recs["text"]["response"]["status_code"] == 200


def test_anthropic_count_tokens_counts_an_image_by_its_rows(server):
    eng, url = server
    import httpx

    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
              {"type": "text", "text": "what is it?"}]
    r = httpx.post(url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": [
        {"role": "user", "content": blocks}]}).json()
    want = eng.make_request([{"role": "user", "content": [{"type": "image", "image": IMG},
                                                          {"type": "text", "text": "what is it?"}]}])
    assert r["input_tokens"] == len(want.ids)


def test_responses_input_image(server):
    eng, url = server
    r = oa_client(url).responses.create(model=MODEL, max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": DATA_URL},
                                     {"type": "input_text", "text": "what is it?"}]}])
    assert r.output_text == _want(eng)


def test_batch_remote_image_when_allowed(server, tmp_path):
    """--allow-remote-images: an http URL (a loopback server here) is fetched, and answers as the data: URL does."""
    import http.server
    import threading

    from batch_records import records, write_job

    from hybridinfer.serving.batch import run_job

    eng, _ = server

    class One(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(IMG)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), One)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
        job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
        write_job(job, [{"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": MODEL, "max_tokens": 5, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]}]}}])
        run_job(eng, str(job), str(out), allow_remote_images=True)
    finally:
        httpd.shutdown()
    (rec,) = records(out).values()
    assert rec["response"]["body"]["choices"][0]["message"]["content"] == _want(eng)

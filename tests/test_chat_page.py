"""The chat page at / in a real headless Chromium (Debian's chromium and chromium-driver, driven by Selenium),
against a live server on 127.0.0.1 with SmolLM2: the page loads and names the model, a message gets a streamed
answer (several chunks shown as they come), a long generation is stopped by the stop button (its sequence
cancelled on the server), the system prompt and sampling settings go into the request, and <think> text is folded;
with a model that takes images (a fake tower), an attached image goes out as an image_url part and is answered.

Without a browser the test skips, saying why; in CI (CI=true) a missing browser fails it instead."""

from __future__ import annotations

import os
import shutil
import time

import pytest

pytest.importorskip("fastapi")

from test_serve_api import MODEL, running  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def _need(ok: bool, why: str) -> None:
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; CI must run the browser test (.ci/run installs chromium and chromium-driver)")
    pytest.skip(f"{why} (apt-get install chromium chromium-driver; pip install selenium)")


@pytest.fixture(scope="module")
def browser():
    _need(CHROMIUM is not None and DRIVER is not None, "no chromium / chromedriver on PATH")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _need(False, "selenium is not installed")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)  # no driver download
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def served(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=2048, max_seqs=2, isa=os.environ.get("HYBRIDINFER_ISA"))
    app = create_app(eng, model_name=MODEL)
    seen = []
    svc = app.state.service
    start = svc.start_many

    async def recording(request, model, make_call):  # the bodies the page sends
        out = await start(request, model, make_call)
        seen.append(out[0].body)
        return out

    svc.start_many = recording
    with running(app) as url:
        yield url, svc, seen
    eng.close()


def _wait(cond, timeout: float = 90.0, what: str = "the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _send(drv, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = drv.find_element(By.ID, "input")
    box.send_keys(text)
    drv.find_element(By.ID, "send").click()


def _set(drv, id_: str, value: str) -> None:
    drv.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                       "e.dispatchEvent(new Event('change'));", id_, value)


def test_chat_page(browser, served):
    from selenium.webdriver.common.by import By

    url, svc, seen = served
    drv = browser
    drv.get(url + "/")
    _wait(lambda: drv.find_element(By.ID, "model").text == MODEL, what="the model's name")
    _set(drv, "system", "You are terse.")
    _set(drv, "temperature", "0")
    _set(drv, "max_tokens", "24")
    _send(drv, "What is the capital of France?")
    answer = _wait(lambda: next(iter(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-finish]")), None),
                   what="the answer")
    assert answer.get_attribute("data-finish") in ("stop", "length")
    assert answer.find_element(By.CSS_SELECTOR, ".content").text.strip()
    assert int(answer.get_attribute("data-chunks")) > 2  # streamed: shown piece by piece
    body = seen[-1]
    assert body.stream and body.temperature == 0 and body.max_tokens == 24
    assert body.messages[0].role == "system" and body.messages[0].content == "You are terse."
    assert body.messages[-1].content == "What is the capital of France?"
    # a second turn carries the first in its history
    _send(drv, "And of Spain?")
    _wait(lambda: len(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-finish]")) == 2, what="turn 2")
    assert [m.role for m in seen[-1].messages] == ["system", "user", "assistant", "user"]

    # stop: a long generation is cut by the button, and the server lets its sequence go
    _set(drv, "max_tokens", "1500")
    _set(drv, "temperature", "0.8")
    last = lambda: drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]  # noqa: E731
    for _ in range(3):  # a sampled story that ends by itself before the click is told again
        _send(drv, "Write a very long story about a dragon.")
        _wait(lambda: int(last().get_attribute("data-chunks") or 0) > 3, what="the story to stream")
        if last().get_attribute("data-finish") is None:
            drv.find_element(By.ID, "stop").click()
            break
        _wait(lambda: drv.find_element(By.ID, "send").is_displayed(), timeout=10, what="the page to be idle")
    _wait(lambda: last().get_attribute("data-finish") == "stopped", timeout=10, what="the stop")
    _wait(lambda: svc.scheduler.running == 0 and svc.held == 0, timeout=10, what="the server to cancel it")
    assert drv.find_element(By.ID, "send").is_displayed() and not drv.find_element(By.ID, "stop").is_displayed()
    assert len(last().find_element(By.CSS_SELECTOR, ".content").text) > 0

    # reasoning (the server's reasoning_content, or <think> text it did not split off) is folded: a closed
    # <details> element apart from the answer
    got = drv.execute_script("""const c = window.hybridinferChat, d = c.addMessage("assistant", "");
        c.show(d, "first, ", "<think>plan it</think>\\n\\nThe answer");
        const det = d.querySelector("details.reasoning");
        return [det.hidden, det.open, det.querySelector(".reasoning-text").textContent,
                d.querySelector(".content").textContent, det.getBoundingClientRect().height > 0];""")
    assert got == [False, False, "first, plan it", "The answer", True]


@pytest.fixture(scope="module")
def served_vl(tmp_path_factory):
    """A tiny synthetic Qwen3.5 with a fake vision tower (tests/fake_vision.py), live on loopback."""
    from fake_vision import FakeEncoder
    from test_image_engine import SHAPE

    from hybridinfer.tools.synth import synth_model

    path = str(tmp_path_factory.mktemp("page_vl") / "q.gguf")
    synth_model(path, "qwen35", SHAPE, "q4_k_m", seed=4)
    eng = Engine.load(path, backend="cpu", n_ctx=256, max_seqs=2, isa=os.environ.get("HYBRIDINFER_ISA"))
    eng.image_encoder = FakeEncoder(eng.args.n_embd)
    app = create_app(eng, model_name="tiny-vl")
    seen, svc = [], app.state.service
    start = svc.start_many

    async def recording(request, model, make_call):
        out = await start(request, model, make_call)
        seen.append(out[0].body)
        return out

    svc.start_many = recording
    with running(app) as url:
        yield url, seen
    eng.close()


def test_chat_page_sends_an_attached_image(browser, served_vl, tmp_path):
    """Where /v1/models says the model takes images, the page shows its Image button; a file attached there goes
    out as an image_url part with a data: URL beside the text, is shown in the message, and gets an answer; the
    page of a model without images hides the button."""
    from fake_vision import png
    from selenium.webdriver.common.by import By

    url, seen = served_vl
    drv = browser
    drv.get(url + "/")
    _wait(lambda: drv.find_element(By.ID, "model").text == "tiny-vl", what="the model's name")
    _wait(lambda: drv.find_element(By.ID, "attach").is_displayed(), what="the image button")
    f = tmp_path / "cat.png"
    f.write_bytes(png(96, 64, seed=5))
    drv.find_element(By.ID, "image").send_keys(str(f))  # a hidden file input still takes a path
    _wait(lambda: drv.find_elements(By.CSS_SELECTOR, "#attached img"), what="the attached preview")
    _set(drv, "temperature", "0")
    _set(drv, "max_tokens", "4")
    _send(drv, "What is in it?")
    answer = _wait(lambda: next(iter(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-finish]")), None),
                   what="the answer")
    assert answer.get_attribute("data-finish") in ("stop", "length"), answer.text
    assert drv.find_elements(By.CSS_SELECTOR, ".msg.user img")  # the image shown in the user's message
    assert not drv.find_elements(By.CSS_SELECTOR, "#attached img")  # sent: the tray is empty again
    parts = seen[-1].messages[-1].content
    kinds = [getattr(p, "type", None) for p in parts]
    assert kinds == ["text", "image_url"], parts
    iu = parts[1].image_url
    assert (iu["url"] if isinstance(iu, dict) else iu.url).startswith("data:image/png;base64,")


def test_chat_page_hides_the_image_button_without_a_tower(browser, served):
    from selenium.webdriver.common.by import By

    url, _, _ = served
    browser.get(url + "/")
    _wait(lambda: browser.find_element(By.ID, "model").text == MODEL, what="the model's name")
    assert not browser.find_element(By.ID, "attach").is_displayed()

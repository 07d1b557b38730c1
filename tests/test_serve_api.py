"""The server through the official `openai` and `anthropic` clients, live on 127.0.0.1 with SmolLM2: chat and
completions streamed and not, greedy output equal to Engine.generate, the prefix cache's cached_tokens, stop
sequences; tool calls and thinking through a canned engine (SmolLM2 makes neither reliably); count_tokens."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.isa  # sampled and greedy answers: re-run at every ISA level (.ci/run)

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from test_chat_template import QWEN35_TEMPLATE, TOOLS  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.engine.textstream import Generation  # noqa: E402
from hybridinfer.format.chat_text import render_for  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402

MODEL = "smol"
Q = [{"role": "user", "content": "What is 2+2?"}]
GREEDY = {"temperature": 0}  # the anthropic client has no sampling arguments of its own: sent as extra fields


def oa_client(url: str, key: str = "none", timeout: float = 60):
    """The official OpenAI client for a server at `url` (no retries: a refusal shows as it is)."""
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def an_client(url: str, key: str = "none", timeout: float = 60):
    """The official Anthropic client for a server at `url` (no retries)."""
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=timeout)


@contextlib.contextmanager
def running(app, timeout_s: float = 20.0):
    """Serve `app` with uvicorn on a free loopback port in a thread; yields the base URL; stops it after."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        t.join(timeout_s)
        sock.close()


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=1024, max_seqs=4, prefix_cache={"ram_bytes": 64 << 20},
                      isa=os.environ.get("HYBRIDINFER_ISA"))
    yield eng
    eng.close()


def json_prefix(text: str) -> bool:
    """Whether `text` can be continued into a JSON document: some short completion (ending an open string, literal
    or number, a pending value or key, then closing the open containers) makes it parse."""
    closers, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            esc, in_str = (ch == "\\" and not esc), (in_str and (esc or ch != '"'))
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]" and closers:
            closers.pop()
    ends = ['"', 'n"', '0"', '00"', '000"', '0000"'] if in_str else ["", "0", "e", "se", "lse", "alse", "ue", "rue",
                                                                     "l", "ll", "ull"]
    tail = "".join(reversed(closers))
    for end in ends:
        for fill in ("", "null", ":null", '"k":null'):
            try:
                json.loads(text + end + fill + tail)
                return True
            except json.JSONDecodeError:
                pass
    return False


def test_json_prefix_helper():
    for ok in ('{"a": [1, tr', '{"na', '{"name": "Bo\\', '{"x": 1,', '{"x"', '[{"a": -', "{", '{"s": "\\u00'):
        assert json_prefix(ok), ok
    for bad in ('{"a" 1', "[}", '{"a": 1}}', "x", '{"a": tx'):
        assert not json_prefix(bad), bad


@pytest.fixture(scope="module")
def base(engine):
    with running(create_app(engine, model_name=MODEL, report_cached_tokens=True)) as url:
        yield url


@pytest.fixture
def oa(base):
    return oa_client(base, timeout=60)


@pytest.fixture
def an(base):
    return an_client(base, timeout=60)


def test_chat_greedy_equals_generate(engine, oa):
    want = engine.generate(Q, max_tokens=24, temperature=0)
    r = oa.chat.completions.create(model=MODEL, messages=Q, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == want.prompt_tokens and r.usage.completion_tokens == len(want.tokens)
    # the same request again: its whole prompt comes from the prefix cache, the answer unchanged
    r2 = oa.chat.completions.create(model=MODEL, messages=Q, max_completion_tokens=24, temperature=0)
    assert r2.choices[0].message.content == want.text
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    # streamed: the pieces make the same text; usage comes last when asked for
    chunks = list(oa.chat.completions.create(model=MODEL, messages=Q, max_tokens=24, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text and chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)


def test_chat_length_content_parts_and_sampling(engine, oa):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]}]
    want = engine.generate([msgs[0], {"role": "user", "content": "Name a color."}], max_tokens=3, temperature=0)
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "length"
    kw = dict(model=MODEL, messages=Q, max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
              presence_penalty=0.5, frequency_penalty=0, extra_body={"top_k": 20, "min_p": 0.05})
    a, b = (oa.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    assert a == b and a == engine.generate(Q, max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                                           presence_penalty=0.5, top_k=20, min_p=0.05).text


def test_completions(engine, oa):
    want = engine.generate("The capital of France is", max_tokens=8, temperature=0)
    r = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.tokens)
    text = "".join(c.choices[0].text for c in oa.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert text == want.text
    ids = engine.tokenize("1, 2, 3,")
    r = oa.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, stop=[","])
    assert r.choices[0].text == engine.generate(ids, max_tokens=4, temperature=0, stop=[","]).text


def test_logprobs_and_frequency_penalty(engine, oa):
    """logprobs / top_logprobs (chat, streamed and not) and legacy completions logprobs carry the engine's
    Generation.logprobs; frequency_penalty reaches the sampler."""
    want = engine.generate(Q, max_tokens=6, temperature=0, logprobs=2)
    r = oa.chat.completions.create(model=MODEL, messages=Q, max_tokens=6, temperature=0, logprobs=True,
                                   top_logprobs=2)
    got = r.choices[0].logprobs.content
    assert [c.logprob for c in got] == [e["logprob"] for e in want.logprobs]
    assert [c.token for c in got] == [engine.detokenize([e["token"]]) for e in want.logprobs]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-9 for c in got)
    chunks = list(oa.chat.completions.create(model=MODEL, messages=Q, max_tokens=6, temperature=0, stream=True,
                                             logprobs=True, top_logprobs=1))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == [e["logprob"] for e in want.logprobs]
    assert oa.chat.completions.create(model=MODEL, messages=Q, max_tokens=4).choices[0].logprobs is None
    c = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                              logprobs=3)
    w = engine.generate("The capital of France is", max_tokens=4, temperature=0, logprobs=3)
    assert c.choices[0].logprobs.token_logprobs == [e["logprob"] for e in w.logprobs]
    assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text
    assert c.choices[0].logprobs.text_offset[0] == 0 and all(len(d) == 3 for d in c.choices[0].logprobs.top_logprobs)
    r = oa.chat.completions.create(model=MODEL, messages=Q, max_tokens=16, temperature=0, frequency_penalty=1.5)
    assert r.choices[0].message.content == engine.generate(Q, max_tokens=16, temperature=0,
                                                           frequency_penalty=1.5).text


def test_models_and_health(oa, base):
    import httpx

    assert [m.id for m in oa.models.list().data] == [MODEL]
    assert oa.models.retrieve(MODEL).id == MODEL
    h = httpx.get(base + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL


def test_anthropic_messages(engine, an):
    want = engine.generate([{"role": "system", "content": "Be brief."}] + Q, max_tokens=24, temperature=0)
    m = an.messages.create(model=MODEL, system="Be brief.", messages=Q, max_tokens=24, extra_body=GREEDY)
    assert m.content[0].type == "text" and m.content[0].text == want.text
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == len(want.tokens)
    with an.messages.stream(model=MODEL, system=[{"type": "text", "text": "Be brief."}], messages=Q, max_tokens=5,
                            extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == engine.generate([{"role": "system", "content": "Be brief."}] + Q, max_tokens=5,
                                                    temperature=0).text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5
    # a stop sequence the greedy answer reaches
    cut = want.text.index("4")
    m = an.messages.create(model=MODEL, system="Be brief.", messages=Q, max_tokens=24, extra_body=GREEDY,
                           stop_sequences=["4"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "4" and m.content[0].text == want.text[:cut]
    n = an.messages.count_tokens(model=MODEL, system="Be brief.", messages=Q)
    assert n.input_tokens == want.prompt_tokens


def test_live_request_with_tools_does_not_fail(oa, an):
    """SmolLM2's template knows no tools: they go into the system prompt. Whatever the model writes, the answer
    is well formed (forced calls are held to the tools' schemas by a grammar: tests/test_serve_toolchoice.py)."""
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=TOOLS, tool_choice=choice, max_tokens=24, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    m = an.messages.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=16,
                           tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
                           tool_choice={"type": "any"})
    assert m.stop_reason in ("tool_use", "end_turn", "max_tokens")


# canned outputs: the server's assembly of what a Qwen model writes ---------------------------------------------
class _CannedHandle:
    def __init__(self, req, text: str, engine):
        self.request, self.text = req, text
        self.generation = Generation(text, engine.tokenize(text, add_bos=False), len(req.ids), "stop",
                                     {"reused_tokens": 0})
        self._done = False

    def __iter__(self):
        for i in range(0, len(self.text), 3):  # small pieces: tags arrive split
            yield self.text[i : i + 3]
        self._done = True

    def done(self):
        return self._done

    def cancel(self):
        self._done = True


class _CannedEngine:
    """The SmolLM2 engine with Qwen3.5's chat template whose scheduler answers every request with the next canned
    output (and keeps the request, to look at its prompt)."""

    def __init__(self, eng, outputs):
        self._eng, self.outputs, self.prompts = eng, list(outputs), []
        self.scheduler = self
        self.running = self.waiting = 0

    def __getattr__(self, name):
        return getattr(self._eng, name)

    def chat_text(self, messages, add_generation_prompt=True, enable_thinking=None, tools=None):
        return render_for(self._eng.tokenizer, QWEN35_TEMPLATE, messages, tools,
                          add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)

    def chat_prompt(self, messages, add_generation_prompt=True, enable_thinking=None, tools=None):
        return self.chat_text(messages, add_generation_prompt, enable_thinking, tools).text

    def submit(self, req):
        self.prompts.append(self._eng.detokenize(req.ids))
        return _CannedHandle(req, self.outputs.pop(0), self._eng)


CALL = ("I will look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>")


def test_tool_round_trip_openai(engine):
    canned = _CannedEngine(engine, [CALL, CALL, "It is sunny\n</think>\n\nSunny, 21 C.", "Hi!"])
    with running(create_app(canned, model_name=MODEL)) as url:
        oa = oa_client(url, timeout=30)
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        r = oa.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.reasoning_content == "I will look it up.\n"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
        assert '"name": "get_weather"' in canned.prompts[0] and canned.prompts[0].endswith("<think>\n")
        # streamed, the same call arrives as a tool_calls delta
        chunks = list(oa.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, stream=True))
        deltas = [c.choices[0].delta for c in chunks]
        assert [d.tool_calls[0].function.name for d in deltas if d.tool_calls] == ["get_weather"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert "".join(d.reasoning_content or "" for d in deltas if hasattr(d, "reasoning_content")) == \
            "I will look it up.\n"
        # the result goes back: the next prompt holds the call (arguments as a mapping) and the tool's answer
        msgs += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
        r = oa.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        assert r.choices[0].message.content == "Sunny, 21 C." and r.choices[0].finish_reason == "stop"
        assert "<parameter=city>\nParis\n</parameter>" in canned.prompts[2]
        assert "<tool_response>\n21 C, sunny\n</tool_response>" in canned.prompts[2]
        # thinking off: the template closes an empty block and the answer is all content
        r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].message.content == "Hi!" and canned.prompts[3].endswith("<think>\n\n</think>\n\n")


def test_tool_round_trip_anthropic(engine):
    canned = _CannedEngine(engine, [CALL, CALL, "ok\n</think>\n\nSunny, 21 C."])
    tools = [{"name": "get_weather", "description": "weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    with running(create_app(canned, model_name=MODEL)) as url:
        an = an_client(url, timeout=30)
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        m = an.messages.create(model=MODEL, messages=msgs, tools=tools, max_tokens=64)
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["thinking", "tool_use"]
        assert m.content[1].name == "get_weather" and m.content[1].input == {"city": "Paris"}
        with an.messages.stream(model=MODEL, messages=msgs, tools=tools, max_tokens=64) as s:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
            final = s.get_final_message()
        assert {("content_block_delta", "thinking_delta"), ("content_block_delta", "input_json_delta")} <= set(kinds)
        assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}
        use = final.content[-1]
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
        m = an.messages.create(model=MODEL, messages=msgs, tools=tools, max_tokens=64)
        assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "Sunny, 21 C."
        assert m.content[0].thinking == "ok\n" and m.stop_reason == "end_turn"
        assert "<parameter=city>\nParis\n</parameter>" in canned.prompts[2]
        assert "<tool_response>\n21 C\n</tool_response>" in canned.prompts[2]


# structured output ------------------------------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture
def constrained(engine):
    """A server whose requests may carry a constraint (the scheduler masks each step's logits with it)."""
    pytest.importorskip("llguidance")
    with running(create_app(engine, model_name=MODEL)) as url:
        yield url


def test_response_format(constrained):
    msgs = [{"role": "user", "content": "Give me a person."}]
    an = an_client(constrained, timeout=60)
    constrained = oa_client(constrained, timeout=60)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = constrained.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0,
                                            response_format=rf)
    person = json.loads(r.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)
    assert r.choices[0].finish_reason == "stop"
    chunks = constrained.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0,
                                                 response_format=rf, stream=True)
    assert json.loads("".join(c.choices[0].delta.content or "" for c in chunks)) == person
    # sampled: which tokens come depends on the ISA's rounding, so only what holds for any sample is checked: a
    # reply that stopped is a JSON object, one cut at max_tokens is the start of one
    r = constrained.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0.8, seed=3,
                                            response_format={"type": "json_object"})
    text, why = r.choices[0].message.content, r.choices[0].finish_reason
    assert why in ("stop", "length") and text.lstrip().startswith("{"), (why, text)
    if why == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert r.usage.completion_tokens == 64 and json_prefix(text), text
    with pytest.raises(openai.BadRequestError) as e:
        constrained.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert "response_format" in str(e.value)
    # Anthropic's structured output
    m = an.messages.create(model=MODEL, messages=msgs, max_tokens=64, extra_body={
        "temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": PERSON}}})
    assert json.loads(m.content[0].text) == person

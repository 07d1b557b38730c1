"""OpenAI's Responses API through the official openai client, live on 127.0.0.1 with SmolLM2: a greedy response
equals the chat completion of the same messages; streamed, its typed events rebuild the final response; forced
function tools give a function_call item whose arguments validate; `previous_response_id` continues a stored
conversation (its history restored from the prefix cache), and an unknown or unstored id is a 400."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.isa

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_serve_api import MODEL, oa_client, running  # noqa: E402
from test_serve_toolchoice import SCHEMAS  # noqa: E402

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.serving.protocol.errors import ApiError  # noqa: E402
from hybridinfer.serving.protocol.responses import ResponseStore  # noqa: E402
from hybridinfer.serving.serve import create_app  # noqa: E402

TOOLS = [{"type": "function", "name": n, "description": n.replace("_", " "), "parameters": s}
         for n, s in SCHEMAS.items()]


@pytest.fixture(scope="module")
def oa(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=1024, max_seqs=4, prefix_cache={"ram_bytes": 64 << 20},
                      isa=os.environ.get("HYBRIDINFER_ISA"))
    with running(create_app(eng, model_name=MODEL, report_cached_tokens=True)) as url:
        yield oa_client(url, timeout=120)
    eng.close()


def test_plain_equals_chat(oa):
    r = oa.responses.create(model=MODEL, input="What is the capital of France?", instructions="Be brief.",
                            max_output_tokens=24, temperature=0)
    chat = oa.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_streamed_events(oa):
    events = list(oa.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Tell me a joke."}]}], max_output_tokens=16, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and text
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [d.item.model_dump() for d in done] == [o.model_dump() for o in final.output]
    plain = oa.responses.create(model=MODEL, input="Tell me a joke.", max_output_tokens=16, temperature=0)
    assert plain.output_text == text


def test_tools_and_previous_response_id(oa):
    first = oa.responses.create(model=MODEL, input="Wake me at seven.", tools=TOOLS, tool_choice="required",
                                max_output_tokens=64, temperature=0.8, extra_body={"seed": 4})
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    named = oa.responses.create(model=MODEL, input="Wake me at seven.", tools=TOOLS, max_output_tokens=64,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0.8,
                                extra_body={"seed": 4})
    (call,) = [o for o in named.output if o.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    # streamed, the call comes as its own item: added, its arguments, done
    events = list(oa.responses.create(model=MODEL, input="Wake me at seven.", tools=TOOLS, tool_choice="required",
                                      max_output_tokens=64, temperature=0.8, stream=True, extra_body={"seed": 5}))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.done" in kinds
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (fc,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert args_done.arguments == fc.arguments and args_done.item_id == fc.id
    jsonschema.validate(json.loads(fc.arguments), SCHEMAS[fc.name])
    # the tool's result, continuing the stored conversation: its history is this prompt's prefix
    second = oa.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=8,
                                 temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                        "output": "alarm set"}])
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model=MODEL, previous_response_id="resp_nope", input="hi", max_output_tokens=4)
    assert "previous_response_id" in str(e.value)
    unstored = oa.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError):
        oa.responses.create(model=MODEL, previous_response_id=unstored.id, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert "tools[0]" in str(e.value)


def test_store_is_bounded():
    s = ResponseStore(max_entries=3, max_bytes=1000)
    for i in range(5):
        s.put(f"r{i}", [{"role": "user", "content": str(i)}], None)
    assert len(s) == 3 and s.get("r4", None)
    with pytest.raises(ApiError) as e:
        s.get("r0", None)
    assert e.value.status == 400
    with pytest.raises(ApiError):
        s.get("r4", "another tenant")  # one API key never continues another's conversation
    s.put("big", [{"role": "user", "content": "x" * 2000}], None)  # past max_bytes alone: not kept
    assert len(s) == 0

"""OpenAI's Responses API (/v1/responses) without HTTP: a body turned into a chat completion's (input items into
messages, flat function tools into chat tools, `text.format` into response_format), run as one, and the answer's
events made into output items (reasoning, message, function_call). `previous_response_id` continues a stored
conversation: a bounded in-memory store keeps each stored response's whole history as chat messages."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict

from .context import Context, usage_counts
from .errors import bad_param
from .models import ChatRequest, ResponsesRequest
from .openai import ChatCall
from .toolcalls import ToolCall

DEFAULT_STORE_ENTRIES = 1024
DEFAULT_STORE_BYTES = 64 << 20  # the histories' JSON: a long agent conversation stored many times over still fits


class ResponseStore:
    """Stored responses' histories (chat messages), the least recently used out first past either bound."""

    def __init__(self, max_entries: int = DEFAULT_STORE_ENTRIES, max_bytes: int = DEFAULT_STORE_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[str, tuple[list[dict], int, str | None]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, rid: str, tenant: str | None) -> list[dict]:
        with self._lock:
            item = self._items.get(rid)
            if item is None or item[2] != tenant:  # one API key never continues another's conversation
                raise bad_param("previous_response_id", f"no stored response has the id {rid!r} (responses are "
                                                        f"kept in memory, the oldest forgotten first)")
            self._items.move_to_end(rid)
            return item[0]

    def put(self, rid: str, history: list[dict], tenant: str | None) -> None:
        size = len(json.dumps(history, ensure_ascii=False))
        with self._lock:
            self._items[rid] = (history, size, tenant)
            self._bytes += size
            while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
                _, (_, n, _) = self._items.popitem(last=False)
                self._bytes -= n

    def __len__(self) -> int:
        return len(self._items)


def _text_of(content, where: str) -> str | list:
    """A message's content as chat completions take it: its text, or with input_image parts a list of OpenAI
    parts (text and image_url)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_param(where, "must be text or a list of content parts")
    out, images = [], False
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise bad_param(f"{where}[{j}].image_url", "an input_image part needs its image_url (a data: URL)")
            out.append({"type": "image_url", "image_url": {"url": url}})
            images = True
            continue
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_param(f"{where}[{j}]", f"content parts of type {kind!r} are not supported (text and "
                                             "input_image only)")
        out.append({"type": "text", "text": part["text"]})
    return out if images else "".join(p["text"] for p in out)


def input_messages(items) -> list[dict]:
    """Responses input (text, or items: messages, function_call, function_call_output, reasoning) as chat
    messages; a function call joins the assistant message before it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_param(f"{where}.role", f"must be user, system, developer or assistant, got {role!r}")
            out.append({"role": role, "content": _text_of(it.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise bad_param(where, "a function_call needs its name and call_id")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = it.get("output")
            out.append({"role": "tool", "tool_call_id": it.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # the template drops earlier turns' reasoning anyway
        else:
            raise bad_param(f"{where}.type", f"input items of type {kind!r} are not supported")
    return out


def _tools(tools) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise bad_param(f"tools[{i}]", f"only function tools (with a name) are supported, got type "
                                           f"{t.get('type')!r}")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if t.get(k) is not None}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text) -> dict | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt.get("schema") or {}}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise bad_param("text.format.type", f"must be text, json_object or json_schema, got {fmt.get('type')!r}")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesCall:
    """One /v1/responses body: checked and made into a ChatCall at construction, answered as a response object."""

    n = 1

    def __init__(self, ctx: Context, body: ResponsesRequest, store: ResponseStore, tenant: str | None = None):
        ctx.check_model(body.model)
        history = store.get(body.previous_response_id, tenant) if body.previous_response_id else []
        self.turn = input_messages(body.input)
        msgs = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history + self.turn
        if not msgs:
            raise bad_param("input", "is empty")
        chat = {"model": body.model, "messages": msgs, "tools": _tools(body.tools),
                "tool_choice": _tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
                "max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
                "top_k": body.top_k, "seed": body.seed, "response_format": _format(body.text)}
        effort = (body.reasoning or {}).get("effort")
        if effort in ("none", "minimal"):
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        self.chat = ChatCall(ctx, ChatRequest.model_validate({k: v for k, v in chat.items() if v is not None}))
        self.ctx, self.body, self.store, self.tenant, self.history = ctx, body, store, tenant, history
        self.id = _item_id("resp")

    def build(self):
        return self.chat.build()

    def parser(self):
        return self.chat.parser()

    def skeleton(self, status: str) -> dict:
        """The response object before its output and usage."""
        b = self.body
        return {"id": self.id, "object": "response", "created_at": int(time.time()), "status": status,
                "model": self.ctx.model_name, "output": [], "error": None, "incomplete_details": None,
                "instructions": b.instructions, "previous_response_id": b.previous_response_id,
                "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
                "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature,
                "top_p": b.top_p, "max_output_tokens": b.max_output_tokens, "store": b.store,
                "text": b.text or {"format": {"type": "text"}}, "reasoning": b.reasoning, "metadata": b.metadata or {},
                "usage": None}

    def finish(self, resp: dict, request, generation) -> dict:
        """`resp` with its usage and final status, stored for a later previous_response_id when asked."""
        p, c, reused = usage_counts(request, generation)
        resp["usage"] = {"input_tokens": p, "input_tokens_details": {"cached_tokens": reused}, "output_tokens": c,
                         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}
        calls = any(o["type"] == "function_call" for o in resp["output"])
        if generation.finish_reason == "length" and not calls:
            resp["status"], resp["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        else:
            resp["status"] = "completed"
        if self.body.store:
            self.store.put(self.id, self.history + self.turn + output_messages(resp["output"]), self.tenant)
        return resp

    def answer(self, events: list, request, generation) -> dict:
        resp = self.skeleton("completed")
        resp["output"] = output_items(events, self.chat.one_call)
        return self.finish(resp, request, generation)


def reasoning_item(text: str, rid: str | None = None) -> dict:
    return {"type": "reasoning", "id": rid or _item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, mid: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": mid or _item_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call.id[5:], "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def output_items(events: list, one_call: bool = False) -> list[dict]:
    reasoning = "".join(v for k, v in events if k == "reasoning")
    text = "".join(v for k, v in events if k == "text")
    calls = [v for k, v in events if k == "tool"][: 1 if one_call else None]
    out = [reasoning_item(reasoning)] if reasoning else []
    if text or not calls:
        out.append(message_item(text))
    return out + [call_item(c) for c in calls]


def output_messages(items: list[dict]) -> list[dict]:
    """A response's output items as the assistant message a next turn's history holds."""
    msg: dict = {"role": "assistant", "content": ""}
    for it in items:
        if it["type"] == "message":
            msg["content"] += "".join(p["text"] for p in it["content"])
        elif it["type"] == "reasoning":
            msg["reasoning_content"] = "".join(p["text"] for p in it["content"])
        elif it["type"] == "function_call":
            msg.setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": {
                "name": it["name"], "arguments": it["arguments"]}})
    return [msg]


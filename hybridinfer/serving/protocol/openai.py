"""OpenAI /v1/chat/completions and /v1/completions without HTTP: a body checked, its Request built, the answer's body
assembled. The server's routes and the batch runner both go through these, so a batch line's body is the server's."""

from __future__ import annotations

import copy
import dataclasses
import time
import uuid

import numpy as np

from .context import Context, sampling_args, usage_counts
from .errors import bad_param, unsupported
from .models import ChatRequest, CompletionRequest
from .prompt import args_mapping, build_chat, normalize_tool_choice
from .toolcalls import OutputParser

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def _content(c, where: str, role: str = "user") -> str | list:
    """A message's content as the template takes it: its text, or with image parts (a user message's) a list of
    engine parts ({"type": "text"}, {"type": "image"}: engine/images.py)."""
    if c is None or isinstance(c, str):
        return c or ""
    out, images = [], False
    for j, p in enumerate(c):
        if p.type == "image_url" and role != "user":
            raise bad_param(f"{where}[{j}].type", f"image parts are taken in user messages, not in a {role} message")
        if p.type == "image_url":
            url = getattr(p, "image_url", None)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise bad_param(f"{where}[{j}].image_url", "an image_url part needs image_url.url (a data: URL)")
            out.append({"type": "image", "image": url})
            images = True
        elif p.type != "text" or p.text is None:
            raise bad_param(f"{where}[{j}].type", f"content parts of type {p.type!r} are not supported (text and "
                                                  "image_url only)")
        else:
            out.append({"type": "text", "text": p.text})
    return out if images else "".join(x["text"] for x in out)


def chat_messages(body: ChatRequest) -> list[dict]:
    """OpenAI messages as the chat template takes them."""
    out = []
    for i, m in enumerate(body.messages):
        d = {"role": "system" if m.role == "developer" else m.role,
             "content": _content(m.content, f"messages[{i}].content", m.role)}
        if m.role == "assistant":
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                                    "function": {"name": c.function.name, "arguments": args_mapping(
                                        c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")}}
                                   for j, c in enumerate(m.tool_calls)]
            if m.reasoning_content:
                d["reasoning_content"] = m.reasoning_content
        elif m.role == "tool":
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        out.append(d)
    return out


MAX_N = 16  # choices of one chat request: each is a sequence of its own, holding a slot of the server's queue


def fork_request(req, i: int):
    """Choice `i` of a request of several: the same prompt and settings, its own sampler seed (the request's seed
    plus i, so a seeded request repeats) and no constraint (the caller attaches a fresh one: a grammar's state is
    one sequence's)."""
    r = copy.copy(req)
    seed = req.params.seed
    r.params = dataclasses.replace(req.params, seed=None if seed is None else (seed + i) % (1 << 64))
    r.constraint = None
    return r


def _check_common(body, max_n: int = 1) -> None:
    if body.n is not None and not 1 <= body.n <= max_n:
        if max_n == 1:
            raise unsupported("n", body.n)
        raise bad_param("n", f"must be from 1 to {max_n}, got {body.n!r}")
    extra = body.model_extra or {}
    # fields that would change the answer if honoured: refused rather than silently ignored
    for name in ("logit_bias", "functions", "function_call", "audio", "prediction"):
        if extra.get(name):
            raise unsupported(name, extra[name])


def _token_text(engine, t: int) -> str:
    return engine.detokenize([t]) if engine.tokenizer is not None else ""


def chat_logprobs(engine, entries) -> dict:
    """OpenAI's chat `logprobs` of generated tokens (Generation.logprobs entries): token, logprob, bytes and the
    top alternatives of each."""
    def one(t: int, lp: float) -> dict:
        s = _token_text(engine, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**one(e["token"], e["logprob"]), "top_logprobs": [one(i, v) for i, v in e["top"]]}
                        for e in entries]}


def completion_logprobs(engine, entries, offset: int = 0) -> dict:
    """OpenAI's legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset
    (from `offset`, the text already sent)."""
    toks = [_token_text(engine, e["token"]) for e in entries]
    offs = list(np.cumsum([offset] + [len(t) for t in toks[:-1]])) if toks else []
    return {"tokens": toks, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_token_text(engine, i): v for i, v in e["top"]} for e in entries],
            "text_offset": [int(o) for o in offs]}


def usage(request, generation) -> dict:
    p, c, reused = usage_counts(request, generation)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": reused}}


def tool_json(call, index: int | None = None) -> dict:
    d = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return d if index is None else {"index": index, **d}


class ChatCall:
    """One /v1/chat/completions body: checked at construction (cheap), `build()` renders and tokenizes it (slow:
    off the server's event loop), `answer()` makes the non-streamed response body of its finished generation."""

    def __init__(self, ctx: Context, body: ChatRequest):
        ctx.check_model(body.model)
        _check_common(body, MAX_N)
        self.n = body.n or 1
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise bad_param("top_logprobs", f"must be between 0 and 20, got {body.top_logprobs!r}")
        if body.top_logprobs and not body.logprobs:
            raise bad_param("top_logprobs", "needs logprobs: true")
        if body.logprobs not in (None, True, False):
            raise bad_param("logprobs", f"must be true or false, got {body.logprobs!r}")
        self.n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        kw = body.chat_template_kwargs or {}
        self.thinking = kw.get("enable_thinking")
        if self.thinking is not None and not isinstance(self.thinking, bool):
            raise bad_param("chat_template_kwargs.enable_thinking", f"must be true or false, got {self.thinking!r}")
        self.schema = ctx.check_schema(body.response_format)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = normalize_tool_choice(body.tool_choice, tools)
        if self.schema is not None:  # the grammar holds the answer to JSON from its first token: no tool calls
            tools = choice = None
        self.tools, self.choice = tools, choice
        self.max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        self.sampling, self.messages = sampling_args(body), chat_messages(body)
        if self.n_logprobs is not None:
            self.sampling["logprobs"] = self.n_logprobs
        self.ctx, self.body, self.prepared = ctx, body, None
        self.one_call = body.parallel_tool_calls is False

    def build(self):
        ctx = self.ctx
        p = self.prepared = build_chat(ctx.engine, ctx.info, self.messages, self.tools, self.choice, self.thinking,
                                       self.schema is not None)
        return ctx.constrain(ctx.make_request(p.ids, self.max_tokens, self.sampling, self.body.stop,
                                              p.turn_boundary, p.images), self.schema, p)

    def fork(self, req, i: int):
        """Choice i's Request (n > 1), with a grammar of its own where the first has one."""
        return self.ctx.constrain(fork_request(req, i), self.schema, self.prepared)

    def parser(self) -> tuple[OutputParser, list]:
        """The output parser of the built prompt and the events of the assistant text the prompt already holds."""
        p = self.prepared
        parser = OutputParser(p.in_reasoning, p.tools, p.schemas)
        return parser, (parser.feed(p.prefix) if p.prefix else [])

    def head(self) -> dict:
        return {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": self.ctx.model_name,
                "system_fingerprint": "hybridinfer"}

    def answer(self, head: dict, events: list, request, generation) -> dict:
        calls = [v for k, v in events if k == "tool"][: 1 if self.one_call else None]
        content = "".join(v for k, v in events if k == "text")
        reasoning = "".join(v for k, v in events if k == "reasoning")
        msg = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [tool_json(c) for c in calls]
        finish = "tool_calls" if calls else FINISH[generation.finish_reason]
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                             "logprobs": None if self.n_logprobs is None
                             else chat_logprobs(self.ctx.engine, generation.logprobs or [])}],
                "usage": usage(request, generation)}


class CompletionCall:
    """One /v1/completions body, as ChatCall: the prompt completed as it is (text or token ids)."""

    def __init__(self, ctx: Context, body: CompletionRequest):
        ctx.check_model(body.model)
        _check_common(body)
        if body.echo:
            raise unsupported("echo", body.echo)
        if body.suffix:
            raise unsupported("suffix", body.suffix)
        if body.best_of not in (None, 1):
            raise unsupported("best_of", body.best_of)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_param("prompt", f"holds {len(prompt)} prompts; this server takes one per request")
            prompt = prompt[0]
        if not prompt:
            raise bad_param("prompt", "is empty")
        self.prompt, self.sampling, self.schema = prompt, sampling_args(body), ctx.check_schema(body.response_format)
        if body.logprobs is not None and (isinstance(body.logprobs, bool) or not 0 <= body.logprobs <= 5):
            raise bad_param("logprobs", f"must be a whole number from 0 to 5, got {body.logprobs!r}")
        self.n_logprobs = body.logprobs
        if self.n_logprobs is not None:
            self.sampling["logprobs"] = self.n_logprobs
        self.ctx, self.body = ctx, body

    def build(self):
        ctx = self.ctx
        return ctx.constrain(ctx.make_request(self.prompt, self.body.max_tokens, self.sampling, self.body.stop),
                             self.schema)

    def parser(self) -> tuple[None, list]:
        return None, []

    def head(self) -> dict:
        return {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": self.ctx.model_name,
                "object": "text_completion"}

    def answer(self, head: dict, events: list, request, generation) -> dict:
        text = "".join(v for _, v in events)
        lp = None if self.n_logprobs is None else completion_logprobs(self.ctx.engine, generation.logprobs or [])
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": lp,
                                     "finish_reason": FINISH[generation.finish_reason]}],
                "usage": usage(request, generation)}

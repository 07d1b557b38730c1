"""llama-server's utility routes, under the names its clients call: /tokenize, /detokenize, /apply-template (the
prompt a chat body renders to, tools and tool_choice included, as the chat route would make it) and /props (the
server's settings). Each runs in the render pool under a slot of its own, bounded like the requests that queue."""

from __future__ import annotations

import inspect

from fastapi import APIRouter, Request

from ... import __version__
from ...errors import HybridInferError
from ..protocol.errors import ApiError, from_engine
from ..protocol.models import ApplyTemplateRequest, DetokenizeRequest, TokenizeRequest
from ..protocol.openai import chat_messages
from ..protocol.prompt import build_chat, check_text_fits, normalize_tool_choice
from .service import Service

# (max_tokens is not among them: a request without it may generate to the end of the context)
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")


def default_sampling(engine) -> dict:
    """What a request that sets no sampling field gets: Engine.make_request's own defaults, read from it."""
    sig = inspect.signature(engine.make_request)
    return {k: sig.parameters[k].default for k in _SAMPLING if k in sig.parameters}


def _piece(tok, t: int):
    """A token's text, or its bytes where they are not whole UTF-8 (part of a character), as llama-server."""
    b = tok.token_bytes(t)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


def router(svc: Service) -> APIRouter:
    r = APIRouter()
    eng = svc.engine

    def vocab():
        if eng.tokenizer is None:
            raise ApiError(400, "this model has no vocabulary: it reads and writes token ids only")
        return eng.tokenizer

    def tokenize(body: TokenizeRequest) -> dict:
        tok = vocab()
        check_text_fits(eng, len(body.content), "content")
        ids = tok.encode(body.content, add_bos=body.add_special, parse_special=body.parse_special)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": _piece(tok, t)} for t in ids]}
        return {"tokens": ids}

    def detokenize(body: DetokenizeRequest) -> dict:
        vocab()
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < eng.args.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens[{bad}]: {body.tokens[bad]} is outside the vocabulary [0, "
                                f"{eng.args.n_vocab})", param=f"tokens[{bad}]", code="invalid_value")
        return {"content": eng.detokenize(body.tokens)}

    def apply_template(body: ApplyTemplateRequest) -> dict:
        if body.model is not None:
            svc.check_model(body.model)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = normalize_tool_choice(body.tool_choice, tools)
        thinking = (body.chat_template_kwargs or {}).get("enable_thinking")
        try:
            p = build_chat(eng, svc.info, chat_messages(body), tools, choice, thinking)
        except HybridInferError as e:
            raise from_engine(e) from None
        return {"prompt": p.text}

    @r.post("/tokenize")
    async def tokenize_route(request: Request):
        return await svc.bounded(request, TokenizeRequest, tokenize)

    @r.post("/detokenize")
    async def detokenize_route(request: Request):
        return await svc.bounded(request, DetokenizeRequest, detokenize)

    @r.post("/apply-template")
    async def apply_template_route(request: Request):
        return await svc.bounded(request, ApplyTemplateRequest, apply_template)

    @r.get("/props")
    async def props():
        tok = eng.tokenizer
        template = eng.chat_template or eng.gm.meta("tokenizer.chat_template", None) or ""
        return {
            "default_generation_settings": {"n_ctx": eng.n_ctx, "params": default_sampling(eng)},
            "total_slots": eng.max_seqs,
            "model_path": getattr(eng.gm, "path", None),
            "model_alias": svc.model_name,
            "chat_template": template,
            "bos_token": tok.token_bytes(tok.bos_id).decode("utf-8", "replace") if tok and tok.bos_id is not None
            else None,
            "eos_token": tok.token_bytes(tok.eos_id).decode("utf-8", "replace") if tok and tok.eos_id is not None
            else None,
            "modalities": {"vision": svc.takes_images(), "audio": False},
            "build_info": f"hybridinfer {__version__}",
        }

    return r

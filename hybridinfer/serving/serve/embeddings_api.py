"""OpenAI's /v1/embeddings: each input's final hidden states pooled (Engine.embed: "mean" over its tokens by
default, or the "last" token's; `create_app(pooling=...)`, `serve --pooling`) and scaled to unit length, as floats
or base64 (little-endian float32, what the openai client asks for). Computed in the render pool, each input under
the engine's lock between two scheduler steps."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request

from ...errors import HybridInferError
from ..protocol.errors import bad_param, from_engine
from ..protocol.models import EmbeddingsRequest
from .service import Service


def router(svc: Service, pooling: str = "mean") -> APIRouter:
    r = APIRouter()
    eng = svc.engine

    def embed(body: EmbeddingsRequest) -> dict:
        svc.check_model(body.model)
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise bad_param("input", "is empty")
        n_embd = eng.args.n_embd
        if body.dimensions is not None and body.dimensions != n_embd:
            raise bad_param("dimensions", f"this model's embeddings have {n_embd} dimensions, got {body.dimensions}")
        data, n_tokens = [], 0
        for i, x in enumerate(inputs):
            if isinstance(x, str) and eng.tokenizer is None:
                raise bad_param(f"input[{i}]", "this model has no vocabulary: send token ids")
            try:
                ids = eng.tokenize(x) if isinstance(x, str) else list(x)
                v = eng.embed(ids, pooling)
            except HybridInferError as e:
                err = from_engine(e)
                raise bad_param(f"input[{i}]", err.message) from None
            n_tokens += len(ids)
            emb = (base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                   else [float(f) for f in np.asarray(v, dtype=np.float32)])
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"object": "list", "data": data, "model": svc.model_name,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

    @r.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await svc.bounded(request, EmbeddingsRequest, embed)

    return r

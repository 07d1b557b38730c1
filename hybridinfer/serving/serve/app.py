"""The FastAPI app: routes of both APIs on one Engine, the API key, error shapes, metrics."""

from __future__ import annotations

import contextlib
import hmac

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import HybridInferError
from ..protocol.context import default_model_name
from . import anthropic_api, openai_api
from .errors import ApiError, from_engine
from .metrics import Metrics
from .service import Service

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY = 16 << 20  # bytes: long agent histories fit; a runaway upload does not

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages", "/v1/messages/count_tokens",
           "/health", "/metrics"}


def _error_response(request, e: ApiError) -> JSONResponse:
    body = e.anthropic_body() if request.url.path.startswith("/v1/messages") else e.openai_body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


class _CountRequests:
    """Count every answer by route and status (an ASGI wrapper: it sees the status of streamed answers too)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_seen(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_seen)
        finally:
            route = scope["path"] if scope["path"] in _ROUTES else "other"
            self.metrics.requests.labels(route, str(status[0])).inc()


def create_app(engine, api_key: str | None = None, model_name: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY,
               close_engine: bool = False) -> FastAPI:
    """An app serving `engine` (its scheduler runs every request). api_key: required on every route but /health
    (`Authorization: Bearer KEY` or `x-api-key: KEY`), None for none. model_name: the one model id clients must
    name (default: the GGUF's file name without .gguf). max_queue: requests that may wait beyond the engine's
    max_seqs running ones; past that, 429. max_body_bytes: larger bodies get 413. close_engine: the app owns the
    engine and closes it (`Engine.close`) when the server shuts down (its lifespan's end), as `hybridinfer serve`
    does."""
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue!r}")
    metrics = Metrics()
    svc = Service(engine, model_name or default_model_name(engine), max_queue, metrics)
    key = api_key.encode() if api_key else None

    async def check_key(request: Request) -> None:
        if key is None:
            return
        given = [request.headers.get("x-api-key")]
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given.append(auth[7:].strip())
        if not any(g and hmac.compare_digest(g.encode(), key) for g in given):
            which = "wrong" if any(given) else "missing"
            raise ApiError(401, f"{which} API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                           code="invalid_api_key")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            if close_engine:  # requests still queued or running end with EngineClosed; the weights' memory goes
                await anyio.to_thread.run_sync(engine.close)

    app = FastAPI(title="hybridinfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.service = svc
    deps = [Depends(check_key)]
    app.include_router(openai_api.router(svc, max_body_bytes), dependencies=deps)
    app.include_router(anthropic_api.router(svc, max_body_bytes), dependencies=deps)

    @app.get("/health")
    async def health():
        s = svc.scheduler
        return {"status": "ok", "model": svc.model_name, "running": s.running, "waiting": s.waiting}

    @app.get("/metrics", dependencies=deps)
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error_response(request, e)

    @app.exception_handler(HybridInferError)
    async def engine_error(request: Request, e: HybridInferError):
        return _error_response(request, from_engine(e))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        loc = ".".join(str(x) for x in (errs[0]["loc"] if errs else ()) if x != "body")
        msg = errs[0]["msg"] if errs else "invalid request"
        return _error_response(request, ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error_response(request, ApiError(e.status_code, str(e.detail), headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        return _error_response(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    app.add_middleware(_CountRequests, metrics=metrics)
    return app

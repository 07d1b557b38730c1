"""The FastAPI app: routes of both APIs on one Engine, the API key, error shapes, metrics."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from urllib.parse import urlsplit

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import HybridInferError, ParameterError
from ..protocol.context import default_model_name
from . import anthropic_api, embeddings_api, llama_api, openai_api, page, responses_api
from .errors import ApiError, from_engine
from .metrics import Metrics
from .service import DEFAULT_RENDER_THREADS, Service

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY = 16 << 20  # bytes: long agent histories fit; a runaway upload does not
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages", "/v1/messages/count_tokens",
           "/health", "/metrics", "/tokenize", "/detokenize", "/apply-template", "/props", "/v1/responses",
           "/v1/embeddings", "/"}


def _error_response(request, e: ApiError) -> JSONResponse:
    return _error_at(request.url.path, e)


def _error_at(path: str, e: ApiError) -> JSONResponse:
    body = e.anthropic_body() if path.startswith("/v1/messages") else e.openai_body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _host_of(value: str) -> str:
    """The host name of a Host header ("127.0.0.1:8080", "[::1]:80", "localhost"), lower case."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1 : v.find("]")] if "]" in v else v
    name, colon, port = v.rpartition(":")
    return name if colon and port.isdigit() else v


class _HostGuard:
    """For a keyless server on loopback: refuse (403) a Host that is not a loopback name and an Origin that is
    not a loopback page. A page on evil.example whose name the attacker re-points at 127.0.0.1 reaches this server
    with `Host: evil.example` (and its own Origin); a local client sends its address, and no Origin."""

    def __init__(self, app, hosts: frozenset, origins: frozenset = frozenset()):
        self.app, self.hosts, self.origins = app, hosts, origins  # origins: pages let in by name (cors_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            bad = None
            for name, value in scope["headers"]:
                if name == b"host" and _host_of(value.decode("latin-1")) not in self.hosts:
                    bad = f"the Host {value.decode('latin-1')!r} is not one this server answers to"
                elif name == b"origin":
                    origin = value.decode("latin-1")
                    try:
                        host = urlsplit(origin).hostname
                    except ValueError:
                        host = None
                    if host not in self.hosts and origin not in self.origins and "*" not in self.origins:
                        bad = f"requests from the web page at {origin!r} are not allowed"
            if bad is not None:
                e = ApiError(403, f"{bad} (a server without an API key answers only clients that name it as one "
                                  f"of: {', '.join(sorted(self.hosts))})", code="forbidden_host")
                return await _error_at(scope["path"], e)(scope, receive, send)
        return await self.app(scope, receive, send)


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


def check_api_keys(api_key) -> tuple[str, ...]:
    """The API keys of `api_key` (None: none; a str: one; a sequence: several), each checked: a blank key, or one
    with whitespace around it (which an HTTP header cannot carry), would lock every client out, so it is refused."""
    keys = () if api_key is None else (api_key,) if isinstance(api_key, str) else tuple(api_key)
    for k in keys:
        if not isinstance(k, str) or not k.strip():
            raise ParameterError(f"an API key must be non-blank text, got {k!r}")
        if k != k.strip():
            raise ParameterError(f"the API key {k!r} has whitespace around it, which no HTTP header carries")
        if any(ord(c) < 32 or ord(c) == 127 for c in k):
            raise ParameterError("an API key may not hold control characters")
    return keys


def _tenant(key: bytes) -> str:
    """The prefix-cache salt of one API key (a hash: the key itself is kept nowhere else)."""
    return hashlib.blake2b(key, digest_size=16, person=b"hi-tenant").hexdigest()


def create_app(engine, api_key=None, model_name=None, max_queue: int = DEFAULT_MAX_QUEUE,
               max_body_bytes: int = DEFAULT_MAX_BODY, *, strict_model_name: bool = False,
               report_cached_tokens: bool = False,
               allowed_hosts=LOOPBACK_HOSTS, render_threads: int = DEFAULT_RENDER_THREADS,
               close_engine: bool = False, cors_origins=None, pooling: str = "mean",
               allow_remote_images: bool = False) -> FastAPI:
    """An app serving `engine` (its scheduler runs every request).

    api_key: a key (or a list of keys) required on every route but /health (`Authorization: Bearer KEY` or
    `x-api-key: KEY`, compared as UTF-8 bytes), None for none. With keys, each key is a tenant of its own in the
    prefix cache: a prompt restores only snapshots made under the same key, and usage reports its cached tokens.
    Without keys every client shares one cache, so `cached_tokens` is reported as 0 unless report_cached_tokens.
    model_name: the model id answers report (default: the GGUF's file name without .gguf), or a list of them
    (aliases: the first is reported, all are listed); any name a request gives is answered, unless
    strict_model_name, where a name not among them is a 404. max_queue:
    requests that may wait beyond the engine's max_seqs running ones; past that, 429 (parsing and rendering count
    too: they happen under the same bound, render_threads at a time). max_body_bytes: larger bodies get 413.
    allowed_hosts: without keys, the Host header must name one of these (and an Origin header, if sent, too), else
    403: a web page the browser was tricked into sending to this loopback server (DNS rebinding) is refused. None
    turns the check off (a server bound to a public address, reached by other names). close_engine: the app owns the
    engine and closes it (`Engine.close`) when the server shuts down (its lifespan's end), as `hybridinfer serve`
    does. cors_origins: the web pages (origins such as "http://localhost:5173", or "*" for any) whose scripts may
    call this server (CORS: preflights answered, Access-Control-Allow-Origin sent); an empty list: none. None (the
    default): pages on loopback origins for a keyless server that checks hosts (no other page may call it), any
    page ("*", as llama-server) otherwise, where an API key or the network guards it. pooling: how /v1/embeddings
    pools an input's hidden states, "mean" or "last" (Engine.embed). allow_remote_images: fetch images given as
    http(s) URLs (default: refused with a 400; data: URLs and base64 sources always work)."""
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue!r}")
    if pooling not in ("mean", "last"):
        raise ValueError(f"pooling must be 'mean' or 'last', got {pooling!r}")
    if render_threads < 1:
        raise ValueError(f"render_threads must be >= 1, got {render_threads!r}")
    keys = [k.encode() for k in check_api_keys(api_key)]
    metrics = Metrics()
    svc = Service(engine, model_name or default_model_name(engine), max_queue, metrics, max_body_bytes,
                  render_threads, report_cached=report_cached_tokens or bool(keys),
                  strict_model_name=strict_model_name)
    svc.allow_remote_images = bool(allow_remote_images)

    async def check_key(request: Request) -> None:
        if not keys:
            return
        given = [request.headers.get("x-api-key")]
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given.append(auth[7:].strip())
        # Starlette decodes header bytes as latin-1: encoding back gives the bytes sent (a UTF-8 key's too)
        sent = [g.encode("latin-1") for g in given if g]
        match = next((k for k in keys for g in sent if hmac.compare_digest(g, k)), None)
        if match is None:
            which = "wrong" if sent else "missing"
            raise ApiError(401, f"{which} API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                           code="invalid_api_key")
        request.state.tenant = _tenant(match)

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
    app.include_router(openai_api.router(svc), dependencies=deps)
    app.include_router(anthropic_api.router(svc), dependencies=deps)
    app.include_router(llama_api.router(svc), dependencies=deps)
    app.include_router(responses_api.router(svc), dependencies=deps)
    app.include_router(embeddings_api.router(svc, pooling), dependencies=deps)

    page.mount(app)

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

    guarded = not keys and allowed_hosts is not None
    origins = tuple(cors_origins) if cors_origins is not None else None
    # the host guard (added last: outside) refuses a page it does not let in, its preflight included; CORS answers
    # the preflights of the others before any route (an OPTIONS request carries no key)
    if origins is None and guarded:
        app.add_middleware(CORSMiddleware, allow_origin_regex=LOOPBACK_ORIGINS, allow_methods=["*"],
                           allow_headers=["*"])
    elif origins or origins is None:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins or ["*"]), allow_methods=["*"],
                           allow_headers=["*"])
    if guarded:
        app.add_middleware(_HostGuard, hosts=frozenset(h.lower() for h in allowed_hosts),
                           origins=frozenset(origins or ()))
    app.add_middleware(_CountRequests, metrics=metrics)
    return app

"""`hybridinfer serve`: an OpenAI- and Anthropic-compatible HTTP server on the engine's scheduler.

Needs the `serve` extra (`pip install -e .[serve]`): fastapi, uvicorn, sse-starlette, pydantic, prometheus-client.
`create_app(engine, ...)` makes the ASGI app; `serve(app, host, port)` runs it under uvicorn."""

from __future__ import annotations

from .app import create_app, default_model_name

__all__ = ["create_app", "default_model_name", "serve"]


def serve(app, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

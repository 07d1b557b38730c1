"""The chat page at / (static/index.html, chat.js, chat.css: plain files in the package, no build step). It talks to
the server's own /v1/chat/completions, so it needs no route of its own; it is served without the API key (it holds
nothing secret; the page asks for the key and sends it with its API calls)."""

from __future__ import annotations

import os

from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


def mount(app) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(os.path.join(STATIC, "index.html"), headers={"Cache-Control": "no-cache"})

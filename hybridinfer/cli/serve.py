"""`hybridinfer serve`: the OpenAI- and Anthropic-compatible HTTP server's subcommand."""

from __future__ import annotations

import os
import sys

from ..errors import ParameterError
from .args import _add_cache, _add_model, _int_at_least, parse_size


def cmd_serve(a) -> int:
    """The OpenAI- and Anthropic-compatible HTTP server (hybridinfer.serving.serve) on the engine's scheduler."""
    try:
        from ..serving.serve import create_app, serve
    except ModuleNotFoundError as e:
        raise ParameterError(f"serve needs the server's packages ({e.name} is missing): "
                             f"pip install -e '.[serve]'") from None
    key = a.api_key or os.environ.get("HYBRIDINFER_API_KEY") or None
    if not key and a.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"hybridinfer: warning: serving on {a.host} without an API key: anyone who can reach port {a.port} "
              f"can use the model (set --api-key or HYBRIDINFER_API_KEY)", file=sys.stderr)
    from . import _engine

    app = create_app(_engine(a), api_key=key, model_name=a.model_name, max_queue=a.max_queue,
                     max_body_bytes=a.max_body, close_engine=True)
    serve(app, a.host, a.port, a.log_level)
    return 0


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server (needs the serve extra)")
    _add_model(p)
    # a server's prefixes repeat at turn boundaries and where prompts part ways, which the cache snapshots anyway;
    # stride snapshots inside every long prompt would fill the RAM budget and evict those (issue 21's agent load)
    _add_cache(p, snapshot_stride=0)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_int_at_least(0), default=8080)
    p.add_argument("--api-key", default=None,
                   help="key clients must send (Authorization: Bearer or x-api-key; env HYBRIDINFER_API_KEY)")
    p.add_argument("--model-name", default=None, help="the model id clients name (default: the GGUF's file name)")
    p.add_argument("--max-queue", type=_int_at_least(0), default=64,
                   help="requests that may wait beyond --max-seqs running ones; past that, 429 (default 64)")
    p.add_argument("--max-body", type=parse_size, default=parse_size("16MiB"), help="largest request body")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(fn=cmd_serve)

"""`hybridinfer serve`: the OpenAI- and Anthropic-compatible HTTP server's subcommand."""

from __future__ import annotations

import os
import sys

from ..errors import ParameterError
from .args import _add_cache, _add_model, _int_at_least, _int_in, add_model_names, env_defaults, parse_size

# llama-server's environment variables, each the default of the flag of the same meaning (a flag given wins);
# LLAMA_API_KEY and LLAMA_ARG_ALIAS are read in cmd_serve, LLAMA_ARG_HF_REPO / _HF_FILE by args.resolve_hf (where
# neither -m nor -hf is given: a variable never overrides a flag)
LLAMA_ENV = {"LLAMA_ARG_MODEL": "model", "LLAMA_ARG_CTX_SIZE": "n_ctx", "LLAMA_ARG_THREADS": "threads",
             "LLAMA_ARG_N_PARALLEL": "max_seqs", "LLAMA_ARG_BATCH": "step_tokens", "LLAMA_ARG_HOST": "host",
             "LLAMA_ARG_PORT": "port", "LLAMA_ARG_CACHE_TYPE_K": "cache_type_k",
             "LLAMA_ARG_CACHE_TYPE_V": "cache_type_v", "LLAMA_ARG_CHAT_TEMPLATE_FILE": "chat_template_file",
             "LLAMA_ARG_SPEC_TYPE": "spec_type", "LLAMA_ARG_SPEC_DRAFT_N_MAX": "draft_max",
             "LLAMA_ARG_MMPROJ": "mmproj"}


def cmd_serve(a) -> int:
    """The OpenAI- and Anthropic-compatible HTTP server (hybridinfer.serving.serve) on the engine's scheduler."""
    try:
        from ..serving.serve import create_app, serve
    except ModuleNotFoundError as e:
        raise ParameterError(f"serve needs the server's packages ({e.name} is missing): "
                             f"pip install -e '.[serve]'") from None
    from ..serving.serve.app import LOOPBACK_HOSTS, check_api_keys

    key = a.api_key if a.api_key is not None else (os.environ.get("HYBRIDINFER_API_KEY")
                                                   or os.environ.get("LLAMA_API_KEY") or None)
    if not a.alias and os.environ.get("LLAMA_ARG_ALIAS"):  # a default here, not in the parser: --alias appends
        a.alias = [os.environ["LLAMA_ARG_ALIAS"]]
    keys = list(check_api_keys(key.split(","))) if key is not None else None  # as llama-server: comma-separated
    loopback = a.host in ("127.0.0.1", "localhost", "::1")
    if not keys and not loopback:
        print(f"hybridinfer: warning: serving on {a.host} without an API key: anyone who can reach port {a.port} "
              f"can use the model (set --api-key or HYBRIDINFER_API_KEY)", file=sys.stderr)
    from . import _engine

    app = create_app(_engine(a), api_key=keys, model_name=a.alias or None, strict_model_name=a.strict_model_name,
                     max_queue=a.max_queue, max_body_bytes=a.max_body, report_cached_tokens=a.report_cached_tokens,
                     allowed_hosts=LOOPBACK_HOSTS if loopback and not a.no_host_check else None, close_engine=True,
                     cors_origins=None if a.cors_origin is None else [o for v in a.cors_origin for o in v.split(",")
                                                                       if o.strip()],
                     pooling=a.pooling, allow_remote_images=a.allow_remote_images)
    serve(app, a.host, a.port, a.log_level)
    return 0


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server (needs the serve extra)")
    _add_model(p)
    # a server's prefixes repeat at turn boundaries and where prompts part ways, which the cache snapshots anyway;
    # stride snapshots inside every long prompt would fill the RAM budget and evict those (issue 21's agent load)
    _add_cache(p, snapshot_stride=0)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_int_in(1, 65535), default=8080)
    p.add_argument("--api-key", default=None,
                   help="key clients must send (Authorization: Bearer or x-api-key; env HYBRIDINFER_API_KEY, else "
                        "llama-server's LLAMA_API_KEY); "
                        "several separated by commas, each a tenant of its own in the prefix cache")
    add_model_names(p)
    next(x for x in p._actions if x.dest == "alias").help += " [env LLAMA_ARG_ALIAS]"
    p.add_argument("--max-queue", type=_int_at_least(0), default=64,
                   help="requests that may wait beyond --max-seqs running ones; past that, 429 (default 64)")
    p.add_argument("--max-body", type=parse_size, default=parse_size("16MiB"), help="largest request body")
    p.add_argument("--report-cached-tokens", action="store_true",
                   help="without API keys, still report cached_tokens (it tells a client whether another's prompt "
                        "was cached; with keys each key has its own cache and it is always reported)")
    p.add_argument("--special-in-content", action="store_true",
                   help="message text may make control tokens such as <|im_start|> (llama-server's behaviour); by "
                        "default it is tokenized as text")
    p.add_argument("--no-host-check", action="store_true",
                   help="a keyless server on loopback answers any Host and Origin header (default: only "
                        "localhost, 127.0.0.1 and [::1], against DNS rebinding)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="a web page origin (http://host:port, or '*') whose scripts may call the server (CORS); "
                        "repeatable or comma-separated; '' for none (default: loopback pages for a keyless server "
                        "on loopback, else '*')")
    p.add_argument("--pooling", default="mean", choices=["mean", "last"],
                   help="how /v1/embeddings pools an input's final hidden states: the mean over its tokens, or the "
                        "last token's (for last-token embedding models such as Qwen3-Embedding) (default: mean)")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="fetch images that requests give as http(s) URLs (default: refused with a 400; data: URLs "
                        "and base64 image sources always work)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    env_defaults(p, LLAMA_ENV)
    p.set_defaults(env_hf=(os.environ.get("LLAMA_ARG_HF_REPO") or None, os.environ.get("LLAMA_ARG_HF_FILE") or None))
    for x in p._actions:
        if x.dest in ("hf_repo", "hf_file"):
            x.help += f" [env LLAMA_ARG_{x.dest.upper()}]"
    p.set_defaults(fn=cmd_serve)

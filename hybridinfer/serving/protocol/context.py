"""What turning a request body into an engine Request and its answer back into a body needs, for the server and the
batch runner alike: the engine, the model name clients must give, what the chat template does with tools."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from pydantic import BaseModel, ValidationError

from ...errors import HybridInferError
from .errors import ApiError, from_engine, from_validation
from .prompt import TemplateInfo, check_text_fits


def default_model_name(engine) -> str:
    """The model id clients name by default: the GGUF's file name without .gguf."""
    name = os.path.basename(getattr(engine.gm, "path", "") or "model")
    return name[:-5] if name.lower().endswith(".gguf") else name


class Context:
    """model_name: the served name, or several (aliases): the first is the one answers report. One loaded model
    answers whatever `model` a request names (as llama-server; answers still report the served name), unless
    strict_model_name, where a name that is none of them is a 404 (as vLLM's --served-model-name).
    allow_remote_images: an image given as an http(s) URL is fetched (else refused with a 400 that says so)."""

    allow_remote_images = False

    def __init__(self, engine, model_name: str | Sequence[str], strict_model_name: bool = False):
        names = [model_name] if isinstance(model_name, str) else list(model_name)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"model names must be non-empty strings, got {model_name!r}")
        self.engine, self.model_names = engine, tuple(dict.fromkeys(names))
        self.model_name, self.strict_model_name = self.model_names[0], strict_model_name
        self.info = TemplateInfo.probe(engine)

    def check_model(self, name: str) -> None:
        if self.strict_model_name and name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise ApiError(404, f"the model {name!r} does not exist; the model served is {served}",
                           param="model", code="model_not_found")

    def takes_images(self) -> bool:
        return getattr(self.engine, "image_encoder", None) is not None

    def make_request(self, prompt, max_tokens: int | None, sampling: dict, stop, turn_boundary=None, images=()):
        """A checked Request (prompt: text or token ids; images: one for each `<|image_pad|>` slot of the ids, or
        each media marker of the text). max_tokens None: the rest of the context."""
        eng = self.engine
        if isinstance(prompt, str):
            check_text_fits(eng, len(prompt), "prompt")
        try:
            embs = self._images(images)
            if max_tokens is None:
                n = len(prompt) if isinstance(prompt, list) else len(eng.tokenize(prompt))
                n += sum(e.n_tokens - 1 for e in embs) + (0 if isinstance(prompt, list) else 3 * len(embs))
                if n >= eng.n_ctx:
                    raise ApiError(400, f"the prompt of {n} tokens does not fit the context of n_ctx={eng.n_ctx} "
                                        f"tokens", param="messages", code="context_length_exceeded")
                max_tokens = eng.n_ctx - n
            req = eng.make_request(prompt, max_tokens, stop=stop, images=embs or None, **sampling)
        except HybridInferError as e:
            raise from_engine(e) from None
        if turn_boundary is not None:
            from ...engine.images import map_points

            req.turn_boundary = map_points(turn_boundary, req.images) if req.images else turn_boundary
        return req

    def _images(self, sources) -> list:
        """The images of a request encoded (engine/images.py): a 400 for a model without a vision tower, a remote
        URL not allowed, or an image that cannot be read."""
        if not sources:
            return []
        from ...engine.images import embed

        if not self.takes_images():
            raise ApiError(400, f"this model takes no images: the server was started without --mmproj (a request "
                                f"with {len(sources)} image{'s' if len(sources) > 1 else ''})", param="messages",
                           code="invalid_value")
        return embed(self.engine, sources, allow_remote=self.allow_remote_images)

    def check_schema(self, response_format: dict | None) -> dict | None:
        """The JSON schema a request's output must follow, or None (a 400 for a schema it cannot compile)."""
        from .grammar import schema_of

        return schema_of(response_format)

    def constrain(self, req, schema: dict | None, prepared=None):
        """Attach the grammar of `schema`, or of the forced tool call of `prepared` (a prompt.Prepared), to `req`
        (the scheduler masks its logits each step)."""
        if schema is not None:
            from .grammar import JsonConstraint

            req.constraint = JsonConstraint(self.engine, schema)
        elif prepared is not None and prepared.grammar is not None:
            from .grammar import JsonConstraint

            req.constraint = JsonConstraint(self.engine, param="tool_choice", lark=prepared.grammar)
        return req


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(obj) -> str | None:
    """Where in a decoded JSON value a string holds a lone surrogate (JSON's `"\\ud800"` decodes to one; it is
    no Unicode text and no tokenizer or encoder takes it), as a field path; None when nowhere. Walked without
    recursion (a body nests as deep as its parser allows)."""
    todo = [("", obj)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return path or "the body"
        elif isinstance(v, dict):
            for k, x in v.items():
                if _SURROGATE.search(k):
                    return f"{path}.{k!a}" if path else repr(k)
                todo.append((f"{path}.{k}" if path else k, x))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


def validate(model: type[BaseModel], obj, raw: bytes | None = None) -> BaseModel:
    """A decoded JSON body as `model`, or the 400 naming what is wrong with it. raw: the body's bytes, if known
    (lone surrogates can only come from `\\uD8xx`-style escapes in it; without them it is not searched)."""
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(obj).__name__}", code="invalid_request")
    if raw is None or _SURROGATE_ESCAPE.search(raw):
        where = lone_surrogate(obj)
        if where is not None:
            raise ApiError(400, f"{where}: holds a lone UTF-16 surrogate (an escape such as \\ud800 without its "
                                f"pair), which is not Unicode text", param=where, code="invalid_value")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation(e) from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply", code="invalid_request") from None


def sampling_args(body, *, penalties: bool = True) -> dict:
    """The engine's sampling keywords of a request body; what a body leaves out keeps the engine's default."""
    out = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        v = getattr(body, name, None)
        if v is not None:
            out[name] = v
    if penalties:
        if body.presence_penalty is not None:
            out["presence_penalty"] = body.presence_penalty
        if body.repeat_penalty is not None:
            out["repeat_penalty"] = body.repeat_penalty
        if body.frequency_penalty is not None:
            out["frequency_penalty"] = body.frequency_penalty
    return out


def usage_counts(request, generation) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, prompt tokens restored from the prefix cache) of a finished request."""
    return len(request.ids), len(generation.tokens), int(generation.timings.get("reused_tokens", 0))


def matched_stop(engine, request, generation) -> str | None:
    """The stop string that ended the sequence, if one did (the Generation says "stop" for EOS as well)."""
    stops = request.stops
    if generation.finish_reason != "stop" or not stops or engine.tokenizer is None:
        return None
    full = engine.detokenize(generation.tokens)
    hits = [(full.find(s), s) for s in stops if s in full]
    return min(hits)[1] if hits else None


def parse_events(parser, first, pieces) -> list:
    """A whole answer's events: the parser's (or ("text", piece) without one) over the pieces, as a client that
    reads the stream to its end gets them."""
    events = list(first)
    for piece in pieces:
        events += parser.feed(piece) if parser is not None else [("text", piece)]
    return events + (parser.finish() if parser is not None else [])

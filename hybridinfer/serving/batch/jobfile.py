"""Lines of a batch job: input lines in the OpenAI Batch format (or a plain form) made into calls of the shared
request protocol, output lines as OpenAI writes them, and the deterministic split of a job into shards.

Input: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" | "/v1/messages",
"body": {...}}` (bodies as the server takes them), or plain `{"custom_id", "messages" | "prompt", ...sampling}`,
which is a chat/completions or completions body without the `model` field (the loaded model is meant).

Output: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. A request the server
would refuse (an invalid body, a prompt too long) gets the server's status and error body, with `error` null, as
OpenAI writes HTTP errors; a line that is no request at all (not JSON, no custom_id, an unknown url, a custom_id
used before, a line over the length limit) gets `response` null and `error` {code, message}. The `id` is
`batch_req_<input line number>`: a resumed job keys on it and checks that the record's custom_id is that line's (the
input itself is the one the output was begun on: guard.py), so a line is done once whatever its custom_id."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass

from ..protocol.anthropic import MessagesCall
from ..protocol.context import validate
from ..protocol.errors import ApiError
from ..protocol.models import AMessagesRequest, ChatRequest, CompletionRequest
from ..protocol.openai import ChatCall, CompletionCall

# url -> (body model, call, error shape)
ROUTES = {"/v1/chat/completions": (ChatRequest, ChatCall, "openai"),
          "/v1/completions": (CompletionRequest, CompletionCall, "openai"),
          "/v1/messages": (AMessagesRequest, MessagesCall, "anthropic")}
ID_PREFIX = "batch_req_"


class LineError(Exception):
    """An input line that is no request: written as an error line with `code` and `message`."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


@dataclass
class Line:
    """An input line read as a request: which route it goes to and its body (not yet validated)."""

    number: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: object


def custom_id_of(obj) -> str | None:
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None


def read_line(number: int, raw: bytes, model_name: str) -> Line:
    """One input line as a Line, or a LineError naming what is wrong with it."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise LineError("invalid_json", f"line {number} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"line {number} must be a JSON object, not {type(obj).__name__}")
    cid = custom_id_of(obj)
    if cid is None:
        got = obj.get("custom_id")
        raise LineError("missing_custom_id", f"line {number} has no custom_id string"
                                             + (f" (got {got!r})" if got is not None else ""))
    if "url" in obj or "body" in obj:
        method, url = obj.get("method", "POST"), obj.get("url")
        if method != "POST":
            raise LineError("invalid_method", f"line {number}: method must be 'POST', got {method!r}", cid)
        if url not in ROUTES:
            raise LineError("invalid_url", f"line {number}: url {url!r} is not one of {', '.join(ROUTES)}", cid)
        return Line(number, cid, url, obj.get("body"))
    body = {k: v for k, v in obj.items() if k != "custom_id"}
    if ("messages" in body) == ("prompt" in body):
        raise LineError("invalid_request", f"line {number} needs either url and body (the OpenAI Batch format) or "
                                           f"exactly one of 'messages' and 'prompt'", cid)
    body.setdefault("model", model_name)
    return Line(number, cid, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)


def make_call(ctx, line: Line):
    """The protocol call of a line's body (ApiError as the server would answer it)."""
    model, call, _ = ROUTES[line.url]
    if line.body is None:
        raise ApiError(400, "the body is missing; a JSON object is expected", code="invalid_json")
    return call(ctx, validate(model, line.body))


def api_of(url: str) -> str:
    return ROUTES[url][2] if url in ROUTES else "openai"


# output -----------------------------------------------------------------------------------------------------------
def line_id(number: int) -> str:
    return f"{ID_PREFIX}{number}"


def line_number(record: dict) -> int | None:
    """The input line an output record answers (None: not a record of a batch job)."""
    rid = record.get("id") if isinstance(record, dict) else None
    if isinstance(rid, str) and rid.startswith(ID_PREFIX) and rid[len(ID_PREFIX):].isdigit():
        return int(rid[len(ID_PREFIX):])
    return None


def ok_record(number: int, custom_id: str, body: dict) -> dict:
    return {"id": line_id(number), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": "req_" + uuid.uuid4().hex, "body": body}, "error": None}


def api_error_record(number: int, custom_id: str, err: ApiError, api: str) -> dict:
    body = err.anthropic_body() if api == "anthropic" else err.openai_body()
    return {"id": line_id(number), "custom_id": custom_id,
            "response": {"status_code": err.status, "request_id": "req_" + uuid.uuid4().hex, "body": body},
            "error": None}


def line_error_record(number: int, err: LineError) -> dict:
    return {"id": line_id(number), "custom_id": err.custom_id, "response": None,
            "error": {"code": err.code, "message": err.message}}


def dumps(record: dict) -> bytes:
    """A record as one line of UTF-8 JSON. A string that UTF-8 cannot carry (a lone surrogate, as in a custom_id
    "bad\\ud800", which is valid JSON) is written as its \\u escape instead, so the line reads back the same."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
    try:
        return text.encode()
    except UnicodeEncodeError:
        return (json.dumps(record, separators=(",", ":")) + "\n").encode()


# shards -----------------------------------------------------------------------------------------------------------
def shard_key(number: int, raw: bytes) -> str:
    """What a line's shard is decided by: its custom_id (so a duplicate lands in the same shard as the first and is
    found there), or, for a line without one, its line number."""
    try:
        cid = custom_id_of(json.loads(raw))
    except (ValueError, RecursionError):
        cid = None
    return "id:" + cid if cid is not None else f"line:{number}"


def shard_of(key: str, n: int) -> int:
    """Which of n shards a key belongs to: a stable hash (the same on every machine and Python run)."""
    h = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") % n


def parse_shard(spec: str) -> tuple[int, int]:
    """'i/n' -> (i, n) with 0 <= i < n."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"a shard is i/n with whole numbers, e.g. 0/4, got {spec!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"a shard i/n needs n >= 1 and 0 <= i < n, got {spec!r}")
    return i, n

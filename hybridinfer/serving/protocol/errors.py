"""Errors of a request (served over HTTP or read from a batch file): one exception type, rendered in the OpenAI or
the Anthropic error shape."""

from __future__ import annotations

from pydantic import ValidationError

from ...errors import CapacityError, ContextLengthError, HybridInferError

# Anthropic names its error types by status; OpenAI keeps `invalid_request_error` for most client errors
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}
_OPENAI_TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """A request the server refuses: the status, a message naming the bad value, and the parameter it is in."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": _OPENAI_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def unsupported(param: str, value) -> ApiError:
    return ApiError(400, f"{param}={value!r} is not supported by this server", param=param,
                    code="unsupported_parameter")


# pydantic marks which member of a union it tried with the member's type name; a client knows only field names
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}
_TAG_PREFIXES = ("function-", "literal", "constrained-")


def _loc_name(loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part[:1].isupper() or part.startswith(_TAG_PREFIXES):
            continue
        else:
            out += f".{part}" if out else part
    return out


def from_validation(e: ValidationError) -> ApiError:
    """The most specific error of a failed validation (the deepest location: inside a union, the member that got
    furthest, and of those one whose value was of the right type but out of range), as a 400 naming the field."""
    errs = e.errors(include_url=False)
    if any(x["type"] == "json_invalid" for x in errs):
        err = next(x for x in errs if x["type"] == "json_invalid")
        return ApiError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    err = max(errs, key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
    name = _loc_name(err["loc"])
    if not name:
        return ApiError(400, f"the body must be a JSON object: {err['msg']}", code="invalid_request")
    if err["type"] == "missing":
        return ApiError(400, f"{name}: a required field is missing", param=name, code="missing_field")
    return ApiError(400, f"{name}: {err['msg']}", param=name, code="invalid_type")


def from_engine(e: HybridInferError) -> ApiError:
    """The engine refuses bad input with typed errors whose message already names the value."""
    if isinstance(e, ContextLengthError):
        return ApiError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, CapacityError):
        return ApiError(400, str(e), code="capacity_exceeded")
    return ApiError(400, str(e), code="invalid_value")

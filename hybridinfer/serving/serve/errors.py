"""The request errors moved to hybridinfer.serving.protocol.errors (shared with the batch runner); re-exported here for
the
imports that name this module."""

from ..protocol.errors import ApiError, bad_param, from_engine, from_validation, unsupported

__all__ = ["ApiError", "bad_param", "from_engine", "from_validation", "unsupported"]

"""Structured output moved to hybridinfer.serving.protocol.grammar (shared with the batch runner); re-exported here for
the
imports that name this module."""

from ..protocol.grammar import JsonConstraint, ll_tokenizer, schema_of  # noqa: F401

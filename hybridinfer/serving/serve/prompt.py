"""Prompt building moved to hybridinfer.serving.protocol.prompt (shared with the batch runner); re-exported here for the
imports that name this module."""

from ..protocol.prompt import (  # noqa: F401
    Prepared,
    TemplateInfo,
    args_mapping,
    build_chat,
    forced_prefix,
    normalize_tool_choice,
    tool_schemas,
)

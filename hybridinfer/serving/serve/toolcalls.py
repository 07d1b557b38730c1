"""Tool-call parsing moved to hybridinfer.serving.protocol.toolcalls (shared with the batch runner); re-exported here
for the
imports that name this module."""

from ..protocol.toolcalls import OutputParser, ToolCall, parse_all, parse_tool_call  # noqa: F401

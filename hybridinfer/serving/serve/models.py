"""The request bodies moved to hybridinfer.serving.protocol.models (shared with the batch runner); re-exported here for
the
imports that name this module."""

from ..protocol.models import (  # noqa: F401
    ABlock,
    ACountTokens,
    AMessage,
    AMessagesRequest,
    AThinking,
    ATool,
    AToolChoice,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ContentPart,
    FunctionCall,
    FunctionDef,
    StreamOptions,
    ToolCallIn,
    ToolDef,
)

"""Request bodies: OpenAI chat / completions and Anthropic messages, as pydantic models.

Strict: a number sent as a string or a bool sent as "true" is a client's mistake, and is refused naming the field
rather than guessed at. Unknown fields are allowed, since clients send fields this server has no use for (`user`,
`metadata`, `store`); fields that would change the answer and are not implemented are refused by the routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# the lists a body may hold: an agent's longest history fits; 470k one-word messages (seconds of rendering) do not
MAX_MESSAGES = 8192
MAX_TOOLS = 1024
MAX_STOPS = 16  # as llama-server's default cap on stop strings (OpenAI allows 4)


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]  # larger ones overflow the engine's C types
Stops = Annotated[list[str], Field(max_length=MAX_STOPS)]


def _count(n: int | None = None, lo: int = 0):
    """An optional whole number from `lo` up to int64's largest."""
    return Field(n, ge=lo, le=INT64_MAX)


class _Body(BaseModel):
    # finite numbers only: JSON's NaN / Infinity extensions (which Python's json reads) and 1e999 are refused
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


# OpenAI -----------------------------------------------------------------------------------------------------------
class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: int | None = _count()
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = _count()
    min_p: float | None = Field(None, ge=0, lt=1)
    seed: Int64 | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_penalty: float | None = Field(None, gt=0)  # llama.cpp's name, for its clients
    stop: str | Stops | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = _count(None, 1)
    logprobs: bool | Int64 | None = None
    response_format: dict[str, Any] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = _count()
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    top_logprobs: Int64 | None = None


class ApplyTemplateRequest(ChatRequest):
    """llama-server's /apply-template: a chat body whose model may be left out."""

    model: str | None = None


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[Int64] = Field(max_length=1 << 20)


class ResponsesRequest(_Body):
    """OpenAI's /v1/responses body (input items and tools are checked where they are turned into a chat)."""

    model: str
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = _count(None, 1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = _count()
    seed: Int64 | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class EmbeddingsRequest(_Body):
    model: str
    input: str | list[str] | list[Int64] | list[list[Int64]] = Field(max_length=2048)  # OpenAI's bound
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = _count(None, 1)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: Int64 | None = None


# Anthropic --------------------------------------------------------------------------------------------------------
class ABlock(_Body):
    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ABlock] | None = None
    is_error: bool | None = None


class AMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ABlock]


class ATool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class AToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AThinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = _count()  # negative budgets are refused; the model's template has no use for it


class ACountTokens(_Body):
    model: str
    messages: list[AMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[ABlock] | None = None
    tools: list[ATool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AToolChoice | None = None
    thinking: AThinking | None = None


class AMessagesRequest(ACountTokens):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: Stops | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = _count()

"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): request and response
bodies (pydantic), strict as the OpenAI ones (protocol.RequestModel).

Content blocks are text, tool_use (in assistant turns) and tool_result (in user turns); other
block types (images, documents, thinking) and server tools are refused by the schema.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, StringConstraints

from pagedllm.entrypoints.openai.protocol import (
    NonEmptyStr,
    OpenAIBaseModel,
    RequestBody,
    RequestModel,
)

# ---- request ----


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] = ""
    is_error: bool = False


BLOCK_TYPES = ("text", "tool_use", "tool_result")
# What pydantic puts after a list index in an error's loc (api_server drops it from paths).
MESSAGES_UNION_TAGS = BLOCK_TYPES
ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock],
                         Field(discriminator="type")]


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(RequestModel):
    # Anthropic's rule for tool names (a subset of what the chat path allows).
    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(RequestModel):
    """auto: the model may call; any: it must call one of the tools; tool: it must call
    `name`; none: the tools are not shown."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    # "schema" shadows a BaseModel attribute: a field of another name, aliased.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    """Structured output: the answer is JSON valid against `format.schema` (the grammar
    path); `effort` is accepted and has no effect."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(RequestBody):
    model: str | None = None  # Anthropic requires it; here None means the served model
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[NonEmptyStr] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


# ---- response ----


class TextOut(OpenAIBaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(OpenAIBaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessagesResponse(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Union[TextOut, ToolUseOut]]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(OpenAIBaseModel):
    input_tokens: int


class AnthropicErrorDetail(OpenAIBaseModel):
    type: str
    message: str


class AnthropicErrorResponse(OpenAIBaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail

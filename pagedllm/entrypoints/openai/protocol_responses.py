"""OpenAI's Responses API (/v1/responses): request and response bodies (pydantic).

Strict as the chat bodies are (protocol.RequestModel). Input items are told apart by their
`type`; a message item may leave it out (OpenAI's "easy input message"). Tools are function
tools only; other tool types, and input items other than messages, function calls, their
outputs and reasoning items, are refused by the schema.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StringConstraints, Tag

from pagedllm.entrypoints.openai.protocol import (
    NonEmptyStr,
    OpenAIBaseModel,
    RequestBody,
    RequestModel,
    now,
)


def _tag_of(field: str, default: str | None = None):
    """A discriminator by `field` that tolerates a missing field (then `default`) and a
    non-string value (then no tag: a 400 naming the field)."""

    def tag(value: Any) -> str | None:
        found = value.get(field, default) if isinstance(value, dict) else getattr(
            value, field, default)
        return found if isinstance(found, str) else None

    tag.__name__ = field  # pydantic names the discriminator `type()` in its errors
    return Discriminator(tag)


# ---- input ----


class InputText(RequestModel):
    type: Literal["input_text"]
    text: str


class OutputText(RequestModel):
    """Text of an earlier assistant turn, as a client sends back a response's output."""

    type: Literal["output_text"]
    text: str


ContentPart = Annotated[
    Union[Annotated[InputText, Tag("input_text")], Annotated[OutputText, Tag("output_text")]],
    _tag_of("type"),
]


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str  # JSON text
    id: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[InputText]
    id: str | None = None


class ReasoningItem(RequestModel):
    """A reasoning item sent back by a client: accepted and not shown to the model (OpenAI
    does not show earlier reasoning either, outside its own store)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# What pydantic puts after a list index in an error's loc (api_server drops it from paths).
RESPONSES_UNION_TAGS = (*INPUT_ITEM_TYPES, "input_text", "output_text")
InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
    ],
    _tag_of("type", default="message"),
]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    """text.format: "text" (no constraint), "json_object", or "json_schema" with `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    # "schema" shadows a BaseModel attribute: a field of another name, aliased.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    # Default: "auto" with tools, "none" without.
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    # Kept in the server's bounded in-memory store (serving_responses.ResponseStore).
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


# ---- output ----


class OutputTextPart(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextPart]


class OutputFunctionCall(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Union[OutputMessage, OutputFunctionCall]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    truncation: Literal["disabled"] = "disabled"

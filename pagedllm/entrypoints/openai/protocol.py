"""The OpenAI API's request and response bodies (pydantic), with the sampling extras vLLM adds.

Request bodies are strict, as OpenAI's are: JSON types are not coerced ("yes" is no boolean,
false is no token id), numbers are finite, and ranges the engine enforces are in the schema.
Fields the server does not know are ignored, with one warning per field name (as vLLM).
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    StringConstraints,
    model_validator,
)
from pydantic_core import PydanticCustomError

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # as SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Unknown field names already logged; bounded, since clients choose the names.
_warned_fields: set[tuple[str, str]] = set()
MAX_WARNED_FIELDS = 1000


class RequestModel(OpenAIBaseModel):
    """A request body or a part of one: strict types, finite numbers, unknown fields logged."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="wrap")
    @classmethod
    def _warn_unknown_fields(cls, data: Any, handler: ModelWrapValidatorHandler) -> Any:
        result = handler(data)
        if isinstance(data, dict) and len(_warned_fields) < MAX_WARNED_FIELDS:
            known = cls.model_fields.keys() | {
                f.alias for f in cls.model_fields.values() if f.alias}
            new = sorted(name for name in data.keys() - known
                         if (cls.__name__, name) not in _warned_fields)
            if new:
                room = MAX_WARNED_FIELDS - len(_warned_fields)
                _warned_fields.update((cls.__name__, name) for name in new[:room])
                shown = ", ".join(map(repr, new[:10])) + (" ..." if len(new) > 10 else "")
                logger.warning("%s: ignoring the unknown field(s) %s (logged once per field)",
                               cls.__name__, shown)
        return result


class RequestBody(RequestModel):
    """A whole request body: text anywhere in it must be valid Unicode (no lone surrogate,
    which JSON's \\ud800 escapes can carry and no tokenizer or UTF-8 encoder accepts)."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        path = _lone_surrogate(data, ())
        if path is not None:
            where = ".".join(map(str, path)) or "body"
            raise PydanticCustomError(
                "lone_surrogate", "{where} contains a lone surrogate, which is not valid Unicode",
                {"where": where},
            )
        return data


def _lone_surrogate(value: Any, path: tuple) -> tuple | None:
    """The path of the first string (or key) that cannot be encoded as UTF-8, if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, (*path, "key")) or _lone_surrogate(item, (*path, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, (*path, i))
            if found is not None:
                return found
    return None


NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]+$")]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


# ---- errors ----


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared pieces ----


class StreamOptions(RequestModel):
    include_usage: bool = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class JsonSchemaFormat(RequestModel):
    name: str = "response"
    description: str | None = None
    # "schema" shadows a BaseModel attribute in pydantic: a field of another name, aliased.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False,
                              populate_by_name=True)


class ResponseFormat(RequestModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object),
    "json_schema" (JSON valid against json_schema.schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` extra: exactly one of these (as StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False,
                              populate_by_name=True)


class SamplingFields(RequestBody):
    """Sampling parameters both endpoints accept; SamplingParams checks them again."""

    model: str | None = None
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Int64 | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured output: OpenAI's response_format, or vLLM's extras (one constraint in all).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# ---- /v1/completions ----


class CompletionRequest(SamplingFields):
    # A string, a batch of strings, token ids, or a batch of token id lists.
    prompt: (
        NonEmptyStr
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
    )
    # None: the server's default (16 as OpenAI's, or `serve --max-tokens-default`).
    max_tokens: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "error"] | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# Stream chunks use the same shape as the full response (object "text_completion").
CompletionStreamResponse = CompletionResponse


# ---- /v1/chat/completions ----


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


# A message's content: a string or text parts (joined for the chat template).
TextContent = str | list[TextPart]


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(RequestModel):
    role: Literal["system"]
    content: TextContent
    name: str | None = None


class DeveloperMessage(RequestModel):
    """OpenAI's newer name for a system message; the chat template sees role "system"."""

    role: Literal["developer"]
    content: TextContent
    name: str | None = None


class UserMessage(RequestModel):
    role: Literal["user"]
    content: TextContent
    name: str | None = None


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: TextContent | None = None  # null when the turn only calls tools
    name: str | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: str


ChatMessage = Annotated[
    Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage],
    Field(discriminator="role"),
]
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionDefinition(RequestModel):
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    # Default: "auto" with tools, "none" without.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Neither set: the server's default (the rest of the context, as vLLM's, or
    # `serve --max-tokens-default`).
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's extras: continue the last (assistant) message instead of opening a new turn
    # (needs add_generation_prompt false); the prompt's logprobs (top N) in the response.
    continue_final_message: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: extra variables of the chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: most tokens of thinking (with --reasoning-parser); then </think> is forced.
    thinking_token_budget: int | None = Field(None, ge=0)


class PromptLogprob(OpenAIBaseModel):
    """One prompt token's logprob as vLLM writes it (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


def _absent(value: Any) -> bool:
    return value is None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    # The thinking, with --reasoning-parser (absent otherwise).
    reasoning_content: str | None = Field(None, exclude_if=_absent)
    content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


# "error": the request's grammar failed mid-way (stop_reason says why); never a plain "stop".
FinishReason = Literal["stop", "length", "tool_calls", "error"]


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    # With prompt_logprobs: per prompt token (None for the first), token id -> logprob.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    reasoning_content: str | None = Field(None, exclude_if=_absent)
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer ----


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedllm"
    root: str | None = None  # a LoRA adapter's path
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(RequestBody):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


# A text, or a conversation through the chat template (as vLLM's /tokenize).
TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class HealthResponse(OpenAIBaseModel):
    status: Literal["ok"] = "ok"

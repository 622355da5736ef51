"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) on top of the
chat path.

A request becomes a ChatCompletionRequest (system → a system message, tool_use blocks →
assistant tool calls, tool_result blocks → tool messages, tool_choice any → "required",
tool → a named function) and runs through OpenAIServingChat; its answer or chunk stream is
turned back into a message or Anthropic's stream events.

Errors keep Anthropic's shape, {"type": "error", "error": {"type", "message"}}, for every
error a handler raises (validation, the key, the model, the engine): the routes use their
own APIRoute class. The key may come as `x-api-key` (Anthropic's clients) or as
`Authorization: Bearer`.
"""
from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from pagedllm.entrypoints.openai.auth import key_check, key_error
from pagedllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from pagedllm.entrypoints.openai.protocol_anthropic import (
    AnthropicErrorDetail,
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicUsage,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    TextBlock,
    TextOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, ToolPlan
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, SSEResponse

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error"}


def anthropic_error(error: OpenAIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status_code, "api_error")
    return AnthropicErrorResponse(error=AnthropicErrorDetail(
        type=kind, message=error.message)).model_dump()


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def chat_messages(request: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as chat messages. A tool_result must answer a tool_use of the
    assistant turn before it; tool_use blocks belong to assistant turns, tool_result blocks
    to user turns. A final assistant turn (Anthropic's prefill, which the answer continues)
    is refused: the chat template would close it and start a new turn."""
    last = len(request.messages) - 1
    if request.messages[last].role == "assistant":
        raise OpenAIError(f"messages.{last}: a final assistant message (a prefill) is not "
                          "supported; end the conversation with a user message",
                          param=f"messages.{last}")
    messages: list[ChatMessage] = []
    if request.system:
        messages.append(SystemMessage(role="system", content=_text(request.system)))
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            kind = UserMessage if message.role == "user" else AssistantMessage
            messages.append(kind(role=message.role, content=message.content))
        elif message.role == "assistant":
            messages.append(_assistant_turn(message, i))
        else:
            asked = _asked_ids(messages[-1] if messages else None)
            messages.extend(_user_turn(message, i, asked))
    return messages


def _asked_ids(previous: ChatMessage | None) -> set[str]:
    if isinstance(previous, AssistantMessage):
        return {c.id for c in previous.tool_calls or []}
    return set()


def _assistant_turn(message: AnthropicMessage, i: int) -> AssistantMessage:
    texts, calls = [], []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            raise OpenAIError(f"messages.{i}.content.{j}: a tool_result block belongs in a "
                              "user message", param=f"messages.{i}.content.{j}")
        if isinstance(block, ToolUseBlock):
            calls.append(ToolCall(id=block.id, function=FunctionCall(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
        else:
            texts.append(block.text)
    return AssistantMessage(role="assistant", content="".join(texts) or None,
                            tool_calls=calls or None)


def _user_turn(message: AnthropicMessage, i: int, asked: set[str]) -> list[ChatMessage]:
    """Text blocks as user messages, each tool_result as a tool message, in their order."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, ToolUseBlock):
            raise OpenAIError(f"{where}: a tool_use block belongs in an assistant message",
                              param=where)
        if isinstance(block, TextBlock):
            texts.append(block.text)
            continue
        if block.tool_use_id not in asked:
            raise OpenAIError(
                f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: "
                f"{block.tool_use_id}. Each `tool_result` block must have a corresponding "
                "`tool_use` block in the previous message.", param=where)
        if texts:
            out.append(UserMessage(role="user", content="\n".join(texts)))
            texts = []
        content = _text(block.content)
        out.append(ToolMessage(role="tool", tool_call_id=block.tool_use_id,
                               content=f"Error: {content}" if block.is_error else content))
    if texts or not out:
        out.append(UserMessage(role="user", content="\n".join(texts)))
    return out


def chat_request(request: CountTokensRequest, max_tokens: int | None = None
                 ) -> ChatCompletionRequest:
    tools = [ChatTool(function=FunctionDefinition(name=t.name, description=t.description,
                                                  parameters=t.input_schema))
             for t in request.tools or []]
    choice = request.tool_choice
    tool_choice: Any = None
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise OpenAIError("tool_choice of type \"tool\" needs a name",
                                  param="tool_choice.name")
            tool_choice = NamedToolChoice(function=NamedFunction(name=choice.name))
        else:
            tool_choice = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    fields: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        fmt = request.output_config.format if request.output_config else None
        fields = dict(stop=request.stop_sequences, temperature=request.temperature,
                      response_format=ResponseFormat(type="json_schema", json_schema=(
                          JsonSchemaFormat(schema=fmt.json_schema))) if fmt else None,
                      top_p=request.top_p, top_k=request.top_k, stream=request.stream,
                      stream_options=StreamOptions(include_usage=True)
                      if request.stream else None)
    try:
        return ChatCompletionRequest(
            model=request.model, messages=chat_messages(request), tools=tools or None,
            tool_choice=tool_choice,
            parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
            max_tokens=max_tokens, **fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(map(str, error["loc"]))
        raise OpenAIError(f"the request is no valid conversation ({where}: {error['msg']})"
                          ) from None


def stop_reason(finish_reason: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the chat path's finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _content(text: str | None, calls: list[tuple[str, str, str]]) -> list[Any]:
    """The answer's blocks: its text (also when empty and nothing was called), then one
    tool_use per (id, name, arguments)."""
    blocks: list[Any] = [TextOut(text=text)] if text or not calls else []
    for call_id, name, arguments in calls:
        blocks.append(ToolUseOut(id=tool_use_id(call_id), name=name,
                                 input=json.loads(arguments or "{}")))
    return blocks


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        self.chat.check_model(request.model)
        chat = chat_request(request)
        plan = ToolPlan(chat)
        prompt = await self.chat.render_prompt(chat.messages, True, plan.tools or None)
        limit = self.chat.engine.max_model_len
        if len(prompt) >= limit:  # as a create would say (no room for one new token)
            raise OpenAIError(f"prompt is too long: {len(prompt)} tokens, but the model's "
                              f"context is {limit} tokens (the prompt must leave room for one "
                              "new token)")
        return CountTokensResponse(input_tokens=len(prompt))

    async def create_message(self, request: MessagesRequest) -> MessagesResponse | SSEResponse:
        self.chat.check_model(request.model)
        result = await self.chat.create_chat_completion(chat_request(request,
                                                                     request.max_tokens))
        message_id = f"msg_{uuid.uuid4().hex}"
        if isinstance(result, SSEResponse):
            events = MessageEvents(message_id, self.chat.model_name, result.prompt_tokens)
            return SSEResponse(events.run(result.events), result.streams, result.prompt_tokens)
        assert isinstance(result, ChatCompletionResponse)
        (choice,) = result.choices
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
        return MessagesResponse(
            id=message_id, model=self.chat.model_name,
            content=_content(choice.message.content, [
                (c.id, c.function.name, c.function.arguments)
                for c in choice.message.tool_calls]),
            stop_reason=reason, stop_sequence=sequence,
            usage=AnthropicUsage(input_tokens=result.usage.prompt_tokens,
                                 output_tokens=result.usage.completion_tokens),
        )


class MessageEvents:
    """Anthropic's stream from the chat path's chunks: message_start, a ping, one text
    block that opens at the first text, a tool_use block per call (its input as one
    input_json_delta), message_delta with the stop reason and usage, message_stop."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.blocks = 0  # blocks opened so far
        self.text_open = False

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    async def run(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        yield self.event("message_start", message={
            "id": self.message_id, "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}})
        yield self.event("ping")
        finish, stop, output_tokens = None, None, 0
        async for raw in chunks:
            data = raw.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = OpenAIError(chunk["error"].get("message", ""), 500 if chunk["error"].get(
                    "type") == "internal_server_error" else 400)
                yield self.event("error", error=anthropic_error(error)["error"])
                return
            if chunk.get("usage"):
                output_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                for text in self._delta(choice["delta"]):
                    yield text
                if choice.get("finish_reason"):
                    finish, stop = choice["finish_reason"], choice.get("stop_reason")
        if self.text_open or not self.blocks:
            for text in [*([] if self.text_open else self._open_text()), self._close()]:
                yield text
        reason, sequence = stop_reason(finish, stop)
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens}
        yield self.event("message_delta",
                         delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)
        yield self.event("message_stop")

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        events = []
        if delta.get("content"):
            if not self.text_open:
                events += self._open_text()
            events.append(self.event("content_block_delta", index=self.blocks - 1, delta={
                "type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            if self.text_open:
                events.append(self._close())
            function = call["function"]
            events.append(self.event("content_block_start", index=self.blocks, content_block={
                "type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"],
                "input": {}}))
            self.blocks += 1
            events.append(self.event("content_block_delta", index=self.blocks - 1, delta={
                "type": "input_json_delta", "partial_json": function["arguments"]}))
            events.append(self._close())
        return events

    def _open_text(self) -> list[str]:
        self.text_open = True
        self.blocks += 1
        return [self.event("content_block_start", index=self.blocks - 1,
                           content_block={"type": "text", "text": ""})]

    def _close(self) -> str:
        self.text_open = False
        return self.event("content_block_stop", index=self.blocks - 1)


class AnthropicRoute(APIRoute):
    """A route whose errors, its body's validation included, answer in Anthropic's shape."""

    validation_to_error: Callable[[RequestValidationError], OpenAIError]

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()
        to_error = type(self).validation_to_error

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                error = await key_error(request) or to_error(exc)
            except OpenAIError as exc:
                error = exc
            return JSONResponse(anthropic_error(error), status_code=error.status_code)

        return route


def messages_router(
    chat: OpenAIServingChat, api_key: bytes | None, respond: Callable[[Any], Any],
    cancel_on_disconnect: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
    validation_to_error: Callable[[RequestValidationError], OpenAIError],
) -> APIRouter:
    """The Messages API's routes, behind the key (x-api-key or Authorization: Bearer)."""
    serving = AnthropicServingMessages(chat)

    @key_check
    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("x-api-key")
        if given is None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            given = given.strip() if scheme.lower() == "bearer" else ""
        # Starlette decodes headers as latin-1: encoding back gives the bytes sent.
        if not hmac.compare_digest(given.encode("latin-1"), api_key):
            raise OpenAIError("invalid x-api-key", 401)

    route_class = type("Route", (AnthropicRoute,), {
        "validation_to_error": staticmethod(validation_to_error)})
    router = APIRouter(dependencies=[Depends(check_key)], route_class=route_class)
    doc = {"model": AnthropicErrorResponse}
    errors: dict[int | str, dict] = {
        400: {**doc, "description": "Invalid request (Anthropic's error shape)"},
        404: {**doc, "description": "Unknown model"},
        413: {**doc, "description": "Body over --max-request-bytes"},
    }
    if api_key is not None:
        errors[401] = {**doc, "description": "Missing or wrong key (`x-api-key: KEY` or "
                                             "`Authorization: Bearer KEY`)"}
    stream_doc = {"description": "JSON, or Anthropic's server-sent events with `stream: true`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}

    @router.post("/v1/messages", response_model=None,
                 responses={**errors, 200: {"model": MessagesResponse, **stream_doc}})
    async def create_message(body: MessagesRequest, raw: Request) -> Any:
        return respond(await cancel_on_disconnect(raw, serving.create_message(body)))

    @router.post("/v1/messages/count_tokens", responses=errors)
    async def count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return await serving.count_tokens(body)

    return router

"""POST /v1/responses (OpenAI's Responses API) on top of the chat path.

A request becomes a ChatCompletionRequest (input items → chat messages, function tools →
chat tools, text.format → response_format) and runs through OpenAIServingChat: one prompt
renderer, one tool-call grammar and parser, one structured-output path. Its answer (or its
chunk stream) is turned back into a response object (or the Responses API's typed events).

Stored responses: with `store` (the default, as OpenAI's) a response and its conversation
stay in a bounded in-memory store of the last STORE_SIZE responses, for
`previous_response_id` and GET /v1/responses/{id}; older ones are forgotten (a
previous_response_id that is gone is a 400 that says so). Nothing survives a restart.
"""
from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from pagedllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatTool,
    DeveloperMessage,
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
from pagedllm.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    IncompleteDetails,
    MessageItem,
    OutputFunctionCall,
    OutputMessage,
    OutputTextPart,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, SSEResponse

STORE_SIZE = 256

_MESSAGE_TYPES = {"user": UserMessage, "system": SystemMessage, "developer": DeveloperMessage,
                  "assistant": AssistantMessage}


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]  # without the instructions, which are not carried over


class ResponseStore:
    """The last `size` stored responses, oldest forgotten first."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, item: StoredResponse) -> None:
        self._items[item.response.id] = item
        self._items.move_to_end(item.response.id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)


def input_messages(request: ResponsesRequest, earlier: list[ChatMessage]) -> list[ChatMessage]:
    """The conversation: the stored one of previous_response_id, then this request's input
    items as chat messages. Consecutive function calls join one assistant turn; a
    function_call_output must answer a function call made earlier in the conversation."""
    messages = list(earlier)
    if isinstance(request.input, str):
        return [*messages, UserMessage(role="user", content=request.input)]
    for i, item in enumerate(request.input):
        if isinstance(item, MessageItem):
            content = item.content if isinstance(item.content, str) else "".join(
                part.text for part in item.content)
            messages.append(_MESSAGE_TYPES[item.role](role=item.role, content=content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                                   arguments=item.arguments))
            last = messages[-1] if messages else None
            if isinstance(last, AssistantMessage):
                messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []),
                                                                      call]})
            else:
                messages.append(AssistantMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in _call_ids(messages):
                raise OpenAIError(f"input.{i}: no function_call with call_id "
                                  f"{item.call_id!r} precedes this function_call_output",
                                  param=f"input.{i}.call_id")
            output = item.output if isinstance(item.output, str) else "".join(
                part.text for part in item.output)
            messages.append(ToolMessage(role="tool", content=output, tool_call_id=item.call_id))
    return messages


def _call_ids(messages: list[ChatMessage]) -> set[str]:
    return {c.id for m in messages if isinstance(m, AssistantMessage) for c in m.tool_calls or []}


def chat_request(request: ResponsesRequest, conversation: list[ChatMessage]
                 ) -> ChatCompletionRequest:
    """The chat request that answers `request` (its conversation already resolved)."""
    messages = list(conversation)
    if request.instructions:
        messages.insert(0, SystemMessage(role="system", content=request.instructions))
    tools = [ChatTool(function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in request.tools or []]
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(function=NamedFunction(name=choice.name))
    fmt = request.text.format if request.text else None
    response_format = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise OpenAIError('text.format of type "json_schema" needs a schema',
                              param="text.format.schema")
        response_format = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.json_schema,
            strict=fmt.strict))
    elif fmt is not None and fmt.type == "json_object":
        response_format = ResponseFormat(type="json_object")
    try:
        return ChatCompletionRequest(
            model=request.model, messages=messages, tools=tools or None, tool_choice=choice,
            parallel_tool_calls=request.parallel_tool_calls,
            max_completion_tokens=request.max_output_tokens, temperature=request.temperature,
            top_p=request.top_p, user=request.user, response_format=response_format,
            stream=request.stream,
            stream_options=StreamOptions(include_usage=True) if request.stream else None,
        )
    except ValidationError as exc:  # e.g. an input of reasoning items only
        error = exc.errors()[0]
        where = ".".join(map(str, error["loc"]))
        raise OpenAIError(f"input: the conversation is not a valid chat ({where}: "
                          f"{error['msg']})", param="input") from None


def output_items(content: str | None, calls: list[tuple[str, str, str]]) -> list[Any]:
    """A response's output: the text as one message (also when empty and nothing was
    called), then one function_call item per (call_id, name, arguments)."""
    items: list[Any] = []
    if content or not calls:
        items.append(OutputMessage(id=_hex_id("msg"),
                                   content=[OutputTextPart(text=content or "")]))
    items.extend(OutputFunctionCall(id=_hex_id("fc"), call_id=call_id, name=name,
                                    arguments=arguments)
                 for call_id, name, arguments in calls)
    return items


def base_response(request: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    fmt = request.text.format if request.text and request.text.format else None
    return ResponseObject(
        id=response_id, status="in_progress", model=model,
        instructions=request.instructions, max_output_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p,
        tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
        tool_choice=(request.tool_choice.model_dump() if isinstance(
            request.tool_choice, FunctionToolChoice) else request.tool_choice
            or ("auto" if request.tools else "none")),
        parallel_tool_calls=request.parallel_tool_calls,
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
              else {"type": "text"}},
        previous_response_id=request.previous_response_id, store=request.store,
        metadata=request.metadata or {},
    )


def finish(response: ResponseObject, output: list[Any], finish_reason: str | None,
           prompt_tokens: int, completion_tokens: int) -> ResponseObject:
    incomplete = finish_reason == "length"
    return response.model_copy(update={
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete
        else None,
        "output": output,
        "usage": ResponseUsage(input_tokens=prompt_tokens, output_tokens=completion_tokens,
                               total_tokens=prompt_tokens + completion_tokens),
    })


def assistant_turn(output: list[Any]) -> AssistantMessage:
    """The response's output as the assistant turn a later previous_response_id continues."""
    text = "".join(p.text for item in output if isinstance(item, OutputMessage)
                   for p in item.content)
    calls = [ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                             arguments=item.arguments))
             for item in output if isinstance(item, OutputFunctionCall)]
    return AssistantMessage(role="assistant", content=text or None, tool_calls=calls or None)


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    def stored(self, response_id: str) -> ResponseObject:
        item = self.store.get(response_id)
        if item is None:
            raise OpenAIError(f"No response with id {response_id!r} is stored (this server "
                              f"keeps the last {self.store.size} responses in memory).", 404,
                              param="response_id", code="response_not_found")
        return item.response

    async def create_response(self, request: ResponsesRequest) -> ResponseObject | SSEResponse:
        self.chat.check_model(request.model)
        earlier: list[ChatMessage] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise OpenAIError(
                    f"Previous response with id {request.previous_response_id!r} not found "
                    f"(this server keeps the last {self.store.size} stored responses in memory).",
                    param="previous_response_id")
            earlier = [*previous.conversation, assistant_turn(previous.response.output)]
        conversation = input_messages(request, earlier)
        result = await self.chat.create_chat_completion(chat_request(request, conversation))
        response = base_response(request, _hex_id("resp"), self.chat.model_name)
        if isinstance(result, SSEResponse):
            events = ResponseEvents(response).run(result.events, self._keeper(request,
                                                                              conversation))
            return SSEResponse(events, result.streams)
        assert isinstance(result, ChatCompletionResponse)
        (choice,) = result.choices
        output = output_items(choice.message.content, [
            (c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls])
        response = finish(response, output, choice.finish_reason,
                          result.usage.prompt_tokens, result.usage.completion_tokens)
        self._keeper(request, conversation)(response)
        return response

    def _keeper(self, request: ResponsesRequest, conversation: list[ChatMessage]
                ) -> Callable[[ResponseObject], None]:
        def keep(response: ResponseObject) -> None:
            if request.store:
                self.store.put(StoredResponse(response, conversation))
        return keep


class ResponseEvents:
    """The Responses API's typed stream, from the chat path's chunks: a message item that
    opens at the first text, a function_call item per call, and the lifecycle events
    around them. Every event carries its sequence_number."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence = 0
        self.output: list[Any] = []
        self.message: OutputMessage | None = None  # the open message item

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _snapshot(self, **update: Any) -> dict[str, Any]:
        return self.response.model_copy(update=update).model_dump(mode="json")

    async def run(self, chunks: AsyncIterator[str], keep: Callable[[ResponseObject], None]
                  ) -> AsyncIterator[str]:
        yield self.event("response.created", response=self._snapshot())
        yield self.event("response.in_progress", response=self._snapshot())
        finish_reason, usage = None, None
        async for raw in chunks:
            data = raw.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                for text in self._fail(chunk["error"]):
                    yield text
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice["delta"]
                if delta.get("content"):
                    for text in self._text(delta["content"]):
                        yield text
                for call in delta.get("tool_calls") or []:
                    for text in self._call(call):
                        yield text
                finish_reason = choice.get("finish_reason") or finish_reason
        for text in self._close_message(empty_ok=not self.output):
            yield text
        usage = usage or {}
        final = finish(self.response, self.output, finish_reason,
                       usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        keep(final)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield self.event(kind, response=final.model_dump(mode="json"))

    def _text(self, delta: str) -> list[str]:
        events = []
        if self.message is None:
            events.extend(self._open_message())
        assert self.message is not None
        self.message.content[0].text += delta
        events.append(self.event("response.output_text.delta", item_id=self.message.id,
                                 output_index=len(self.output) - 1, content_index=0,
                                 delta=delta, logprobs=[]))
        return events

    def _open_message(self) -> list[str]:
        self.message = OutputMessage(id=_hex_id("msg"), status="in_progress",
                                     content=[OutputTextPart(text="")])
        self.output.append(self.message)
        index = len(self.output) - 1
        item = self.message.model_dump(mode="json") | {"content": []}
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=self.message.id,
                           output_index=index, content_index=0,
                           part=OutputTextPart(text="").model_dump(mode="json"))]

    def _close_message(self, empty_ok: bool = False) -> list[str]:
        """Close the open message item; with `empty_ok`, open an empty one first (an
        answer with neither text nor calls is one empty message, as without streaming)."""
        events = []
        if self.message is None:
            if not empty_ok:
                return []
            events.extend(self._open_message())
        message, self.message = self.message, None
        assert message is not None
        message.status = "completed"
        index = self.output.index(message)
        part = message.content[0]
        events += [
            self.event("response.output_text.done", item_id=message.id, output_index=index,
                       content_index=0, text=part.text, logprobs=[]),
            self.event("response.content_part.done", item_id=message.id, output_index=index,
                       content_index=0, part=part.model_dump(mode="json")),
            self.event("response.output_item.done", output_index=index,
                       item=message.model_dump(mode="json")),
        ]
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        """One whole call (the chat path parses calls when the answer ends): added, its
        arguments as one delta, done."""
        events = self._close_message()
        function = call["function"]
        item = OutputFunctionCall(id=_hex_id("fc"), call_id=call["id"], name=function["name"],
                                  arguments="", status="in_progress")
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=index,
                                 item=item.model_dump(mode="json")))
        item.arguments = function["arguments"]
        events += [
            self.event("response.function_call_arguments.delta", item_id=item.id,
                       output_index=index, delta=item.arguments),
            self.event("response.function_call_arguments.done", item_id=item.id,
                       output_index=index, name=item.name, arguments=item.arguments),
        ]
        item.status = "completed"
        events.append(self.event("response.output_item.done", output_index=index,
                                 item=item.model_dump(mode="json")))
        return events

    def _fail(self, error: dict[str, Any]) -> list[str]:
        """An error after the stream started: an `error` event, then response.failed."""
        failed = self.response.model_copy(update={
            "status": "failed", "output": self.output,
            "error": {"code": error.get("code") or error.get("type"),
                      "message": error.get("message", "")}})
        return [self.event("error", code=error.get("code") or error.get("type"),
                           message=error.get("message", ""), param=error.get("param")),
                self.event("response.failed", response=failed.model_dump(mode="json"))]


def add_responses_routes(
    router: APIRouter, chat: OpenAIServingChat, respond: Callable[[Any], Any],
    cancel_on_disconnect: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
    errors: dict[int | str, dict],
) -> OpenAIServingResponses:
    """POST /v1/responses and GET /v1/responses/{id} on `router` (the keyed one: OpenAI's
    401). `errors`: the documented error responses of a generating route."""
    serving = OpenAIServingResponses(chat)
    stream_doc = {"description": "JSON, or server-sent events (the Responses API's typed "
                                 "events) with `stream: true`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}

    @router.post("/v1/responses", response_model=None,
                 responses={**errors, 200: {"model": ResponseObject, **stream_doc}})
    async def create_response(body: ResponsesRequest, raw: Request) -> Any:
        return respond(await cancel_on_disconnect(raw, serving.create_response(body)))

    not_found = {**errors[404], "description": "No stored response with this id"}

    @router.get("/v1/responses/{response_id}",
                responses={k: v for k, v in {**errors, 404: not_found}.items() if k != 413})
    async def retrieve_response(response_id: str) -> ResponseObject:
        return serving.stored(response_id)

    return serving

"""POST /v1/chat/completions: messages through the model's chat template, SSE or not."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.async_engine import RequestStream
from pagedllm.outputs import Logprob
from pagedllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    ChoiceLogprobs,
    PromptLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallOut,
    DeveloperMessage,
    TextPart,
    TokenLogprob,
    ToolMessage,
    TopLogprob,
    UsageInfo,
    now,
    random_id,
)
from pagedllm.entrypoints.chat_utils import _RESERVED_TEMPLATE_KWARGS as RESERVED_TEMPLATE_KWARGS
from pagedllm.entrypoints.openai.serving_completion import finish_reason
from pagedllm.entrypoints.openai.tool_calls import (
    ParsedCall,
    ToolTextFilter,
    call_grammar,
    parse_tool_calls,
    template_renders_tools,
    tool_dicts,
    with_tools_prompt,
)
from pagedllm.entrypoints.reasoning import ReasoningSplitter, ThinkingMode, split_reasoning
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    SSEResponse,
    OpenAIError,
    OpenAIServing,
    check_output,
    constraint_field,
    final_outputs,
    sse,
    sse_error,
    sse_finish_error,
)


def message_dicts(messages: list[ChatMessage], template_knows_tools: bool) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text parts joined into one string, a null
    content as "", a developer message as a system one.

    Tool calls go to a template that renders them (one that mentions `tool_calls`) as
    Hugging Face templates take them: the arguments as a dict. A template that knows no tools
    gets them as text, in the Hermes format that Qwen's and Hermes' templates write: the
    calls appended to the assistant's content, one `<tool_call>\n{"name": ..., "arguments":
    ...}\n</tool_call>` each, and the results of consecutive tool messages in one user
    message, one `<tool_response>\n...\n</tool_response>` each.
    """
    result: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        d = message.model_dump(exclude_none=True)
        d["content"] = _text(message.content)
        if isinstance(message, DeveloperMessage):
            d["role"] = "system"
        elif isinstance(message, AssistantMessage) and message.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                     for c in message.tool_calls]
            if template_knows_tools:
                for call, parsed in zip(d["tool_calls"], calls):
                    call["function"]["arguments"] = parsed["arguments"]
            else:
                del d["tool_calls"]
                blocks = [f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>"
                          for c in calls]
                d["content"] = "\n".join(filter(None, [d["content"], *blocks]))
        elif isinstance(message, ToolMessage) and not template_knows_tools:
            response = f"<tool_response>\n{d['content']}\n</tool_response>"
            if i > 0 and isinstance(messages[i - 1], ToolMessage):
                result[-1]["content"] += "\n" + response
                continue
            d = {"role": "user", "content": response}
        result.append(d)
    return result


def _text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _arguments(arguments: str) -> Any:
    """A call's arguments as JSON data where they parse (templates dump them), else as sent."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments


def knows_tools(chat_template: Any) -> bool:
    return isinstance(chat_template, str) and "tool_calls" in chat_template


class ToolPlan:
    """How a chat request uses its tools: tool_choice resolved, the functions the model may
    call, and the grammar that enforces "required" / a named function."""

    def __init__(self, request: ChatCompletionRequest) -> None:
        tools = request.tools or []
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if choice != "none" and not tools:
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        self.tools = tool_dicts(tools) if choice != "none" else []
        functions = [t["function"] for t in self.tools]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f["name"] == choice.function.name]
            if not functions:
                raise OpenAIError(f"tool_choice names the function {choice.function.name!r}, "
                                  "which is not in tools", param="tool_choice")
            choice = "named"
        self.choice = choice
        self.names = {f["name"] for f in functions}
        # A named function is called exactly once (OpenAI's "forces the model to call that
        # function"): its grammar ends after one block, so EOS follows it.
        self.parallel = request.parallel_tool_calls and choice != "named"
        self.structured: StructuredOutputsParams | None = None
        if choice in ("required", "named"):
            try:
                self.structured = StructuredOutputsParams(
                    grammar=call_grammar(functions, self.parallel))
            except ValueError as exc:
                raise OpenAIError(f"tools: {exc}", param="tools") from None

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if not self.parses:
            return text, []
        content, calls = parse_tool_calls(text, self.names)
        if not self.parallel:
            calls = calls[:1]
        return content, calls


def check_prefill(request: ChatCompletionRequest) -> None:
    """vLLM's rules for continue_final_message and prompt_logprobs."""
    if request.continue_final_message:
        if request.add_generation_prompt:
            raise OpenAIError("continue_final_message and add_generation_prompt cannot both "
                              "be true: set add_generation_prompt to false to continue the "
                              "last message", param="continue_final_message")
        last = request.messages[-1]
        if not isinstance(last, AssistantMessage) or not _text(last.content):
            raise OpenAIError("continue_final_message needs a last assistant message with "
                              "content to continue", param="continue_final_message")
    if request.prompt_logprobs is not None and request.stream:
        raise OpenAIError("prompt_logprobs are not available when stream is true",
                          param="prompt_logprobs")


def split_delta(splitter: ReasoningSplitter | None, text: str,
                finished: bool) -> tuple[str, str]:
    """(reasoning, content) of one streamed delta; all content without a splitter."""
    if splitter is None:
        return "", text
    thought, text = splitter.feed(text)
    if finished:
        more_thought, more_text = splitter.finish()
        thought, text = thought + more_thought, text + more_text
    return thought, text


def tool_finish_reason(o: Any, calls: list[ParsedCall]) -> str | None:
    reason = finish_reason(o)
    return "tool_calls" if calls and reason == "stop" else reason


class OpenAIServingChat(OpenAIServing):
    async def render_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation through the chat template, as token ids (the template already
        wrote the special tokens, so none are added), exactly as LLM.chat does. On the
        tokenizer's thread; a text too long for the context is refused before tokenizing.
        `tools`: rendered by the template when it reads them, else described in the system
        message (tool_calls.TOOLS_SYSTEM_PROMPT)."""
        engine = self.engine.engine
        tokenizer = self.tokenizer.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        dicts = message_dicts(messages, knows_tools(template))
        template_tools = bool(tools) and template_renders_tools(template)
        if tools and not template_tools:
            dicts = with_tools_prompt(dicts, tools)

        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise OpenAIError(f"chat_template_kwargs cannot set {', '.join(reserved)}",
                              param="chat_template_kwargs")

        def render() -> str:
            if template_tools or kwargs or continue_final_message:
                if not getattr(tokenizer, "chat_template", None):
                    raise ValueError("this model has no chat template")
                return tokenizer.apply_chat_template(
                    dicts, tools=tools if template_tools else None, tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, **kwargs)
            return engine.apply_chat_template(dicts, add_generation_prompt)

        try:
            text = await self.tokenizer.run(render)
        except (ValueError, TypeError, KeyError) as exc:
            raise OpenAIError(f"cannot apply the chat template: {exc}", param="messages") from None
        except Exception as exc:  # jinja2 errors raised by the template itself
            if type(exc).__module__.startswith("jinja2"):
                raise OpenAIError(f"chat template error: {exc}", param="messages") from None
            raise
        return await self.tokenizer.encode(text, add_special_tokens=False, param="messages")

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | SSEResponse:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        server_default = max_tokens is None
        if server_default:  # None: the rest of the context, as vLLM
            max_tokens = self.max_tokens_default
        check_prefill(request)
        plan = ToolPlan(request)
        params = self.sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
            structured_outputs=plan.structured,
        )
        await self.check_grammar(params, "tools" if plan.structured else constraint_field(request))
        prompt = await self.render_prompt(request.messages, request.add_generation_prompt,
                                          plan.tools or None, request.continue_final_message,
                                          request.chat_template_kwargs)
        mode = self.reasoning_mode(prompt, params, request.thinking_token_budget)
        request_id = random_id("chatcmpl")
        streams = await self.add_requests([prompt], params, request_id,
                                          server_default=server_default)
        if request.stream:
            return SSEResponse(self._stream(request, request_id, streams, plan, mode), streams,
                               len(prompt))
        (out,) = await final_outputs(streams)
        choices = []
        for j, o in enumerate(out.outputs):
            reasoning, text = split_reasoning(o.text, mode) if mode else (None, o.text)
            content, calls = plan.parse(text or "")
            if mode is not None:  # as vLLM: no answer after the thinking is a null content
                content = content or None
            choices.append(ChatCompletionChoice(
                index=j,
                message=ChatResponseMessage(reasoning_content=reasoning, content=content,
                                            tool_calls=[
                    ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name,
                                                                  arguments=c.arguments))
                    for c in calls]),
                logprobs=self._logprobs(o.token_ids, o.logprobs or [], request.top_logprobs or 0)
                if request.logprobs else None,
                finish_reason=tool_finish_reason(o, calls),
                stop_reason=o.stop_reason,
            ))
        completion_tokens = sum(len(o.token_ids) for o in out.outputs)
        usage = UsageInfo(
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=completion_tokens,
            total_tokens=len(out.prompt_token_ids) + completion_tokens,
        )
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage,
            prompt_logprobs=self._prompt_logprobs(out) if request.prompt_logprobs is not None
            else None,
        )

    def _prompt_logprobs(self, out: Any) -> list[dict[str, PromptLogprob] | None]:
        return [None if step is None else {
            str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                  decoded_token=self.token_str(t, lp))
            for t, lp in step.items()} for step in out.prompt_logprobs or []]

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, streams: list[RequestStream],
        plan: ToolPlan, mode: ThinkingMode | None = None,
    ) -> AsyncIterator[str]:
        created = now()
        (stream,) = streams
        sent_tokens = [0] * request.n
        done: set[int] = set()
        prompt_tokens = 0
        # Tools: text that may be a call is held back and parsed when its choice ends.
        filters = [ToolTextFilter() for _ in range(request.n)] if plan.parses else None
        if filters and plan.structured is not None:  # the whole output is calls
            for f in filters:
                f.in_call = True
        # Reasoning: each choice's thinking goes to reasoning_content, the rest on as content.
        splitters = [ReasoningSplitter(mode) for _ in range(request.n)] if mode else None

        def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
            return sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices
            ))

        try:
            # OpenAI opens every choice with the role and empty content.
            for j in range(request.n):
                yield chunk([ChatCompletionStreamChoice(
                    index=j, delta=DeltaMessage(role="assistant", content="")
                )])
            async for out in stream:
                check_output(out)
                prompt_tokens = len(out.prompt_token_ids)
                for j, o in enumerate(out.outputs):
                    if j in done:
                        continue
                    delta_text, delta_ids = out.deltas[j] if j < len(out.deltas) else ("", [])
                    if not (delta_text or delta_ids or o.finished()):
                        continue
                    logprobs = None
                    if request.logprobs:
                        start = sent_tokens[j]
                        logprobs = self._logprobs(
                            delta_ids, (o.logprobs or [])[start:start + len(delta_ids)],
                            request.top_logprobs or 0,
                        )
                    sent_tokens[j] += len(delta_ids)
                    reason = finish_reason(o) if o.finished() else None
                    thought, delta_text = split_delta(
                        splitters[j] if splitters else None, delta_text, o.finished())
                    if filters is not None:
                        delta_text = filters[j].feed(delta_text)
                        if o.finished():
                            _, calls = plan.parse(filters[j].rest())
                            if calls:
                                reason = tool_finish_reason(o, calls)
                                yield chunk([ChatCompletionStreamChoice(
                                    index=j, delta=DeltaMessage(tool_calls=[
                                        DeltaToolCall(index=k, id=c.id, type="function",
                                                      function=DeltaFunctionCall(
                                                          name=c.name, arguments=c.arguments))
                                        for k, c in enumerate(calls)]))])
                            else:
                                delta_text += filters[j].rest()
                    if o.finished():
                        done.add(j)
                    yield chunk([ChatCompletionStreamChoice(
                        index=j,
                        delta=DeltaMessage(reasoning_content=thought or None,
                                           content=delta_text or None),
                        logprobs=logprobs,
                        finish_reason=reason,
                        stop_reason=o.stop_reason if reason else None,
                    )])
                    if reason == "error":
                        yield sse_finish_error(o.stop_reason)
            if request.stream_options and request.stream_options.include_usage:
                completion_tokens = sum(sent_tokens)
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=UsageInfo(prompt_tokens=prompt_tokens,
                                    completion_tokens=completion_tokens,
                                    total_tokens=prompt_tokens + completion_tokens),
                ))
        except Exception as exc:  # the status line is gone: report in the stream
            yield sse_error(exc)
        finally:
            stream.abort()
        yield SSE_DONE

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int
    ) -> ChoiceLogprobs:
        content = []
        for token_id, step in zip(token_ids, logprobs):
            chosen = step.get(token_id)
            token = self.token_str(token_id, chosen)
            top = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:num_top]
            content.append(TokenLogprob(
                token=token,
                logprob=chosen.logprob if chosen else float("-inf"),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=(s := self.token_str(t, lp)), logprob=lp.logprob,
                               bytes=list(s.encode("utf-8")))
                    for t, lp in top
                ],
            ))
        return ChoiceLogprobs(content=content)

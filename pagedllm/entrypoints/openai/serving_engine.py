"""What the completion and chat handlers share: errors, model check, the tokenizer's thread,
sampling params, SSE."""
from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from pagedllm.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedllm.outputs import Logprob
from pagedllm.entrypoints.openai.protocol import SamplingFields
from pagedllm.entrypoints.reasoning import (
    THINK_END, ThinkingMode, constrain_after_thinking, thinking_mode,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

T = TypeVar("T")
MAX_CHECKED_GRAMMARS = 256
logger = logging.getLogger(__name__)


# The LoRA adapter the request being served runs under (openai/lora_routes.py): set where
# its `model` is checked, read where its prompts are queued; a context variable, so each
# request's task sees its own.
request_lora: ContextVar[Any] = ContextVar("request_lora", default=None)


class OpenAIError(Exception):
    """An error the client sees as {"error": {...}} with this HTTP status."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class PromptTokenizer:
    """The server's tokenizer work, on a thread of its own: never the engine's, so that a
    huge prompt does not stall the running streams.

    A text is refused before it is tokenized when it has more characters than the context
    can hold: no token of the vocabulary is longer than `longest_token` characters, so a
    text over max_model_len * longest_token characters has more tokens than the context.
    One thread: huge prompts are tokenized one at a time, which bounds their memory. The
    engine's detokenizer reads the same tokenizer meanwhile: encode and decode of a fast
    (Rust) tokenizer only read it, and release the GIL while they work.
    """

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.longest_token = longest_token_chars(tokenizer) if tokenizer is not None else 0
        self.max_chars = max_model_len * self.longest_token
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def check_length(self, text: str, param: str | None = "prompt") -> None:
        if len(text) > self.max_chars:
            raise OpenAIError(
                f"the prompt has {len(text)} characters, but the model's context "
                f"is {self.max_model_len} tokens and no token is longer than "
                f"{self.longest_token} characters (at most {self.max_chars} characters)",
                param=param,
            )

    async def encode(self, text: str, add_special_tokens: bool = True,
                     param: str | None = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer: pass the prompt as token ids",
                              param=param)
        self.check_length(text, param)
        return await self.run(lambda: self.tokenizer.encode(
            text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer")
        return await self.run(self.tokenizer.decode, token_ids)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token as the tokenizer spells it (byte-level
    and SentencePiece spellings are never shorter than the text they stand for)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(t) for t in tokens if t is not None)


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, tokenizer: PromptTokenizer,
                 max_tokens_default: int | None = None) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = tokenizer
        # max_tokens of a request that sets none (None: each endpoint's own default).
        self.max_tokens_default = max_tokens_default
        # Grammars that passed check_grammar (most recent last), so it runs once each.
        self._checked_grammars: OrderedDict[str, None] = OrderedDict()
        # Every --served-model-name; responses carry the first (model_name).
        self.model_names = engine.served_model_names
        self.log_requests = False
        self.sampling_defaults: dict[str, Any] = {}
        self.reasoning_parser: str | None = None  # --reasoning-parser (qwen3 | deepseek_r1)

    async def check_grammar(self, params: SamplingParams, param: str | None) -> None:
        """A 400 naming the field when the request's grammar fails against this tokenizer
        under the engine's limits, or allows no output at all (engine/structured_output.py's
        new_matcher: its first mask is computed here, on the tokenizer's thread)."""
        constraint = params.structured_outputs
        if constraint is None or constraint.compiled in self._checked_grammars:
            return
        try:
            await self.tokenizer.run(lambda: self.engine.validate_grammar(constraint.compiled))
        except ValueError as exc:
            message = str(exc).removeprefix("structured output: ")
            raise OpenAIError(f"{param}: {message}" if param else str(exc), param=param) from None
        self._checked_grammars[constraint.compiled] = None
        if len(self._checked_grammars) > MAX_CHECKED_GRAMMARS:
            self._checked_grammars.popitem(last=False)

    def configure(self, log_requests: bool, sampling_defaults: dict[str, Any]) -> None:
        """--enable-log-requests, and --generation-config's defaults (a request's own values
        win; its max_tokens default applies where the endpoint has none of its own)."""
        self.log_requests = log_requests
        self.sampling_defaults = dict(sampling_defaults)
        if self.max_tokens_default is None and "max_tokens" in self.sampling_defaults:
            self.max_tokens_default = int(self.sampling_defaults["max_tokens"])

    def reasoning_mode(self, prompt: list[int], params: SamplingParams,
                       budget: int | None) -> ThinkingMode | None:
        """With --reasoning-parser: where the output starts (read from the prompt's end), and
        the request's grammar moved after the thinking (bounded by thinking_token_budget);
        None without. Split the output with reasoning.split_reasoning / ReasoningSplitter."""
        if self.reasoning_parser is None:
            if budget is not None:
                raise OpenAIError("thinking_token_budget needs a server started with "
                                  "--reasoning-parser", param="thinking_token_budget")
            return None
        tokenizer = self.tokenizer.tokenizer
        mode = thinking_mode(self.reasoning_parser,
                             tokenizer.decode(prompt[-32:], skip_special_tokens=False))
        end_tag_tokens = len(tokenizer.encode(THINK_END, add_special_tokens=False))
        try:
            params.structured_outputs = constrain_after_thinking(
                params.structured_outputs, mode, budget, end_tag_tokens)
        except ValueError as exc:
            raise OpenAIError(str(exc)) from None
        return mode

    def check_model(self, model: str | None) -> None:
        """404 for a name that is neither the model's nor a LoRA adapter's; an adapter's
        name makes the request run under it (`request_lora`, read by add_requests)."""
        loras = getattr(self.engine.engine, "loras", None)
        lora = loras.by_name.get(model) if loras is not None and model is not None else None
        request_lora.set(lora)
        if model is not None and model not in self.model_names and lora is None:
            raise OpenAIError(
                f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
            )

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Build SamplingParams; a bad value becomes a 400 naming the field.
        `structured_outputs`: the endpoint's own constraint (tool calls), which wins over the
        request's response_format / structured_outputs / guided_* fields."""
        if request.stream and request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of must equal n when streaming", param="best_of")
        set_values = {
            "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty,
            "repetition_penalty": request.repetition_penalty,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "min_p": request.min_p,
        }
        for name, value in self.sampling_defaults.items():
            if name in set_values and set_values[name] is None:
                set_values[name] = value
        if structured_outputs is None:
            structured_outputs = structured_outputs_of(request)
        try:
            params = SamplingParams(
                n=request.n,
                best_of=request.best_of,
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=request.logit_bias,
                skip_special_tokens=request.skip_special_tokens,
                structured_outputs=structured_outputs,
                **{k: v for k, v in set_values.items() if v is not None},
            )
            params.check_vocab(self.engine.vocab_size)
        except ValueError as exc:
            raise OpenAIError(str(exc)) from None
        return params

    def token_str(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"

    async def add_requests(
        self, prompts: Sequence[list[int]], params: SamplingParams, request_id: str,
        server_default: bool = False,
    ) -> list[RequestStream]:
        """Queue every prompt; on a rejected one, abort those already queued and raise 400.

        server_default: params.max_tokens is --max-tokens-default, not the client's: it is
        capped to the room the context leaves each prompt instead of failing the request.
        """
        streams: list[RequestStream] = []
        if self.log_requests:
            logger.info("Received request %s: %s prompt tokens, params: %s", request_id,
                        "+".join(str(len(p)) for p in prompts), params)
        try:
            for i, prompt in enumerate(prompts):
                prompt_params = params
                room = self.engine.max_model_len - len(prompt)
                if server_default and params.max_tokens is not None and room < params.max_tokens:
                    prompt_params = params.clone()
                    prompt_params.max_tokens = max(1, room)
                streams.append(await self.engine.add_request(
                    prompt, prompt_params, f"{request_id}-{i}", lora_request=request_lora.get()))
        except ValueError as exc:
            for stream in streams:
                stream.abort()
            raise OpenAIError(str(exc)) from None
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams


def constraint_field(request: SamplingFields) -> str | None:
    """The name of the field that carries the request's output constraint, if any."""
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        return "response_format"
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        if getattr(request, name) is not None:
            return name
    return None


def structured_outputs_of(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint: response_format (OpenAI), structured_outputs or
    guided_json / guided_regex / guided_choice / guided_grammar (vLLM); at most one of them.
    A schema, regex or grammar that does not compile is a 400 naming the field, before
    anything is generated."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        else:
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise OpenAIError('response_format of type "json_schema" needs '
                                  'json_schema.schema', param="response_format")
            given.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if request.structured_outputs is not None:
        so = request.structured_outputs
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                  "grammar": so.grammar, "json_object": so.json_object}
        given.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            given.append((name, {key: value}))
    if not given:
        return None
    if len(given) > 1:
        raise OpenAIError("give at most one of response_format, structured_outputs, guided_json, "
                          "guided_regex, guided_choice, guided_grammar; got "
                          + ", ".join(name for name, _ in given), param=given[1][0])
    param, kwargs = given[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise OpenAIError(f"{param}: {exc}", param=param) from None


@dataclass
class SSEResponse:
    """A stream of SSE events and the requests behind it (aborted when the response ends,
    even if the body never started)."""

    events: AsyncIterator[str]
    streams: list[RequestStream]
    prompt_tokens: int = 0  # of the first prompt (what the Messages API's first event reports)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()


def check_output(output: RequestOutput) -> None:
    """A request the engine rejected after admission ends with .error set."""
    if output.error:
        raise OpenAIError(output.error)


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Wait for every request to finish; cancelling (client gone) aborts them all."""

    async def last(stream: RequestStream) -> RequestOutput:
        result = None
        async for output in stream:
            check_output(output)
            result = output
        assert result is not None
        return result

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    finally:
        for stream in streams:
            stream.abort()


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    pending: dict[asyncio.Future, int] = {}
    try:
        for i, stream in enumerate(streams):
            pending[asyncio.ensure_future(stream.__anext__())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    output = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, output
                if not output.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for fut in pending:
            fut.cancel()
        for stream in streams:
            stream.abort()


def sse(data: BaseModel | dict[str, Any]) -> str:
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_finish_error(message: Any) -> str:
    """After a choice that ended with finish_reason "error" (its grammar failed mid-way):
    the error as an event too, so a streaming client raises instead of taking the text."""
    return sse(OpenAIError(str(message), 500, type="server_error",
                           code="structured_output_failed").to_dict())


def sse_error(exc: BaseException) -> str:
    """Once the stream has started the status is sent, so errors travel as an event."""
    if isinstance(exc, OpenAIError):
        return sse(exc.to_dict())
    error = OpenAIError(f"internal error: {exc}", 500, type="internal_server_error")
    return sse(error.to_dict())

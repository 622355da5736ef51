"""What the completion and chat handlers share: errors, model check, sampling params, SSE."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pagedllm.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedllm.outputs import Logprob
from pagedllm.entrypoints.openai.protocol import SamplingFields
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


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


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
            )

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Build SamplingParams; a bad value becomes a 400 naming the field."""
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
                **{k: v for k, v in set_values.items() if v is not None},
            )
            params.check_vocab(self.engine.engine.model_config.vocab_size)
        except ValueError as exc:
            raise OpenAIError(str(exc)) from None
        return params

    def token_str(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"

    async def add_requests(
        self, prompts: Sequence[str | list[int]], params: SamplingParams, request_id: str
    ) -> list[RequestStream]:
        """Queue every prompt; on a rejected one, abort those already queued and raise 400."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(prompt, params, f"{request_id}-{i}"))
        except ValueError as exc:
            for stream in streams:
                stream.abort()
            raise OpenAIError(str(exc)) from None
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams


@dataclass
class SSEResponse:
    """A stream of SSE events and the requests behind it (aborted when the response ends,
    even if the body never started)."""

    events: AsyncIterator[str]
    streams: list[RequestStream]

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


def sse_error(exc: BaseException) -> str:
    """Once the stream has started the status is sent, so errors travel as an event."""
    if isinstance(exc, OpenAIError):
        return sse(exc.to_dict())
    error = OpenAIError(f"internal error: {exc}", 500, type="internal_server_error")
    return sse(error.to_dict())

"""POST /v1/completions: prompts (one or a batch, text or token ids) to text, SSE or not."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.async_engine import RequestStream
from pagedllm.outputs import Logprob
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    now,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    SSEResponse,
    OpenAIError,
    OpenAIServing,
    check_output,
    constraint_field,
    final_outputs,
    merge_streams,
    sse,
    sse_error,
    sse_finish_error,
)
from pagedllm.outputs import CompletionOutput, RequestOutput


def finish_reason(output: CompletionOutput) -> Any:
    return output.finish_reason if output.finish_reason in ("stop", "length", "error") else None


# OpenAI's default for /v1/completions.
COMPLETION_MAX_TOKENS = 16


def normalise_prompts(prompt: Any) -> list[str | list[int]]:
    """One prompt or a batch, as a list (the schema has already refused empty ones)."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | SSEResponse:
        self.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported", param="suffix")
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens_default or COMPLETION_MAX_TOKENS
        params = self.sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=request.logprobs,
            prompt_logprobs=request.logprobs if request.echo and request.logprobs is not None
            else None,
        )
        await self.check_grammar(params, constraint_field(request))
        prompts = normalise_prompts(request.prompt)
        # Text is tokenized here, off the engine's thread; echo shows it as it was sent.
        texts = [p if isinstance(p, str) else None for p in prompts]
        token_ids = [await self.tokenizer.encode(p) if isinstance(p, str) else p
                     for p in prompts]
        request_id = random_id("cmpl")
        streams = await self.add_requests(
            token_ids, params, request_id,
            server_default=request.max_tokens is None and self.max_tokens_default is not None)
        if request.stream:
            return SSEResponse(self._stream(request, request_id, streams, texts), streams)
        outputs = await final_outputs(streams)
        return self._response(request, request_id, outputs, texts)

    def _response(
        self, request: CompletionRequest, request_id: str, outputs: list[RequestOutput],
        texts: list[str | None],
    ) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        usage = UsageInfo()
        for out, text in zip(outputs, texts):
            usage.prompt_tokens += len(out.prompt_token_ids)
            prompt_text = self._prompt_text(out, text) if request.echo else ""
            for o in out.outputs:
                usage.completion_tokens += len(o.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = CompletionLogProbs()
                    if request.echo:
                        self._add_logprobs(logprobs, out.prompt_token_ids,
                                           out.prompt_logprobs or [], 0, request.logprobs)
                    self._add_logprobs(logprobs, o.token_ids, o.logprobs or [],
                                       len(prompt_text), request.logprobs)
                choices.append(CompletionChoice(
                    index=len(choices),
                    text=prompt_text + o.text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(o),
                    stop_reason=o.stop_reason,
                ))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage
        )

    async def _stream(
        self, request: CompletionRequest, request_id: str, streams: list[RequestStream],
        texts: list[str | None],
    ) -> AsyncIterator[str]:
        created = now()
        n = request.n
        # Per choice: tokens sent so far, characters sent so far, finished.
        sent_tokens: dict[int, int] = {}
        sent_chars: dict[int, int] = {}
        done: set[int] = set()
        prompt_tokens = 0
        try:
            async for i, out in merge_streams(streams):
                check_output(out)
                chunks: list[CompletionChoice] = []
                for j, o in enumerate(out.outputs):
                    index = i * n + j
                    if index in done:
                        continue
                    if index not in sent_tokens:
                        if j == 0:
                            prompt_tokens += len(out.prompt_token_ids)
                        sent_tokens[index], sent_chars[index] = 0, 0
                        prefix = self._prompt_text(out, texts[i]) if request.echo else ""
                    else:
                        prefix = ""
                    delta_text, delta_ids = out.deltas[j] if j < len(out.deltas) else ("", [])
                    reason = finish_reason(o) if o.finished() else None
                    if not (prefix or delta_text or delta_ids or o.finished()):
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = CompletionLogProbs()
                        if prefix and request.echo:
                            self._add_logprobs(logprobs, out.prompt_token_ids,
                                               out.prompt_logprobs or [], 0, request.logprobs)
                        start = sent_tokens[index]
                        self._add_logprobs(logprobs, delta_ids,
                                           (o.logprobs or [])[start:start + len(delta_ids)],
                                           sent_chars[index] + len(prefix), request.logprobs)
                    sent_tokens[index] += len(delta_ids)
                    sent_chars[index] += len(prefix) + len(delta_text)
                    if o.finished():
                        done.add(index)
                    chunks.append(CompletionChoice(
                        index=index, text=prefix + delta_text, logprobs=logprobs,
                        finish_reason=reason, stop_reason=o.stop_reason if reason else None,
                    ))
                for choice in chunks:
                    yield sse(CompletionResponse(
                        id=request_id, created=created, model=self.model_name, choices=[choice]
                    ))
                    if choice.finish_reason == "error":
                        yield sse_finish_error(choice.stop_reason)
            if request.stream_options and request.stream_options.include_usage:
                completion_tokens = sum(sent_tokens.values())
                yield sse(CompletionResponse(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=UsageInfo(prompt_tokens=prompt_tokens,
                                    completion_tokens=completion_tokens,
                                    total_tokens=prompt_tokens + completion_tokens),
                ))
        except Exception as exc:  # the status line is gone: report in the stream
            yield sse_error(exc)
        finally:
            for stream in streams:
                stream.abort()
        yield SSE_DONE

    def _prompt_text(self, out: RequestOutput, text: str | None) -> str:
        if text is not None:
            return text
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""

    def _add_logprobs(
        self,
        into: CompletionLogProbs,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob] | None],
        offset: int,
        num_top: int,
    ) -> None:
        """Append tokens in the legacy completions format; offset is where the first starts."""
        for pos, token_id in enumerate(token_ids):
            step = logprobs[pos] if pos < len(logprobs) else None
            chosen = step.get(token_id) if step else None
            token = self.token_str(token_id, chosen)
            into.tokens.append(token)
            into.text_offset.append(offset)
            offset += len(token)
            if step is None:  # the first prompt token has no logprob
                into.token_logprobs.append(None)
                into.top_logprobs.append(None)
                continue
            into.token_logprobs.append(chosen.logprob if chosen else None)
            top = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:num_top]
            if chosen is not None and token_id not in dict(top):
                top.append((token_id, chosen))
            into.top_logprobs.append({self.token_str(t, lp): lp.logprob for t, lp in top})

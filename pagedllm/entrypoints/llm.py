"""LLM: the offline API, shaped like vLLM's so users need no new habits.

    from pagedllm import LLM, SamplingParams
    llm = LLM()                                    # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from pagedllm.engine_args import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

PromptType = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self.engine.stream_outputs = False  # generate() returns finished requests only
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} sampling params for {len(prompts)} prompts"
            )
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(request_ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
        except ValueError:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Format each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.engine.apply_chat_template(c, add_generation_prompt) for c in conversations
        ]
        # The template already holds any special tokens: tokenize without adding more.
        token_ids = [self.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_ids, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm
                   or len(request_ids) < 2, dynamic_ncols=True)
        try:
            while len(finished) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        if out.error is not None:
                            raise ValueError(out.error)
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            unfinished = [r for r in request_ids if r not in finished]
            if unfinished:
                self.engine.abort_request(unfinished)
        return [finished[r] for r in request_ids]

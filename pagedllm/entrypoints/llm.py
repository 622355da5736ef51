"""LLM: the offline API, shaped like vLLM's so users need no new habits.

    from pagedllm import LLM, SamplingParams
    llm = LLM()                                    # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any, TypedDict, Union


from pagedllm.engine_args import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.lora import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


# vLLM's prompt types: text, token ids, or a dict holding either.
PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

_PROMPT_HELP = ("a prompt is a string, a list of token ids, {'prompt': str} or "
                "{'prompt_token_ids': [int, ...]}; prompts is one prompt or a list of them")

# vLLM engine arguments with no EngineArgs field, and the values that have a meaning here.
# tensor_parallel_size is an engine option of its own (EngineArgs).
_VLLM_SINGLE_DEVICE = ("pipeline_parallel_size", "data_parallel_size")
_VLLM_RENAMED = {"kv_cache_memory_bytes": "kv_cache_memory"}


class LLM:
    """An engine for offline generation: LLM(model=None, **engine_args).

    Engine arguments (vLLM's names and meanings): model (a .gguf file, a Hugging Face
    directory or hub id, a preset with load_format="dummy"; None: SmolLM2-135M-Instruct),
    tokenizer, load_format, served_model_name, dtype, quantization ("gguf" | "fp8"), device,
    device_map, seed, block_size, enable_prefix_caching, max_num_seqs,
    max_num_batched_tokens, max_model_len, enable_chunked_prefill, preemption_mode,
    kv_cache_memory (kv_cache_memory_bytes), gpu_memory_utilization, swap_space,
    num_gpu_blocks_override, enforce_eager, num_scheduler_steps, async_scheduling,
    tensor_parallel_size (ranks the model is split over; call llm.engine.shutdown() before
    making another such LLM in the same process), distributed_timeout, disable_log_stats,
    speculative_config ({"method": "ngram" | "draft_model", "num_speculative_tokens": k,
    ...}: see SpeculativeConfig in pagedllm/config.py), pooling ("last" | "mean": how
    embed() pools).

    Also accepted as vLLM code passes them: pipeline_parallel_size and data_parallel_size
    of 1 (more is not supported yet); trust_remote_code (pagedllm implements its architectures itself
    and never runs a checkpoint's code); tokenizer_mode="auto". Any other argument is
    rejected by name.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_engine_args(engine_args(model, **kwargs))
        self.engine.stream_outputs = False  # generate() returns finished requests only
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        sampling_params=None uses SamplingParams() as vLLM does: temperature 1.0 (random
        sampling) and at most 16 new tokens. lora_request: the LoRA adapter every prompt
        runs under, or one per prompt (None: the base model); needs enable_lora=True.
        """
        prompts = [_engine_prompt(p, i) for i, p in enumerate(_prompt_list(prompts))]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Seq) and not isinstance(sampling_params, str):
            params = list(sampling_params)
            bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
            if bad is not None:
                raise TypeError(f"sampling_params must be SamplingParams or a list of them, "
                                f"got a list holding {type(bad).__name__}")
        else:
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} sampling params for {len(prompts)} prompts"
            )
        loras = _lora_list(lora_request, len(prompts))
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p, lora in zip(request_ids, prompts, params, loras):
                self.engine.add_request(rid, prompt, p, lora_request=lora)
        except ValueError:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, in input order (vLLM's LLM.embed): the prompt's final
        hidden states after the model's final norm, pooled as the engine's `pooling` option
        says (the last token's, or the mean) and L2-normalized unless
        pooling_params.normalize is False. The prompts run batched through the engine."""
        prompts = [_engine_prompt(p, i) for i, p in enumerate(_prompt_list(prompts))]
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt in zip(request_ids, prompts):
                self.engine.add_request(rid, prompt, params)
        except ValueError:
            self.engine.abort_request(request_ids)
            raise
        return [EmbeddingRequestOutput.from_output(out)
                for out in self._run(request_ids, use_tqdm)]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Format each conversation with the chat template, then generate (vLLM's LLM.chat).

        messages: one conversation (a list of {"role", "content"} dicts) or a list of them;
        content is a string or a list of text parts ({"type": "text", "text": ...}, joined
        with newlines). chat_template: a Jinja template replacing the model's own.
        continue_final_message: continue the last message instead of starting a new one
        (needs add_generation_prompt=False). tools and chat_template_kwargs go to the
        template (e.g. chat_template_kwargs={"enable_thinking": False}). lora_request: as
        in generate, one adapter or one per conversation.

        Defaults as in vLLM: sampling_params=None is SamplingParams(), temperature 1.0 and at
        most 16 new tokens; pass SamplingParams(temperature=0, max_tokens=...) for a
        deterministic answer of a chosen length.
        """
        if isinstance(messages, (list, tuple)) and messages and all(
                isinstance(m, (list, tuple)) for m in messages):
            conversations = list(messages)
        else:
            conversations = [messages]
        token_ids = [
            apply_chat_template(
                self.engine.tokenizer, c, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs, tools=tools,
            )
            for c in conversations
        ]
        return self.generate(token_ids, sampling_params, use_tqdm, lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm.auto import tqdm  # 0.1-0.2 s of imports: only where a bar shows

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(finished) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        if out.error is not None:
                            raise ValueError(out.error)
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            unfinished = [r for r in request_ids if r not in finished]
            if unfinished:
                self.engine.abort_request(unfinished)
        return [finished[r] for r in request_ids]


def engine_args(model: str | None = None, **kwargs: Any) -> EngineArgs:
    """EngineArgs from LLM(...)'s keyword arguments, vLLM's spellings included."""
    for name in _VLLM_SINGLE_DEVICE:
        value = kwargs.pop(name, 1)
        if value != 1:
            kind = name.removesuffix("_size").replace("_", " ")
            raise ValueError(f"{name}={value!r}: {kind}ism is not supported yet "
                             "(tensor_parallel_size splits the model over devices, device_map "
                             "its layers)")
    kwargs.pop("trust_remote_code", None)  # no checkpoint code is ever run
    mode = kwargs.pop("tokenizer_mode", "auto")
    if mode != "auto":
        raise ValueError(f"tokenizer_mode={mode!r} is not supported (only 'auto': the "
                         "model's Hugging Face tokenizer)")
    for old, new in _VLLM_RENAMED.items():
        if old in kwargs:
            kwargs[new] = kwargs.pop(old)
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"LLM() got an unsupported engine argument {unknown[0]!r}; supported: "
                        f"{', '.join(sorted(known - {'model'}))} (see help(LLM))")
    return EngineArgs(model=model, **kwargs)


def _lora_list(lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    """lora_request as one entry per prompt (one request, or a list of one per prompt)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (list, tuple)):
        loras = list(lora_request)
        bad = next((r for r in loras if r is not None and not isinstance(r, LoRARequest)), None)
        if bad is not None:
            raise TypeError(f"lora_request must be a LoRARequest or a list of them, got a "
                            f"list holding {type(bad).__name__}")
        if len(loras) != num_prompts:
            raise ValueError(f"got {len(loras)} lora requests for {num_prompts} prompts")
        return loras
    raise TypeError(f"lora_request must be a LoRARequest or a list of them, got "
                    f"{type(lora_request).__name__}")


def _is_token_ids(value: Any) -> bool:
    # `type(t) is int`: an int that is not a bool, in one check per token of every prompt
    return isinstance(value, list) and all(type(t) is int for t in value)


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt, or a list (or tuple) of them, as a list."""
    if isinstance(prompts, (str, Mapping)) or (_is_token_ids(prompts) and prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError(f"{_PROMPT_HELP}; got {type(prompts).__name__}")


def _engine_prompt(prompt: Any, index: int) -> str | list[int]:
    """The text or token ids of one of vLLM's prompt types."""
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt):
        return prompt
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"} and _is_token_ids(prompt["prompt_token_ids"]):
            return prompt["prompt_token_ids"]
        other = sorted(keys - {"prompt", "prompt_token_ids"}, key=str)
        if other:
            raise ValueError(f"prompts[{index}]: unsupported prompt key {other[0]!r} "
                             "(pagedllm takes 'prompt' or 'prompt_token_ids')")
        if keys == {"prompt", "prompt_token_ids"}:
            raise ValueError(f"prompts[{index}]: give 'prompt' or 'prompt_token_ids', not both")
        if not keys:
            raise ValueError(f"prompts[{index}]: an empty prompt dict")
        key = next(iter(keys))
        want = "a string" if key == "prompt" else "a list of ints"
        raise TypeError(f"prompts[{index}]: {key!r} must be {want}, "
                        f"got {type(prompt[key]).__name__}")
    raise TypeError(f"prompts[{index}]: {_PROMPT_HELP}; got {type(prompt).__name__}")

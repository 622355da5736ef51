"""EngineArgs: every engine option in one dataclass, shared by LLM(...) and the CLI.

Each field is one CLI flag, `--field-name`, generated from the field itself: its default,
its type (a bool gives `--flag` and `--no-flag`; a field that also takes a string, such as
"a,b" per device, is passed through as text), its choices and its help. Nothing about an
option is written twice.
"""
from __future__ import annotations

import argparse
import re
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from pagedllm.config import (
    CPU_ACTIVATIONS, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, PREEMPTION_MODES, QUANTIZATIONS,
    SpeculativeConfig,
)
from pagedllm.pooling_params import POOLING_TYPES


def option(default: Any, help: str, choices: tuple[str, ...] | None = None,
           aliases: tuple[str, ...] = (), parse: Any = None, nargs: str | None = None) -> Any:
    """A field of EngineArgs with what its CLI flag shows: `aliases` (vLLM's short flags),
    `parse` (the flag's own type function), `nargs` (a flag that takes several values)."""
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "aliases": aliases, "parse": parse, "nargs": nargs})


# vLLM's other names of dtypes (torch's): --dtype half is float16, float is float32.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def human_readable_int(value: str) -> int:
    """An integer as vLLM reads --max-model-len: "32k" is 32000 and "1.5m" 1500000 (k, m, g,
    t: powers of 1000), "32K" is 32768 (K, M, G, T: powers of 1024, whole numbers only)."""
    text = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid integer {value!r} (a number, or one with a suffix: 32k = 32000, "
                f"32K = 32768)") from None
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.islower():
        return int(float(number) * 1000 ** power)
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"invalid integer {value!r}: a binary suffix ({suffix}) takes a whole number; "
            f"did you mean {number}{suffix.lower()}?")
    return int(number) * 1024 ** power


@dataclass
class EngineArgs:
    model: str | None = option(
        None, "GGUF file, HF model directory, hub id, or preset name with --load-format dummy "
        "(default: SmolLM2-135M-Instruct)")
    tokenizer: str | None = option(None, "tokenizer directory or hub id (default: the model's)")
    load_format: str = option("auto", "how to read --model", LOAD_FORMATS)
    served_model_name: str | list[str] | None = option(
        None, "the model names the server answers to, the first in its responses (default: "
        "from the model)", nargs="+")
    dtype: str = option("auto", "weights and activations; auto: float32 on the CPU, "
                        "bfloat16 on CUDA; half: float16, float: float32",
                        (*DTYPES, *DTYPE_ALIASES))
    quantization: str | None = option(
        None, "gguf: keep a GGUF file's quantized blocks on the CPU (the default for GGUF "
        "files on the CPU with --dtype auto; --dtype float32 dequantizes them); fp8: FP8 "
        "weights on CUDA", QUANTIZATIONS)
    cpu_activations: str = option(
        "fp32", "activations of GGUF-packed matmuls on the CPU: fp32, or int8 (llama.cpp's "
        "Q8_0 blocks of 32, integer dot products; Q4_0, Q4_1 and Q8_0 weights, decode steps "
        "and prompts alike)", CPU_ACTIVATIONS)
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    device_map: str | None = option(
        None, 'layers per device, e.g. "cuda:0:20,cpu:10", or "auto" (by free memory)')
    tensor_parallel_size: int = option(
        1, "ranks to split the model over (Megatron-style): one GPU each on CUDA, one process "
        "each on the CPU; under torchrun, the world size", aliases=("-tp",))
    distributed_timeout: float = option(
        120.0, "seconds a collective between tensor-parallel ranks may wait before the step "
        "fails naming the rank")
    seed: int = option(0, "seed of the random weights of --load-format dummy")
    block_size: int = option(16, "tokens per KV-cache block")
    enable_prefix_caching: bool = option(True, "reuse the KV of prompt prefixes already computed")
    max_num_seqs: int | None = option(
        None, "most sequences in one step (default: 256; 1024 on a GPU of 70 GiB or more, "
        "unless max_num_batched_tokens is set; never more than the KV cache holds)")
    max_num_batched_tokens: int | None = option(
        None, "most tokens in one step, e.g. 4096 or 4k (default: 2048 on the CPU, 8192 on "
        "CUDA, 16384 on a GPU of 70 GiB or more unless max_num_seqs is set; never more "
        "than the KV cache holds)", parse=human_readable_int)
    max_model_len: int | None = option(
        None, "context length, e.g. 4096, 32k (32000) or 32K (32768) (default: the model's)",
        parse=human_readable_int)
    enable_chunked_prefill: bool = option(
        True, "split prompts longer than the step's token budget over several steps")
    preemption_mode: str = option(
        "recompute", "what a preempted request loses: its KV (recompute) or nothing (swap, "
        "to host memory)", PREEMPTION_MODES)
    kv_cache_memory: int | str | None = option(
        None, "bytes for the KV cache on the CPU (e.g. 2e9), or one value per device "
        "(default: a quarter of free RAM, up to 2 GiB)")
    gpu_memory_utilization: float | str = option(
        0.9, "share of each CUDA device the engine may use, or one value per device")
    kv_cache_dtype: str = option(
        "auto", "the paged KV cache's dtype: auto (the model's), or fp8 / fp8_e4m3 (FP8 E4M3 "
        "with a scale of 1.0, CUDA only: twice the tokens in the same memory)",
        KV_CACHE_DTYPES)
    swap_space: float = option(1.0, "GiB of host memory for swapped-out blocks")
    num_gpu_blocks_override: int | None = option(
        None, "KV-cache blocks to allocate, instead of profiling memory")
    enforce_eager: bool = option(False, "no CUDA graphs")
    num_scheduler_steps: int | None = option(
        None, "decode steps per scheduling step, samples fed to the next step on the device "
        "(default: 8 on CUDA, 4 on the CPU)")
    # On the CPU the forward is synchronous: nothing to overlap.
    async_scheduling: bool | None = option(
        None, "launch the next step (decode window, prompt chunks, admissions) before reading "
        "the running one's samples, so the host's work overlaps the device's (default: on CUDA "
        "only)")
    disable_log_stats: bool = option(
        True, "no periodic log line of the server's load (running and waiting requests, KV "
        "cache use); --no-disable-log-stats logs one every 10 s")
    speculative_config: dict | str | SpeculativeConfig | None = option(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 4} or {"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": 4}; optional "disable_by_batch_size": N')
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT format): requests name one (lora_request, or the "
        "server's model field) and rows of different adapters share a step")
    max_loras: int = option(1, "adapters in the device's slots at once (more in flight wait)")
    max_lora_rank: int = option(16, "the largest adapter rank accepted")
    pooling: str = option(
        "last", "how embeddings (/v1/embeddings, LLM.embed) pool the prompt's final hidden "
        "states: the last token's, or their mean", POOLING_TYPES)

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if isinstance(self.served_model_name, (list, tuple)):
            names = list(self.served_model_name)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"served_model_name must be a name or a non-empty list of "
                                 f"names, got {self.served_model_name!r}")
            self.served_model_name = names[0] if len(names) == 1 else names
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValueError(f"cpu_activations must be one of {', '.join(CPU_ACTIVATIONS)}, "
                             f"got {self.cpu_activations!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.num_scheduler_steps is not None and (
            isinstance(self.num_scheduler_steps, bool)
            or not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1
        ):
            raise ValueError(
                f"num_scheduler_steps must be an integer >= 1, got {self.num_scheduler_steps!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp > 1 and self.quantization is not None:
            raise ValueError(f"quantization {self.quantization!r} and tensor_parallel_size > 1 "
                             f"cannot be combined (yet): the sharded layers hold plain weights")
        if tp > 1 and (self.device_map or "").strip():
            raise ValueError("device_map and tensor_parallel_size > 1 cannot be combined (yet): "
                             "give one or the other")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if tp > 1:
                raise ValueError("speculative_config and tensor_parallel_size > 1 cannot be "
                                 "combined (yet)")
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling!r}")
        if self.enable_lora:
            self._check_lora()
        if not self.distributed_timeout > 0:
            raise ValueError(
                f"distributed_timeout must be a positive number of seconds, got "
                f"{self.distributed_timeout!r}")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tensor_parallel_size > 1:
            raise ValueError("enable_lora and tensor_parallel_size > 1 cannot be combined (yet)")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per field (see the module docstring), in an "engine" group."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(EngineArgs)
        for f in fields(EngineArgs):
            assert f.default is not MISSING, f"EngineArgs.{f.name} needs a default"
            flag = "--" + f.name.replace("_", "-")
            kind = _cli_type(hints[f.name])
            kwargs: dict[str, Any] = dict(default=f.default, help=f.metadata["help"])
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
                if f.default is not None:  # None: the help says what it depends on
                    kwargs["help"] += f" (default: {'on' if f.default else 'off'})"
            else:
                kwargs["type"] = f.metadata["parse"] or kind
                kwargs["choices"] = f.metadata["choices"]
                if f.metadata["nargs"]:
                    kwargs["nargs"] = f.metadata["nargs"]
                if f.default is not None:
                    kwargs["help"] += f" (default: {f.default})"
            group.add_argument(*f.metadata["aliases"], flag, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        kwargs: dict[str, Any] = {f.name: getattr(args, f.name) for f in fields(cls)
                                  if hasattr(args, f.name)}
        return cls(**kwargs)

    def served_model_names(self) -> list[str]:
        """The names the server answers to ([] when none was given: the model's own)."""
        names = self.served_model_name
        if names is None:
            return []
        return [names] if isinstance(names, str) else list(names)


def _cli_type(annotation: Any) -> type:
    """bool, int, float or str: the one type the flag parses ("a,b" per device: str)."""
    members = [t for t in typing.get_args(annotation) if t is not type(None)]
    if not isinstance(annotation, types.UnionType):
        members = [annotation]
    return members[0] if len(members) == 1 else str

"""EngineArgs: every engine option in one dataclass, shared by LLM(...) and the CLI."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("gguf", "fp8")


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # gguf: keep a GGUF file's quantized blocks (CPU; the default for GGUF on the CPU when
    # dtype is auto); fp8: FP8 weights on CUDA. None: plain weights in dtype.
    quantization: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    device_map: str | None = None  # "cuda:0:20,cpu:10" or "auto"
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    kv_cache_memory: int | str | None = None  # bytes, or "a,b" per device
    gpu_memory_utilization: float | str = 0.9  # one value, or "a,b" per device
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    # Decode steps run back to back per scheduling step (samples stay on the device);
    # None: 8 on CUDA, 1 on the CPU (where the host's per-step work is small next to the model).
    num_scheduler_steps: int | None = None
    disable_log_stats: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.num_scheduler_steps is not None and (
            isinstance(self.num_scheduler_steps, bool)
            or not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1
        ):
            raise ValueError(
                f"num_scheduler_steps must be an integer >= 1, got {self.num_scheduler_steps!r}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="GGUF file, HF model directory, hub id, or "
                       "preset name with --load-format dummy (default: SmolLM2-135M-Instruct)")
        g.add_argument("--tokenizer", default=None)
        g.add_argument("--load-format", default="auto",
                       choices=["auto", "gguf", "safetensors", "dummy"])
        g.add_argument("--served-model-name", default=None)
        g.add_argument("--dtype", default="auto", choices=list(DTYPES))
        g.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                       help="gguf: keep a GGUF file's quantized blocks on the CPU (default for "
                       "GGUF on the CPU; --dtype float32 dequantizes); fp8: FP8 weights on CUDA")
        g.add_argument("--device", default="auto")
        g.add_argument("--device-map", default=None,
                       help='layers per device, e.g. "cuda:0:20,cpu:10", or "auto"')
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false")
        g.add_argument("--max-num-seqs", type=int, default=256)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false")
        g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
        g.add_argument("--kv-cache-memory", default=None,
                       help="bytes for the KV cache on CPU (e.g. 2e9), or one value per device")
        g.add_argument("--gpu-memory-utilization", default="0.9")
        g.add_argument("--swap-space", type=float, default=1.0, help="GiB")
        g.add_argument("--num-gpu-blocks-override", type=int, default=None)
        g.add_argument("--enforce-eager", action="store_true")
        g.add_argument("--num-scheduler-steps", type=int, default=None,
                       help="decode steps per scheduling step (default: 8 on CUDA, 1 on CPU)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        kwargs: dict[str, Any] = {f.name: getattr(args, f.name) for f in fields(cls)
                                  if hasattr(args, f.name)}
        return cls(**kwargs)

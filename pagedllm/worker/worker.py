"""Worker: loads the model onto its devices, sizes the KV cache by profiling, and executes
scheduled steps (cache swaps/copies, then the forward and sampling)."""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.layers.metadata import PagedAttentionInputMetadata
from pagedllm.loader import initialize_dummy_weights, load_model_source
from pagedllm.models.registry import build_model
from pagedllm.worker import memory
from pagedllm.worker.cache_engine import CacheEngine, bytes_per_block
from pagedllm.worker.device_map import DeviceMap
from pagedllm.worker.model_runner import ModelRunner, StepResult

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _per_device(value, devices: list[torch.device], cast) -> dict[torch.device, object]:
    """One value for all devices, or a comma-separated / list value per device."""
    if value is None:
        return {d: None for d in devices}
    if isinstance(value, str):
        value = [cast(float(v)) for v in value.split(",")]
    if not isinstance(value, (list, tuple)):
        value = [value]
    if len(value) == 1:
        value = list(value) * len(devices)
    if len(value) != len(devices):
        raise ValueError(f"got {len(value)} values for {len(devices)} devices")
    return {d: cast(v) for d, v in zip(devices, value)}


class Worker:
    def __init__(self, args: EngineArgs) -> None:
        source = load_model_source(args.model, args.load_format, args.tokenizer)
        self.source_name = source.name
        self.model_config = config = source.config
        self.tokenizer = source.tokenizer
        device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, device)
        num_layers = config.num_hidden_layers
        self.device_map = (
            DeviceMap.parse(args.device_map, num_layers) if args.device_map
            else DeviceMap.single(device, num_layers)
        )
        self.model = self._load_model(source, args.seed)
        head = self.model.lm_head if self.model.lm_head is not None else self.model.embed_tokens
        self.logits_device = head.weight.device
        self.max_model_len = min(args.max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings)
        default_budget = 8192 if device.type == "cuda" else 512
        budget = args.max_num_batched_tokens or default_budget
        if not args.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        self.max_num_batched_tokens = budget
        self.max_num_seqs = args.max_num_seqs
        eos = list(config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(set(eos))
        self.block_size = args.block_size
        self.runner = ModelRunner(self.model, args.block_size, self.eos_token_ids,
                                  self.device_map.layer_devices)
        self.num_gpu_blocks = args.num_gpu_blocks_override or self._profile_num_blocks(args)
        if self.num_gpu_blocks < 1:
            raise ValueError("no memory is left for the KV cache: lower the batch limits or "
                             "give the cache more memory")
        all_layers_block = bytes_per_block(config, args.block_size, self.dtype, num_layers)
        self.num_cpu_blocks = int(args.swap_space * (1 << 30)) // all_layers_block
        self.cache_engine = CacheEngine(
            config, args.block_size, self.num_gpu_blocks, self.num_cpu_blocks, self.dtype,
            self.device_map.layer_devices,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB); swap space %d blocks",
            self.num_gpu_blocks, args.block_size, self.num_gpu_blocks * args.block_size,
            self.num_gpu_blocks * all_layers_block / (1 << 30), self.num_cpu_blocks,
        )

    # ------------------------------------------------------------------ loading
    def _load_model(self, source, seed: int) -> nn.Module:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):
                model = build_model(source.config)
        finally:
            torch.set_default_dtype(previous)
        devices = self.device_map.layer_devices
        for layer, device in zip(model.layers, devices):
            layer.to_empty(device=device)
        model.embed_tokens.to_empty(device=devices[0])
        model.norm.to_empty(device=devices[-1])
        if model.lm_head is not None:
            model.lm_head.to_empty(device=devices[-1])
        if source.load_format == "dummy":
            initialize_dummy_weights(model, seed)
        else:
            model.load_weights(source.iter_weights(self.dtype))
        return model.eval()

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.logits_device).manual_seed(seed)

    # ---------------------------------------------------------------- profiling
    def _profile_num_blocks(self, args: EngineArgs) -> int:
        devices = self.device_map.devices
        peaks = memory.profile_peak_memory(self._profile_run, devices)
        utilization = _per_device(args.gpu_memory_utilization, devices, float)
        kv_memory = _per_device(args.kv_cache_memory, devices, int)
        budgets = {
            d: memory.kv_budget(d, peaks[d], utilization[d], kv_memory[d]) for d in devices
        }
        block_bytes = {
            d: bytes_per_block(self.model_config, args.block_size, self.dtype,
                               self.device_map.layers_on(d))
            for d in devices
        }
        for d in devices:
            logger.info("%s: activation peak %.1f MiB, KV budget %.2f GiB", d,
                        peaks[d] / (1 << 20), budgets[d] / (1 << 30))
        return memory.num_blocks_for_budgets(budgets, block_bytes)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """One forward at the largest batch the scheduler can form, plus its logits."""
        tokens = self.max_num_batched_tokens
        seq_len = min(self.max_model_len, tokens)
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        bs = self.block_size
        num_blocks = sum(math.ceil(n / bs) for n in lens)
        c = self.model_config
        caches = [
            torch.empty((2, num_blocks, bs, c.num_key_value_heads, c.head_dim),
                        dtype=self.dtype, device=d)
            for d in self.device_map.layer_devices
        ]
        positions, slots, tables, next_block = [], [], [], 0
        for n in lens:
            blocks = list(range(next_block, next_block + math.ceil(n / bs)))
            next_block += len(blocks)
            tables.append(blocks)
            positions += range(n)
            slots += [blocks[p // bs] * bs + p % bs for p in range(n)]
        meta = PagedAttentionInputMetadata.build(positions, slots, lens, lens, tables,
                                                 device=self.device_map.layer_devices[0])
        metadata = {d: meta.to(d) for d in self.device_map.devices}
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device_map.layer_devices[0])
        hidden = self.model(ids, caches, metadata)
        rows = min(self.max_num_seqs, tokens)
        self.model.compute_logits(hidden[:rows]).log_softmax(-1)
        del caches, hidden

    # ---------------------------------------------------------------- execution
    def apply_cache_ops(self, out: SchedulerOutput) -> None:
        """Swaps and copy-on-write copies, in the order the scheduler requires."""
        self.cache_engine.swap_out(out.blocks_to_swap_out)
        self.cache_engine.swap_in(out.blocks_to_swap_in)
        self.cache_engine.copy(out.blocks_to_copy)

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.runner.execute(out, self.cache_engine.gpu_cache)

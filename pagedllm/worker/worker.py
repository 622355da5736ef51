"""Worker: loads the model onto its devices, sizes the KV cache by profiling, and executes
step batches (cache swaps/copies, then the forward and sampling). It reads nothing of the
engine but the plain StepBatch (pagedllm/contract.py)."""
from __future__ import annotations

import itertools
import logging
import math
import os
from dataclasses import replace

import torch
from torch import nn

from pagedllm.config import EngineConfig, bound_by_cache, default_batch_limits, resolve_dtype
from pagedllm.distributed import parallel_state as ps
from pagedllm.distributed.communication import all_reduce_min
from pagedllm.engine_args import EngineArgs
from pagedllm.kernels.metadata import PagedAttentionInputMetadata, slots_for
from pagedllm.layers.gguf_linear import is_packed, unloaded_parts
from pagedllm.layers.sampler import WARM_UP_PARAMS
from pagedllm.loader import initialize_dummy_weights, load_model_source
from pagedllm.loader.gguf_loader import packed_tensor_types
from pagedllm.models.device_map import DeviceMap
from pagedllm.models.registry import build_empty_model
from pagedllm.layers import dispatch
from pagedllm.layers.linear import prepack_model
from pagedllm.worker import memory
from pagedllm.worker.cache_engine import CacheEngine, bytes_per_block, resolve_kv_cache_dtype
from pagedllm.worker.cuda_graphs import graphs_supported
from pagedllm.worker.placement import (
    PlacementInputs, WeightSizes, check_weights_fit, describe, place_model, plan_auto,
)
from pagedllm.contract import GrammarMasks, StepBatch, StepResult, WorkerInfo
from pagedllm.worker.lora_manager import WorkerLoRA
from pagedllm.worker.model_runner import ModelRunner, PendingStep
from pagedllm.worker.quantization import (
    describe_gguf, fuse_fp8_input_quantization, pack_gguf_modules, quantize_fp8,
    resolve_quantization,
)

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def tp_device(device: torch.device, device_map: str) -> torch.device:
    """The device of this tensor-parallel rank: its local GPU, or the CPU."""
    if device_map:
        raise ValueError("device_map and tensor_parallel_size > 1 cannot be combined (yet): "
                         "give one or the other")
    if device.type != "cuda":
        return device
    if device.index is not None and ps.tp_size() > 1:
        raise ValueError(f"device {str(device)!r}: with tensor_parallel_size > 1 each rank "
                         f"takes its own GPU (cuda:LOCAL_RANK); pass --device cuda or auto")
    local = ps.state().local_rank
    if local >= torch.cuda.device_count():
        raise ValueError(f"tensor parallel rank {ps.tp_rank()} needs GPU {local}, but only "
                         f"{torch.cuda.device_count()} GPU(s) are visible")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class Worker:
    # A batch's masks may come with sample (StepBatch.defer_token_bitmask).
    defers_token_bitmask = True

    def __init__(self, args: EngineArgs, resolved: EngineConfig) -> None:
        """`resolved`: what the engine resolved before any worker existed (resolve_config);
        the worker reads the weights, never the tokenizer."""
        source = replace(load_model_source(args.model, args.load_format, with_tokenizer=False),
                         config=resolved.model_config)  # its context as resolved
        self.source_name = resolved.source_name
        self.source_path = resolved.source_path  # its own generation defaults are read from it
        self.model_config = resolved.model_config
        self.max_model_len = resolved.max_model_len
        self.eos_token_ids = list(resolved.eos_token_ids)
        device_map = self._resolve(args, source)
        self.model = self._load_model(source, args, device_map)
        config = self.model_config
        head = self.model.lm_head if self.model.lm_head is not None else self.model.embed_tokens
        self.logits_device = next(itertools.chain(head.parameters(), head.buffers())).device
        self.block_size = args.block_size
        self.runner = ModelRunner(self.model, args.block_size, self.eos_token_ids,
                                  self.device_map.layer_devices, self.logits_device)
        self.lora = WorkerLoRA(self.model, args.max_loras, args.max_lora_rank) \
            if args.enable_lora else None
        if self.quantization == "fp8":
            logger.info("%d FP8 input quantizations fused into the layers before them",
                        fuse_fp8_input_quantization(self.model))
        self.draft_cache_engine = None
        spec = args.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            from pagedllm.worker.draft_model import load_draft_model

            draft = load_draft_model(spec.model, spec.load_format, spec.seed, self.dtype,
                                     self.device_map.input_device, config.vocab_size,
                                     self.max_model_len)
            self.weight_bytes += memory.module_bytes(draft)
        if graphs_supported(self.device_map.layer_devices, args.enforce_eager):
            self.runner.enable_cuda_graphs(self.max_num_seqs, self.max_model_len,
                                           self.kv_config.num_key_value_heads, config.head_dim,
                                           self.dtype)
        self._init_kv_cache(args, draft)

    def _resolve(self, args: EngineArgs, source) -> DeviceMap | str:
        """Device, tensor-parallel shard, dtype, quantization, context and token budget;
        returns where the model goes (a DeviceMap, or "auto" to be planned)."""
        config = self.model_config
        device = resolve_device(args.device)
        num_layers = config.num_hidden_layers
        spec = (args.device_map or "").strip()
        tp = ps.tp_size()
        if ps.is_initialized():
            device = tp_device(device, spec)
            ps.check_tp_size(config, tp)
            torch.manual_seed(args.seed)  # every rank samples the same tokens (unseeded rows)
        # The KV cache holds this rank's KV heads only (all of them without tensor parallelism).
        heads, kv_heads = ps.local_num_heads(config, tp)
        self.kv_config = replace(config, num_attention_heads=heads, num_key_value_heads=kv_heads)
        explicit_map = DeviceMap.parse(spec, num_layers) if spec and spec != "auto" else None
        if explicit_map is not None:
            device = explicit_map.input_device
        self.dtype = resolve_dtype(args.dtype, device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            args.kv_cache_dtype, explicit_map.devices if explicit_map is not None else [device],
            self.dtype)
        self.quantization = resolve_quantization(
            args.quantization, source.load_format,
            explicit_map.devices if explicit_map is not None else [device], args.dtype)
        if ps.is_initialized():
            self.quantization = None  # the sharded layers hold plain weights (EngineArgs checks)
        self._batch_limits(args, device)
        return explicit_map or ("auto" if spec == "auto" else DeviceMap.single(device, num_layers))

    def _batch_limits(self, args: EngineArgs, device: torch.device) -> None:
        """max_num_seqs and max_num_batched_tokens: the user's, else by the device; sized by
        the GPU's memory when the user set neither (then bounded by the KV cache, once it
        is sized: `_bound_batch_limits`)."""
        self.limits_by_gpu = device.type == "cuda" and args.max_num_seqs is None and \
            args.max_num_batched_tokens is None
        memory = torch.cuda.get_device_properties(device).total_memory \
            if self.limits_by_gpu else None
        seqs, tokens = default_batch_limits(device.type, memory)
        self.max_num_seqs = args.max_num_seqs or seqs
        budget = args.max_num_batched_tokens or tokens
        if not args.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        self.max_num_batched_tokens = budget

    def _bound_batch_limits(self, args: EngineArgs) -> None:
        if self.limits_by_gpu:
            self.max_num_seqs, self.max_num_batched_tokens = bound_by_cache(
                self.max_num_seqs, self.max_num_batched_tokens, self.num_gpu_blocks,
                args.block_size, 0 if args.enable_chunked_prefill else self.max_model_len)
        logger.info("batch limits: max_num_seqs %d, max_num_batched_tokens %d (%s)",
                    self.max_num_seqs, self.max_num_batched_tokens,
                    "sized by the GPU" if self.limits_by_gpu else "set or the defaults")

    def _init_kv_cache(self, args: EngineArgs, draft: nn.Module | None) -> None:
        """Size the KV cache (profiled, or the override), allocate it (and the draft's, with
        the same blocks), then capture the decode graphs over it."""
        # Every rank holds the same block numbers: the fewest any rank has room for.
        self.num_gpu_blocks = all_reduce_min(
            args.num_gpu_blocks_override or self._profile_num_blocks(args))
        if self.num_gpu_blocks < 1:
            raise ValueError("no memory is left for the KV cache: lower the batch limits or "
                             "give the cache more memory")
        kv_config = self.kv_config
        resolve_kv_cache_dtype(args.kv_cache_dtype, self.device_map.devices, self.dtype)  # "auto" maps
        all_layers_block = bytes_per_block(kv_config, args.block_size, self.kv_cache_dtype,
                                           kv_config.num_hidden_layers)
        if draft is not None:
            # The draft's cache has the same blocks: the budget pays for both per block.
            d = draft.config
            draft_block = bytes_per_block(d, args.block_size, self.dtype, d.num_hidden_layers)
            if not args.num_gpu_blocks_override:
                self.num_gpu_blocks = self.num_gpu_blocks * all_layers_block // (
                    all_layers_block + draft_block)
            all_layers_block += draft_block
        self.num_cpu_blocks = int(args.swap_space * (1 << 30)) // all_layers_block
        self.cache_engine = CacheEngine(
            kv_config, args.block_size, self.num_gpu_blocks, self.num_cpu_blocks,
            self.kv_cache_dtype,
            self.device_map,
        )
        if draft is not None:
            self._init_draft_cache(args, draft)
        if self.runner.graphs is not None:
            self.runner.graphs.capture(self.cache_engine.gpu_cache)
        if self.device_map.input_device.type == "cuda":
            self._warm_up_sampler()
        self._log_placement(args.block_size, all_layers_block)
        self._bound_batch_limits(args)

    @torch.inference_mode()
    def _warm_up_sampler(self) -> None:
        """The LM head and every sampling path once (Sampler.warm_up), on logits of random
        hidden states: their kernels compile at start-up, not under the first request."""
        generator = torch.Generator(device=self.device_map.input_device).manual_seed(0)
        hidden = torch.randn(len(WARM_UP_PARAMS), self.model_config.hidden_size,
                             generator=generator, device=self.device_map.input_device,
                             dtype=self.dtype)
        self.runner.sampler.warm_up(self.model.compute_logits(hidden))

    def _init_draft_cache(self, args: EngineArgs, draft: nn.Module) -> None:
        from pagedllm.worker.draft_model import DraftProposer

        d = draft.config
        self.draft_cache_engine = CacheEngine(
            d, args.block_size, self.num_gpu_blocks, self.num_cpu_blocks, self.dtype,
            DeviceMap.single(self.device_map.input_device, d.num_hidden_layers))
        self.runner.drafter = DraftProposer(draft, self.draft_cache_engine.gpu_cache,
                                            args.block_size, self.device_map.input_device,
                                            self.runner.sampler)

    def _log_placement(self, block_size: int, all_layers_block: int) -> None:
        groups = self.device_map.groups
        for line in describe(
            self.device_map, self.weight_sizes.per_group(self.device_map),
            [self.cache_engine.group_bytes(g.index) for g in groups],
            {d: memory.free_memory(d) for d in self.device_map.devices},
        ):
            logger.info(line)
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s); swap space %d blocks",
            self.num_gpu_blocks, block_size, self.num_gpu_blocks * block_size,
            self.num_gpu_blocks * all_layers_block / (1 << 30),
            str(self.kv_cache_dtype).removeprefix("torch."), self.num_cpu_blocks,
        )

    # ------------------------------------------------------------------ loading
    def _load_model(self, source, args: EngineArgs, device_map: DeviceMap | str) -> nn.Module:
        model = build_empty_model(source.config, self.dtype)
        keep_packed: set[str] = set()
        if self.quantization == "gguf":
            keep_packed = pack_gguf_modules(model, packed_tensor_types(source.path))
        self.device_map = self._place(model, args, device_map)
        if source.load_format == "dummy":
            initialize_dummy_weights(model, args.seed)
        else:
            model.load_weights(source.iter_weights(self.dtype, keep_packed,
                                                   memory.module_bytes(model)))
        missing = unloaded_parts(model)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
        if keep_packed:
            if args.cpu_activations == "int8":
                self._int8_activations(model)
            logger.info(describe_gguf(model))
        if self.quantization == "fp8":
            logger.info("%d linears quantized to FP8 E4M3 (per-channel scales)",
                        quantize_fp8(model))
        self.weight_bytes = memory.module_bytes(model)
        logger.info("weights: %.1f MiB (%s)", self.weight_bytes / (1 << 20),
                    self.quantization or str(self.dtype).removeprefix("torch."))
        self._prepack_cpu_linears(model)
        return model.eval()

    @staticmethod
    def _int8_activations(model: nn.Module) -> None:
        """8-bit activations in every packed matmul. Their fast kernels read 8-row copies of
        the weights (as many bytes again, made on first use); where free RAM could not hold
        them with room to spare, the int8 kernels read the GGUF layout (slower, no copy)."""
        packed = [m for m in model.modules() if is_packed(m)]
        copies_fit = 2 * sum(m.qweight.numel() for m in packed) <= \
            memory.free_memory(torch.device("cpu"))
        if not copies_fit:
            logger.info("int8 activations read the GGUF layout: too little free RAM for "
                        "8-row copies of the weights")
        for m in packed:
            m.set_int8_activations(True, x8_layout=copies_fit)

    def _prepack_cpu_linears(self, model: nn.Module) -> None:
        """MKL-packed weights where they pay (layers/linear.py): the CPU fp32 LM head, on the
        first batched decode step; every linear, now, with PAGEDLLM_MKL_PACK=all. Only when
        RAM holds the packed copies with room to spare."""
        head = model.lm_head if model.lm_head is not None else model.embed_tokens
        weight = getattr(head, "weight", None)  # none on a GGUF-packed head
        if not isinstance(weight, torch.Tensor) or not dispatch.choose(
                weight.device, weight.dtype).packs_linears:
            return
        pack_all = os.environ.get("PAGEDLLM_MKL_PACK", "head") == "all"
        weights = model.parameters() if pack_all else [weight]
        size = sum(p.numel() * p.element_size() for p in weights if p.device.type == "cpu")
        if 3 * size > memory.free_memory(torch.device("cpu")) // 2:
            logger.info("CPU linears stay unpacked: too little free RAM for packed copies")
        elif pack_all:
            logger.info("packed %d CPU linear weights for MKL", prepack_model(model))
        else:
            model.pack_head_when_batched = True

    def _place(self, model: nn.Module, args: EngineArgs, device_map: DeviceMap | str) -> DeviceMap:
        """Decide the map ("auto": by free memory), check the weights fit, materialise."""
        self.weight_sizes = sizes = WeightSizes.of(model)
        if device_map == "auto":
            device_map = plan_auto(self._usable_memory(args), PlacementInputs(
                sizes,
                kv_block_bytes=bytes_per_block(self.kv_config, args.block_size,
                                               self.kv_cache_dtype, 1),
                activation_peak=self._activation_peak(),
                min_blocks=math.ceil(self.max_model_len / args.block_size),
            ))
        weights = sizes.per_device(device_map)
        check_weights_fit(weights, {d: memory.free_memory(d) for d in weights})
        place_model(model, device_map)
        return device_map

    @staticmethod
    def _usable_memory(args: EngineArgs) -> list[tuple[torch.device, int]]:
        """Every CUDA device in order, then the CPU: where "auto" may put layers."""
        value = args.gpu_memory_utilization
        values = list(value) if isinstance(value, (list, tuple)) else str(value).split(",")
        if len(values) > 1:
            raise ValueError("device_map='auto' takes one gpu_memory_utilization for all devices")
        utilization = float(values[0])
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [torch.device("cuda", i) for i in range(count)] + [torch.device("cpu")]
        return [(d, memory.usable_memory(d, utilization)) for d in devices]

    # ---------------------------------------------------------------- profiling
    def _profile_num_blocks(self, args: EngineArgs) -> int:
        devices = self.device_map.devices
        if all(d.type == "cpu" for d in devices):
            # A profiling forward of the largest batch is slow on the CPU, and the high-water
            # mark of the process' RSS measures it only roughly: the CPU takes the analytic
            # bound, which covers what such a forward uses.
            peak = self._activation_peak()
            peaks = {d: peak for d in devices}
        else:
            peaks = memory.profile_peak_memory(self._profile_run, devices)
        if self.runner.graphs is not None:
            # The decode graphs' memory lives beside the eager activations: reserve both.
            pool = memory.profile_peak_memory(self.runner.graphs.profile_run, devices)
            reserve = {d: self.runner.graphs.memory_reserve(d, pool.get(d, 0)) for d in devices}
            logger.info("CUDA graph headroom: %.1f MiB", sum(reserve.values()) / (1 << 20))
            peaks = {d: peaks[d] + reserve[d] for d in devices}
        utilization = memory.per_device_values(
            "gpu_memory_utilization", args.gpu_memory_utilization, devices, float)
        kv_memory = memory.per_device_values("kv_cache_memory", args.kv_cache_memory, devices, int)
        budgets = {
            d: memory.kv_budget(d, peaks[d], utilization[d], kv_memory[d]) for d in devices
        }
        block_bytes = {
            d: bytes_per_block(self.kv_config, args.block_size, self.kv_cache_dtype,
                               self.device_map.layers_on(d))
            for d in devices
        }
        for d in devices:
            logger.info("%s: activation peak %.1f MiB, KV budget %.2f GiB", d,
                        peaks[d] / (1 << 20), budgets[d] / (1 << 30))
        return memory.num_blocks_for_budgets(budgets, block_bytes)

    def _activation_peak(self) -> int:
        return memory.estimate_activation_peak(
            self.model_config, self.max_num_batched_tokens,
            min(self.max_num_seqs, self.max_num_batched_tokens), self.dtype, self.max_model_len)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """One forward at the largest batch the scheduler can form, plus its logits, over a
        cache of the engine's KV dtype: its kernels (an FP8 cache's prefill and writes) are
        compiled here, not in the first prompt step."""
        tokens = self.max_num_batched_tokens
        seq_len = min(self.max_model_len, tokens)
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        bs = self.block_size
        num_blocks = sum(math.ceil(n / bs) for n in lens)
        c = self.kv_config
        caches = [
            torch.empty((2, num_blocks, bs, c.num_key_value_heads, c.head_dim),
                        dtype=self.kv_cache_dtype, device=d)
            for d in self.device_map.layer_devices
        ]
        positions, slots, tables, next_block = [], [], [], 0
        for n in lens:
            blocks = list(range(next_block, next_block + math.ceil(n / bs)))
            next_block += len(blocks)
            tables.append(blocks)
            positions += range(n)
            slots += slots_for(blocks, 0, n, bs)
        meta = PagedAttentionInputMetadata.build(positions, slots, lens, lens, tables,
                                                 device=self.device_map.layer_devices[0])
        metadata = self.device_map.distribute(meta)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device_map.layer_devices[0])
        hidden = self.model(ids, caches, metadata)
        rows = min(self.max_num_seqs, tokens)
        self.model.compute_logits(hidden[:rows]).log_softmax(-1)
        del caches, hidden

    def shutdown(self) -> None:
        """Release the decode graphs (tp_worker.DriverWorker also stops the other ranks)."""
        if self.runner.graphs is not None:
            self.runner.graphs.release()
            self.runner.graphs = None

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            eos_token_ids=tuple(self.eos_token_ids),
            on_cuda=self.device_map.input_device.type == "cuda",
            defers_token_bitmask=self.defers_token_bitmask,
            weight_bytes=self.weight_bytes,
            source_name=self.source_name,
        )

    # ---------------------------------------------------------------- execution
    def execute(self, batch: StepBatch) -> PendingStep:
        """Executor.execute: apply the batch's swaps and copy-on-write copies (in the order
        the scheduler requires), then queue its forward(s) and, unless its masks come with
        `sample`, its sampling."""
        self.cache_engine.swap_out(batch.blocks_to_swap_out)
        self.cache_engine.swap_in(batch.blocks_to_swap_in)
        self.cache_engine.copy(batch.blocks_to_copy)
        if self.draft_cache_engine is not None:
            self.draft_cache_engine.swap_out(batch.blocks_to_swap_out)
            self.draft_cache_engine.swap_in(batch.blocks_to_swap_in)
            self.draft_cache_engine.copy(batch.blocks_to_copy)
        if self.lora is not None:
            self.runner.lora_rows = self.lora.apply(batch)
        return self.runner.launch(batch, self.cache_engine.gpu_cache)

    def sample(self, handle: PendingStep, masks: GrammarMasks | None) -> StepResult:
        """Executor.sample: a decode window's sub-steps under their masks, then the samples
        on the host."""
        return handle.sample(masks)

    def add_lora(self, request) -> None:
        """Check a LoRA adapter against the model and keep it ready (worker/lora_manager)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora=True, --enable-lora)")
        self.lora.add(request)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_int_id)

"""CausalLM: what every model shares. A model is its modules plus three stages, the unit a
device-group walk runs (eagerly here, or captured per group in worker/cuda_graphs.py):

    embed(input_ids) -> state
    run_layers(layers, state, kv_caches, meta) -> state     (a range of decoder layers)
    final_norm(state) -> hidden

where a state is a tuple of tensors (or None) carried from layer to layer. A model also has
`layers`, `embed_tokens`, `norm` and `lm_head` (None when tied to the embedding), which
placement reads, and says how Hugging Face weight names map onto its parameters.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.layers.gguf_linear import PackedWeight
from pagedllm.layers.linear import compute_logits
from pagedllm.models.device_map import DeviceMap, on_device

MetadataByGroup = (
    PagedAttentionInputMetadata
    | list[PagedAttentionInputMetadata]
    | dict[torch.device, PagedAttentionInputMetadata]
)


class CausalLM(nn.Module):
    config: ModelConfig
    layers: nn.ModuleList
    embed_tokens: nn.Module
    norm: nn.Module
    lm_head: nn.Module | None
    # Set at placement; None: one group per run of layers whose weights share a device.
    device_map: DeviceMap | None = None

    def layer_device(self, i: int) -> torch.device:
        return next(self.layers[i].parameters()).device

    def forward(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], metadata: MetadataByGroup
    ) -> torch.Tensor:
        """Final hidden states of a flat batch of tokens. metadata: one per device group
        (DeviceMap.distribute), or keyed by device, or the input device's alone."""
        device_map = self.device_map or DeviceMap.from_layer_devices(
            [self.layer_device(i) for i in range(len(self.layers))]
        )
        metas = device_map.distribute(metadata)
        state = device_map.walk(
            self.embed(input_ids),
            lambda group, state: self.run_layers(group.layers, state, kv_caches,
                                                 metas[group.index]),
        )
        with on_device(device_map.output_device):  # the final norm may be a Triton kernel too
            return self.final_norm(state)

    def embed(self, input_ids: torch.Tensor) -> tuple:
        raise NotImplementedError

    def run_layers(self, layers: range, state: tuple, kv_caches: list[torch.Tensor],
                   meta: PagedAttentionInputMetadata) -> tuple:
        raise NotImplementedError

    def final_norm(self, state: tuple) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return compute_logits(self, hidden)

    # ---------------------------------------------------------------- weights
    def weight_target(self, name: str) -> tuple[str, int | None] | None:
        """The parameter a checkpoint tensor loads into, and its shard of that parameter
        (None: the whole parameter); None skips the tensor."""
        return name, None

    def num_shards(self, param_name: str) -> int | None:
        """How many checkpoint tensors a fused parameter is made of (None: not fused)."""
        return None

    def shard_range(self, param_name: str, shard: int) -> tuple[int, int]:
        """(start, length) of a shard along the parameter's first dimension, for a fused
        parameter of a module that does not place its parts itself (layers/parallel_linear.py
        modules do, per tensor-parallel rank)."""
        raise NotImplementedError

    def target_and_tensor(self, param_name: str, param: torch.Tensor, shard: int | None,
                          tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The region of `param` a checkpoint tensor fills, and the tensor cut to it: a
        sharded layer (layers/parallel_linear.py) cuts this rank's slice."""
        module_name, _, leaf = param_name.rpartition(".")
        module = self.get_submodule(module_name)
        if hasattr(module, "shard_weight"):
            if shard is not None:
                param = param.narrow(0, *module.local_range(shard))
            return param, module.shard_weight(leaf, tensor, shard)
        if shard is not None:
            param = param.narrow(0, *self.shard_range(param_name, shard))
        return param, tensor

    def convert_weight(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The checkpoint tensor in our layout (same shape)."""
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors as they arrive; a clear error for a tensor the model
        has no place for, one of the wrong shape, or one the checkpoint lacks. A PackedWeight
        goes to its packed module as it is (the worker checks those are complete)."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied to the embedding
            target = self.weight_target(name)
            if target is None:
                continue
            param_name, shard = target
            if isinstance(tensor, PackedWeight):  # GGUF blocks kept packed
                module = self.get_submodule(param_name.removesuffix(".weight"))
                module.load_packed(shard or 0, tensor)
                continue
            if param_name not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            expected = self._expected_shape(param_name, shard)
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            param, tensor = self.target_and_tensor(
                param_name, params[param_name], shard, self.convert_weight(param_name, tensor))
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add((param_name, shard))
        missing = []
        for param_name in params:
            shards = self.num_shards(param_name)
            for shard in range(shards) if shards else [None]:
                if (param_name, shard) not in loaded:
                    missing.append(param_name if shard is None else f"{param_name} (shard {shard})")
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")

    def _expected_shape(self, param_name: str, shard: int | None) -> tuple[int, ...]:
        """The checkpoint shape a tensor should have (the full, unsharded one)."""
        module_name, _, leaf = param_name.rpartition(".")
        module = self.get_submodule(module_name)
        param = self.get_parameter(param_name)
        if not hasattr(module, "full_shape"):
            return tuple(param.narrow(0, *self.shard_range(param_name, shard)).shape
                         if shard is not None else param.shape)
        full = module.full_shape(leaf)
        if shard is not None:
            full = (module.part_sizes[shard], *full[1:])
        return tuple(full)

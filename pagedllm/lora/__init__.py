"""LoRA adapters: PEFT checkpoints (adapter.py), the fixed pool of adapter slots the
projections read (weights.py) and the request field (request.py). The per-row apply is in
layers/lora.py."""
from pagedllm.lora.adapter import LoRAAdapter, load_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.weights import LoRAWeights

__all__ = ["LoRAAdapter", "LoRARequest", "LoRAWeights", "load_adapter"]

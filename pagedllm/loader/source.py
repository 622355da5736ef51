"""ModelSource: what a loader hands the engine — a config, a tokenizer and a weight stream."""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedllm.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WeightIterator = Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class ModelSource:
    name: str  # display / served model name
    path: str | None  # the file or directory it came from; None for dummy presets
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase | None
    load_format: str  # "gguf" | "safetensors" | "dummy"
    weight_iterator: WeightIterator | None = field(default=None, repr=False)

    def iter_weights(self, dtype: torch.dtype, keep_packed: Collection[str] = frozenset()
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face tensor name, CPU tensor in dtype). Empty for dummy weights.
        keep_packed (GGUF only): names to hand over in their blocks (a PackedWeight)."""
        if self.weight_iterator is None:
            return iter(())
        if keep_packed:
            return self.weight_iterator(dtype, keep_packed=keep_packed)
        return self.weight_iterator(dtype)

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
    # Where the tokenizer is read from (the user's override, else the model's own); None:
    # the model has none.
    tokenizer_path: str | None = None

    def iter_weights(self, dtype: torch.dtype, keep_packed: Collection[str] = frozenset(),
                     total_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face tensor name, CPU tensor in dtype). Empty for dummy weights.
        keep_packed (GGUF only): names to hand over in their blocks (a PackedWeight).

        With total_bytes (the model's), a progress bar on stderr for loads that take more
        than two seconds, where stderr is a terminal.
        """
        if self.weight_iterator is None:
            return iter(())
        if keep_packed:
            weights = self.weight_iterator(dtype, keep_packed=keep_packed)
        else:
            weights = self.weight_iterator(dtype)
        return weights if total_bytes is None else _with_progress(weights, total_bytes)


def _with_progress(weights: Iterator[tuple[str, torch.Tensor]],
                   total_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    from tqdm.auto import tqdm

    with tqdm(total=total_bytes, desc="Loading weights", unit="B", unit_scale=True,
              unit_divisor=1024, delay=2, disable=None, dynamic_ncols=True) as bar:
        for name, tensor in weights:
            yield name, tensor
            # A GGUF-packed weight (layers/gguf_linear.PackedWeight) counts its blocks.
            bar.update(tensor.nbytes if isinstance(tensor, torch.Tensor) else tensor.data.nbytes)

"""PoolingParams: a request for the pooled final hidden state of its prompt (an embedding)
instead of generated tokens (vLLM's name). Passed where SamplingParams would be."""
from __future__ import annotations

from dataclasses import dataclass

# How a prompt's final hidden states (after the model's final norm) become one vector:
# the last token's (what decoder-only embedding models are trained for) or their mean.
POOLING_TYPES = ("last", "mean")


@dataclass
class PoolingParams:
    # Output dimensions; only the model's hidden size is supported (no model here is
    # trained for truncated, Matryoshka-style vectors). None: the hidden size.
    dimensions: int | None = None
    normalize: bool = True  # L2-normalized, so a dot product is the cosine similarity

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
                isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

    def check_dimensions(self, hidden_size: int, model: str) -> None:
        """A ValueError unless the vector keeps the model's own size."""
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(
                f"model {model!r} does not support dimensions={self.dimensions}: its "
                f"embeddings have {hidden_size} dimensions and it is not trained for "
                f"shortened (Matryoshka) vectors")

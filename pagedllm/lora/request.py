"""LoRARequest: which adapter a request runs under (vLLM's fields)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the name requests use (the server's `model`); lora_int_id: a unique id > 0
    (the engine's key for slots and the prefix cache); lora_path: a PEFT adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")

"""LoRAAdapters: the adapters an engine knows by name (LLM's lora_request, the server's
--lora-modules and /v1/load_lora_adapter), each checked by the worker as it is added."""
from __future__ import annotations

from typing import Any

from pagedllm.lora import LoRARequest

NOT_ENABLED = "LoRA is not enabled: start the engine with enable_lora=True (--enable-lora)"


class LoRAAdapters:
    def __init__(self, worker: Any, enabled: bool) -> None:
        self.worker, self.enabled = worker, enabled
        self.by_name: dict[str, LoRARequest] = {}

    def add(self, request: LoRARequest) -> None:
        """Register `request` (the worker reads and checks it: a ValueError naming what is
        wrong). The same request again is a no-op; a name or id already taken is an error."""
        if not self.enabled:
            raise ValueError(NOT_ENABLED)
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.by_name.get(request.lora_name)
        if known == request:
            return
        if known is not None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is already loaded (id "
                             f"{known.lora_int_id}, {known.lora_path})")
        taken = next((r for r in self.by_name.values()
                      if r.lora_int_id == request.lora_int_id), None)
        if taken is not None:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already used by adapter "
                             f"{taken.lora_name!r}")
        self.worker.add_lora(request)
        self.by_name[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        """Forget an adapter (requests already running under it finish with it); KeyError
        for an unknown name."""
        request = self.by_name.pop(name)
        self.worker.remove_lora(request.lora_int_id)
        return request

    def next_id(self) -> int:
        return max((r.lora_int_id for r in self.by_name.values()), default=0) + 1

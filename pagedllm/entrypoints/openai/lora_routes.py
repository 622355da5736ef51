"""LoRA adapters on the server, as vLLM serves them: `--enable-lora --lora-modules
name=path ...` at start, each adapter listed by /v1/models with the base model as its
`parent`, a request's `model` naming one to run under it, and POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (behind the API key) to add and drop adapters while serving."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.protocol import ErrorResponse, ModelCard
from pagedllm.entrypoints.openai.serving_engine import OpenAIError
from pagedllm.lora import LoRARequest

class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def register_modules(engine: Any, modules: list[tuple[str, str]] | None) -> None:
    """The --lora-modules into the engine (an LLMEngine); a ValueError naming a bad one."""
    for name, path in modules or []:
        engine.loras.add(LoRARequest(name, engine.loras.next_id(), path))


def model_cards(engine: AsyncLLMEngine) -> list[ModelCard]:
    """One card per adapter, its parent the model's (first) served name."""
    loras = getattr(engine.engine, "loras", None)
    return [ModelCard(id=name, root=request.lora_path, parent=engine.model_name,
                      max_model_len=engine.max_model_len)
            for name, request in (loras.by_name.items() if loras is not None else ())]


def build_router(engine: AsyncLLMEngine, check_api_key: Any) -> APIRouter:
    router = APIRouter(dependencies=[Depends(check_api_key)])
    # The success is plain text (as vLLM's); the errors are JSON in OpenAI's shape, which
    # the schema must say (FastAPI documents them in the route's text/plain otherwise).
    json_error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    errors = {400: {"model": ErrorResponse, "content": json_error,
                    "description": "LoRA not enabled, or a missing path, a rank over "
                    "--max-lora-rank, shapes not of this base model"},
              404: {"model": ErrorResponse, "content": json_error,
                    "description": "No adapter of that name"}}

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=errors)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        loras = engine.engine.loras
        if body.lora_name in loras.by_name:
            raise OpenAIError(f"The lora adapter '{body.lora_name}' has already been loaded.",
                              param="lora_name")

        def add() -> None:
            loras.add(LoRARequest(body.lora_name, loras.next_id(), body.lora_path))

        try:
            await engine.run_in_engine_thread(add)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="lora_path") from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                 responses=errors)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        loras = engine.engine.loras
        if body.lora_name not in loras.by_name:
            raise OpenAIError(f"The lora adapter '{body.lora_name}' cannot be found.", 404,
                              param="lora_name", code="model_not_found")
        await engine.run_in_engine_thread(loras.remove, body.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router

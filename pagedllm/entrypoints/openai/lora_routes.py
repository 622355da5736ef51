"""LoRA adapters on the server, as vLLM serves them: `--enable-lora --lora-modules
name=path ...` at start, each adapter listed by /v1/models with the base model as its
`parent`, a request's `model` naming one to run under it, and POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (behind the API key) to add and drop adapters while serving.

With several base models (openai/multi_model.py) a load names its base in `base_model`; an
unload without one finds the adapter by name. Invariant: every name is unique across the
server (the bases' and the adapters'), so a request's `model` picks one thing.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.protocol import ErrorResponse, ModelCard
from pagedllm.entrypoints.openai.serving_engine import OpenAIError
from pagedllm.lora import LoRARequest

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    base_model: str | None = None  # a served base model's name; needed when there are several


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None
    base_model: str | None = None


def register_modules(engine: Any, modules: list[tuple[str, str]] | None) -> None:
    """The --lora-modules into the engine (an LLMEngine); a ValueError naming a bad one."""
    for name, path in modules or []:
        engine.loras.add(LoRARequest(name, engine.loras.next_id(), path))


def lora_enabled(engine: AsyncLLMEngine) -> bool:
    loras = getattr(engine.engine, "loras", None)
    return loras is not None and loras.enabled


def base_names(engine: AsyncLLMEngine) -> list[str]:
    """Every --served-model-name of the engine (the first is the one responses carry)."""
    return list(getattr(engine.engine, "served_model_names", [engine.model_name]))


def adapter_names(engine: AsyncLLMEngine) -> list[str]:
    loras = getattr(engine.engine, "loras", None)
    return list(loras.by_name) if loras is not None else []


def model_cards(engine: AsyncLLMEngine) -> list[ModelCard]:
    """One card per adapter, its parent the model's (first) served name."""
    loras = getattr(engine.engine, "loras", None)
    return [ModelCard(id=name, root=request.lora_path, parent=engine.model_name,
                      max_model_len=engine.max_model_len)
            for name, request in (loras.by_name.items() if loras is not None else ())]


def unknown_base(base_model: str, served: list[str]) -> OpenAIError:
    return OpenAIError(f"The base model `{base_model}` does not exist; this server serves: "
                       f"{', '.join(served)}", 404, param="base_model", code="model_not_found")


def name_refusal(name: str, bases: list[str], adapters: list[str]) -> OpenAIError | None:
    """Why a new adapter may not be called `name` (the server's names must stay unique)."""
    if name in adapters:
        return OpenAIError(f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name")
    if name in bases:
        return OpenAIError(f"The lora adapter '{name}' cannot be loaded: '{name}' is the "
                           "name of a served base model.", param="lora_name")
    return None


def pick_base(path: str, body: Any, bases: list[tuple[list[str], list[str]]]
              ) -> int | OpenAIError:
    """For a load or unload on a server of several base models (each given as its served
    names and its adapters' names): the index of the base it goes to, or why none. A body
    the route itself refuses (not JSON, wrong types) goes to the first."""
    if not isinstance(body, dict):
        return 0
    base, name = body.get("base_model"), body.get("lora_name")
    if (base is not None and not isinstance(base, str)) or not isinstance(name, str):
        return 0
    served = [n for names, _ in bases for n in names]
    index = next((i for i, (names, _) in enumerate(bases) if base in names), None)
    if base is not None and index is None:
        return unknown_base(base, served)
    if path == UNLOAD:  # no base_model: the adapter's own base; none: the first's 404
        return index if index is not None else next(
            (i for i, (_, adapters) in enumerate(bases) if name in adapters), 0)
    refusal = name_refusal(name, served, [a for _, adapters in bases for a in adapters])
    if refusal is not None or index is not None:
        return refusal or index
    return OpenAIError(f"This server serves several base models ({', '.join(served)}): name "
                       "the one to load the adapter onto in `base_model`.", param="base_model")


def build_router(engine: AsyncLLMEngine, check_api_key: Any) -> APIRouter:
    router = APIRouter(dependencies=[Depends(check_api_key)])
    # The success is plain text (as vLLM's); the errors are JSON in OpenAI's shape, which
    # the schema must say (FastAPI documents them in the route's text/plain otherwise).
    json_error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    errors = {400: {"model": ErrorResponse, "content": json_error,
                    "description": "LoRA not enabled on the base model, no `base_model` with "
                    "several, a name taken, or a missing path, a rank over --max-lora-rank, "
                    "shapes not of this base model"},
              404: {"model": ErrorResponse, "content": json_error,
                    "description": "No adapter of that name, or no base model `base_model`"}}

    def check_base(base_model: str | None) -> None:
        """`base_model` (if given) is this engine's, and it serves adapters."""
        served = base_names(engine)
        if base_model is not None and base_model not in served:
            raise unknown_base(base_model, served)
        if not lora_enabled(engine):
            raise OpenAIError(f"LoRA is not enabled on the base model '{served[0]}': serve "
                              "it with --enable-lora (enable_lora in --models-config)",
                              param="base_model")

    @router.post(LOAD, response_class=PlainTextResponse, responses=errors)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        check_base(body.base_model)
        loras = engine.engine.loras
        refusal = name_refusal(body.lora_name, base_names(engine), adapter_names(engine))
        if refusal is not None:
            raise refusal

        def add() -> None:
            loras.add(LoRARequest(body.lora_name, loras.next_id(), body.lora_path))

        try:
            await engine.run_in_engine_thread(add)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="lora_path") from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post(UNLOAD, response_class=PlainTextResponse, responses=errors)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        check_base(body.base_model)
        loras = engine.engine.loras
        if body.lora_name not in loras.by_name:
            raise OpenAIError(f"The lora adapter '{body.lora_name}' cannot be found.", 404,
                              param="lora_name", code="model_not_found")
        await engine.run_in_engine_thread(loras.remove, body.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router

"""vLLM's small routes: GET /version, GET|POST /ping (open, as /health), GET /tokenizer_info
and GET /v1/models/{id} (openai's models.retrieve), both behind the API key."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai import lora_routes
from pagedllm.entrypoints.openai.protocol import ErrorResponse, ModelCard
from pagedllm.entrypoints.openai.serving_engine import OpenAIError

_NOT_FOUND = {404: {"model": ErrorResponse, "description": "Unknown model (code "
                    "`model_not_found`) / a model without a tokenizer"}}


served_names = lora_routes.base_names  # every --served-model-name


def served_and_adapter_names(engine: AsyncLLMEngine) -> list[str]:
    """The names a request's `model` may give: the model's, then its loaded adapters'."""
    return served_names(engine) + [card.id for card in lora_routes.model_cards(engine)]


def build_router(engine: AsyncLLMEngine, check_api_key: Any, keyed: bool) -> APIRouter:
    """The routes; `check_api_key` guards the two that describe the model (`keyed`: a key is
    set, so they document their 401)."""
    router = APIRouter()
    auth = [Depends(check_api_key)]
    documented = dict(_NOT_FOUND)
    if keyed:
        documented[401] = {"model": ErrorResponse, "description": "Missing or wrong API key"}

    @router.get("/version")
    async def version() -> dict[str, str]:
        from pagedllm import __version__

        return {"version": __version__}

    async def ping() -> dict[str, str]:
        # The socket listens only once the model is loaded (as /health).
        return {"status": "ok"}

    router.add_api_route("/ping", ping, methods=["GET"], operation_id="ping_get")
    router.add_api_route("/ping", ping, methods=["POST"], operation_id="ping_post")

    @router.get("/v1/models/{model_id:path}", dependencies=auth, responses=documented)
    async def retrieve_model(model_id: str) -> ModelCard:
        if model_id in served_names(engine):
            return ModelCard(id=model_id, max_model_len=engine.max_model_len)
        adapter = next((c for c in lora_routes.model_cards(engine) if c.id == model_id), None)
        if adapter is None:  # unknown, or an adapter since unloaded
            raise OpenAIError(f"The model `{model_id}` does not exist.", 404, param="model",
                              code="model_not_found")
        return adapter

    @router.get("/tokenizer_info", dependencies=auth, responses=documented)
    async def tokenizer_info() -> dict[str, Any]:
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer", 404, code="tokenizer_not_found")
        return tokenizer_description(tokenizer, engine.max_model_len)

    return router


def tokenizer_description(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """What a client needs to tokenize as the server does (vLLM's /tokenizer_info fields)."""
    special = {name: getattr(tokenizer, name, None)
               for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    added = {str(i): {"content": t.content, "special": t.special}
             for i, t in sorted(tokenizer.added_tokens_decoder.items())}
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "model_max_length": max_model_len,
        **{k: (str(v) if v is not None else None) for k, v in special.items()},
        "chat_template": getattr(tokenizer, "chat_template", None),
        "added_tokens_decoder": added,
    }

"""POST /v1/embeddings: one pooled vector per input (OpenAI's embeddings API).

Each input runs as a pooling request through the engine (PoolingParams), batched with
whatever else runs; see engine/pooling.py. The route lives in its own APIRouter, which
build_app includes behind the API key.
"""
from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field

from pagedllm.entrypoints.openai.protocol import (
    NonEmptyStr,
    OpenAIBaseModel,
    RequestBody,
    TokenId,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing, final_outputs
from pagedllm.pooling_params import PoolingParams

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    model: str | None = None
    # A string, a batch of strings, token ids, or a batch of token id lists (none empty).
    input: (
        NonEmptyStr
        | Annotated[list[TokenId], Field(min_length=1, max_length=1 << 20)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                    Field(min_length=1, max_length=MAX_INPUTS)]
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # floats, or base64 of the little-endian float32 bytes (what the openai client asks for)
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        self.check_model(request.model)
        try:
            params = PoolingParams(dimensions=request.dimensions)
            params.check_dimensions(self.engine.hidden_size,
                                    self.model_name)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="dimensions") from None
        inputs = request.input
        if isinstance(inputs, str) or isinstance(inputs[0], int):
            inputs = [inputs]
        token_ids = [await self.tokenizer.encode(x, param="input") if isinstance(x, str)
                     else x for x in inputs]
        vocab = self.engine.vocab_size
        for i, ids in enumerate(token_ids):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise OpenAIError(f"input[{i}]: token id {bad} is out of range for a "
                                  f"vocabulary of {vocab}", param="input")
        streams = await self.add_requests(token_ids, params, random_id("embd"))
        outputs = await final_outputs(streams)
        num_tokens = sum(len(ids) for ids in token_ids)
        return EmbeddingResponse(
            data=[EmbeddingData(index=i, embedding=encode(out.embedding,
                                                          request.encoding_format))
                  for i, out in enumerate(outputs)],
            model=self.model_name,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )


def embedding_router(serving: OpenAIServingEmbedding, dependencies: list[Any],
                     responses: dict[int | str, dict],
                     run: Callable[[Request, Awaitable[Any]], Awaitable[Any]]) -> APIRouter:
    """The route, behind `dependencies` (the API-key check). `responses`: its documented
    errors (OpenAPI); `run`: the server's wrapper that cancels the work when the client
    leaves and turns a surprise into a 500 of this request alone."""
    router = APIRouter(dependencies=dependencies)

    @router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=responses)
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Any:
        return await run(raw, serving.create_embedding(body))

    return router

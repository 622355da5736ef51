"""The documented shape of GET /v1/engine/state (the OpenAPI schema and docs/engine_state.md).

The route returns the engine's snapshot as it is, without validating it through these models
(that would cost more than building it); a test checks the live JSON against this schema.
"""
from __future__ import annotations

from pydantic import BaseModel, Field

from pagedllm.engine.state import BLOCK_CODES

_CODES = "; ".join(f"`{code}` {meaning}" for code, meaning in BLOCK_CODES.items())


class QueueEntry(BaseModel):
    """One sequence of a queued request (a request with n samples has n entries)."""

    request_id: str
    seq_id: int
    num_prompt_tokens: int
    num_cached_tokens: int = Field(description="prompt tokens its request found in the "
                                               "prefix cache at admission")
    num_output_tokens: int = Field(description="tokens generated so far")
    num_computed_tokens: int = Field(description="tokens whose K/V are in the cache")
    blocks: list[int] = Field(description="its block table: GPU block numbers (running), "
                                          "CPU swap block numbers (swapped), empty (waiting)")


class Queues(BaseModel):
    running: list[QueueEntry]
    waiting: list[QueueEntry]
    swapped: list[QueueEntry]


class Counters(BaseModel):
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prefix_cache_queried_blocks: int = Field(description="full prompt blocks looked up")
    prefix_cache_hit_blocks: int = Field(description="of those, found in the prefix cache")
    generation_tokens: int = Field(description="tokens generated since the server started")


class EngineState(BaseModel):
    """A snapshot of the engine between two steps; counters are totals since start."""

    time: float = Field(description="Unix time of the snapshot")
    block_size: int = Field(description="tokens per KV block")
    num_gpu_blocks: int
    num_cpu_blocks: int
    gpu_blocks: str = Field(description=f"one character per GPU block: {_CODES}")
    cpu_blocks: str = Field(description="one character per CPU swap block, the same codes")
    kv_cache_usage: float = Field(description="fraction of GPU blocks held by sequences")
    queues: Queues
    counters: Counters

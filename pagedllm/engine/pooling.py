"""Pooling requests (embeddings) in the engine: a SequenceGroup with `pooling` set runs its
prompt's forward like any prompt, and its last chunk's step hands back the pooled vector
(StepResult.pooled) instead of a sample. It then finishes at once: its blocks are freed in
that same update, so a pooling request holds KV blocks only while its prompt is computed."""
from __future__ import annotations

import torch

from pagedllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.layers.pooler import normalize
from pagedllm.outputs import RequestOutput


def finish_pooling(group: SequenceGroup, seq: Sequence, vector: torch.Tensor,
                   now: float) -> None:
    """The group's vector is in: keep it (normalized when asked) and stop the sequence."""
    if group.pooling_params.normalize:
        vector = normalize(vector)
    group.embedding = vector.tolist()
    seq.status = SequenceStatus.FINISHED_STOPPED
    group.metrics.finished_time = now


def pooling_output(group: SequenceGroup) -> RequestOutput:
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        prompt_logprobs=None,
        outputs=[],
        finished=True,
        metrics=group.metrics,
        num_cached_tokens=group.num_cached_tokens,
        embedding=group.embedding,
    )

"""Pooling requests (embeddings) in the engine: a SequenceGroup with `pooling` set runs its
prompt's forward like any prompt, and its last chunk's step hands back the pooled vector
(StepResult.pooled) instead of a sample. It then finishes at once: its blocks are freed in
that same update, so a pooling request holds KV blocks only while its prompt is computed."""
from __future__ import annotations

import numpy as np

from pagedllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus

# As torch.nn.functional.normalize's eps: a zero vector stays zero.
_NORM_EPS = 1e-12


def finish_pooling(group: SequenceGroup, seq: Sequence, vector: np.ndarray,
                   now: float) -> None:
    """The group's vector is in: keep it (L2-normalized when asked) and stop the sequence."""
    if group.pooling_params.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), _NORM_EPS)
    group.embedding = vector.tolist()
    seq.status = SequenceStatus.FINISHED_STOPPED
    group.metrics.finished_time = now

"""Test helpers for driving the scheduler by hand as the engine's update does."""
from __future__ import annotations

from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import SequenceStatus


def mark_step_computed(scheduler: Scheduler, out: SchedulerOutput, num_steps: int = 1) -> None:
    """The model ran `out` (`num_steps` times in multi-step, every chunk one decode token):
    each running sequence's tokens now have K/V in the cache, counted as the engine's
    update counts them (Scheduler.mark_computed)."""
    for scheduled in out.scheduled_seq_groups:
        for seq in scheduled.seq_group.seqs_dict.values():
            if seq.status is SequenceStatus.RUNNING:
                scheduler.mark_computed(seq, scheduled.token_chunk_size * num_steps)

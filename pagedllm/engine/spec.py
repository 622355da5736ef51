"""Speculative decoding on the engine's side: when a step speculates, and its proposals.

A speculative step needs the last step's tokens: it runs alone (one step per schedule,
nothing launched ahead). Multi-step and async scheduling stay for the steps where
speculation is off (above disable_by_batch_size running sequences). The worker scores the
proposals; the update appends the kept tokens and rolls the blocks back
(SequenceUpdater._update_seq, engine/scheduler_update.py).
"""
from __future__ import annotations

from pagedllm.config import SpeculativeConfig
from pagedllm.engine.ngram_proposer import propose_ngram
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import SequenceStatus

# Running sequences past which speculation is off by default: a large batch already keeps
# the device busy, and verifying proposals then costs more than it saves (docs/benchmarks.md).
SPEC_BATCH_LIMIT = {"cuda": 32, "cpu": 8}


class Speculator:
    def __init__(self, config: SpeculativeConfig | None, scheduler: Scheduler,
                 max_model_len: int, on_cuda: bool) -> None:
        self.config, self.scheduler, self.max_model_len = config, scheduler, max_model_len
        self.batch_limit = None if config is None else (
            config.disable_by_batch_size or SPEC_BATCH_LIMIT["cuda" if on_cuda else "cpu"])

    def enabled(self) -> bool:
        limit = self.batch_limit
        return limit is not None and \
            sum(len(g.seqs_dict) for g in self.scheduler.running) <= limit

    def propose(self, out: SchedulerOutput) -> None:
        """Proposals for the step's decode rows (n-gram: the tokens themselves; draft
        model: how many the worker's draft proposes), each with its slots reserved. None
        past max_tokens (the target's own token covers the last) or the context, none
        where the slots do not fit."""
        spec = self.config
        if out.num_steps != 1:
            return
        seqs = [(scheduled.seq_group, seq) for scheduled in out.scheduled_seq_groups
                if scheduled.token_chunk_size == 1 and scheduled.do_sample
                for seq in scheduled.seq_group.seqs_dict.values()
                if seq.status is SequenceStatus.RUNNING and seq.output_token_ids
                # a grammar's mask covers one position: constrained rows are not speculated
                and scheduled.seq_group.sampling_params.structured_outputs is None]
        for group, seq in seqs:
            length = seq.get_len()
            k = min(spec.num_speculative_tokens,
                    group.sampling_params.max_tokens - seq.get_output_len() - 1,
                    self.max_model_len - length - 1)
            if k < 1:
                continue
            if spec.method == "ngram":
                proposal = propose_ngram(seq.get_token_ids(), k, spec.prompt_lookup_min,
                                         spec.prompt_lookup_max)
                if proposal and self.scheduler.reserve_speculative(out, seq, len(proposal)):
                    out.spec_token_ids[seq.seq_id] = proposal
            elif self.scheduler.reserve_speculative(out, seq, k):
                out.num_draft_tokens[seq.seq_id] = k

"""StepBatchBuilder: a SchedulerOutput -> the plain StepBatch the worker reads.

It remembers what the worker holds of each sequence (tokens sent, the block table it last
saw) and sends only what changed: a sequence in full once, then per step its new tokens and
table growth. Forks and freed sequences are queued here and ride along with the next batch.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.contract import Fork, NewSequence, StepBatch

RUNNING = SequenceStatus.RUNNING


@dataclass(slots=True)
class _Sent:
    """What the worker holds of one sequence."""

    num_tokens: int
    # The block manager's live list the worker's table was last synced from (compared by
    # identity: the block manager gives a sequence a new list when it swaps, recomputes or
    # forks it); None: send the whole table.
    table: list[int] | None = None
    num_blocks: int = 0


class StepBatchBuilder:
    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}
        self._forks: list[Fork] = []
        self._freed: list[int] = []

    def fork(self, parent: Sequence, child: Sequence, seed: int | None) -> None:
        """`child` was forked from `parent` (sent before) after the last batch."""
        self._sent[child.seq_id] = _Sent(self._sent[parent.seq_id].num_tokens)
        self._forks.append(Fork(parent.seq_id, child.seq_id, seed))

    def free(self, seq_ids: Iterable[int]) -> None:
        """The worker may drop these sequences (finished, aborted or ignored)."""
        for seq_id in seq_ids:
            if self._sent.pop(seq_id, None) is not None:
                self._freed.append(seq_id)

    def trim(self, seq_id: int, num_blocks: int) -> None:
        """The block manager cut the table of `seq_id` to `num_blocks` (speculative
        rollback): blocks from there on are sent again when the table grows back."""
        sent = self._sent.get(seq_id)
        if sent is not None and sent.num_blocks > num_blocks:
            sent.num_blocks = num_blocks

    def build(self, out: SchedulerOutput) -> StepBatch:
        batch = StepBatch(
            forks=self._forks, freed_seq_ids=self._freed,
            blocks_to_swap_out=out.blocks_to_swap_out, blocks_to_swap_in=out.blocks_to_swap_in,
            blocks_to_copy=out.blocks_to_copy, num_steps=out.num_steps,
            spec_token_ids=out.spec_token_ids, num_draft_tokens=out.num_draft_tokens,
        )
        spec = out.spec_token_ids or out.num_draft_tokens
        self._forks, self._freed = [], []
        sent_of = self._sent
        tables = out.block_tables
        cow = out.cow_seq_ids
        pending = out.num_pending_tokens
        pending_of = out.pending_tokens
        # The batch's row lists, appended to directly: this loop runs for every sequence
        # every step.
        add_id, add_tokens = batch.seq_ids.append, batch.new_token_ids.append
        add_computed = batch.num_computed_tokens.append
        add_scheduled, add_sample = batch.num_scheduled_tokens.append, batch.do_sample.append
        for scheduled in out.scheduled_seq_groups:
            group = scheduled.seq_group
            seqs = group.seqs_dict
            chunk, do_sample = scheduled.token_chunk_size, scheduled.do_sample
            for seq in seqs.values():
                if seq.status is not RUNNING:
                    continue
                seq_id = seq.seq_id
                sent = sent_of.get(seq_id)
                prompt_len = len(seq.prompt_token_ids)
                if sent is None:
                    params = group.sampling_params
                    batch.new_seqs.append(NewSequence(seq_id, seq.prompt_token_ids, params,
                                                      params.seed, group.pooling))
                    sent = sent_of[seq_id] = _Sent(prompt_len)
                num_tokens = prompt_len + len(seq.output_token_ids)
                new_tokens = []
                if num_tokens > sent.num_tokens:
                    new_tokens = seq.output_token_ids[sent.num_tokens - prompt_len:]
                    sent.num_tokens = num_tokens
                table, rewritten = tables[seq_id], bool(cow) and seq_id in cow
                if table is not sent.table or rewritten or len(table) != sent.num_blocks:
                    _send_table(batch, seq_id, sent, table, rewritten)
                add_id(seq_id)
                add_tokens(new_tokens)
                add_computed(seq.num_computed_tokens + (
                    pending if pending_of is None else pending_of.get(seq_id, 0)))
                if spec and seq_id in spec:
                    proposals = out.spec_token_ids.get(seq_id)
                    add_scheduled(chunk + (len(proposals) if proposals is not None
                                           else out.num_draft_tokens[seq_id]))
                else:
                    add_scheduled(chunk)
                add_sample(do_sample)
                if do_sample and len(seqs) == 1 and not seq.output_token_ids \
                        and group.max_num_samples > 1:
                    batch.num_samples[seq_id] = group.max_num_samples
        return batch


def _send_table(batch: StepBatch, seq_id: int, sent: _Sent, table: list[int], cow: bool) -> None:
    """The change of `seq_id`'s block table since the worker last saw it, into `batch`: the
    whole table when the block manager gave the sequence a new list or a copy-on-write
    changed it in place, else the blocks it grew by (or the length it was trimmed to)."""
    if table is not sent.table or cow:
        batch.block_tables[seq_id] = (0, list(table))
        sent.table, sent.num_blocks = table, len(table)
    else:  # grown (or trimmed: truncates)
        batch.block_tables[seq_id] = (min(sent.num_blocks, len(table)), table[sent.num_blocks:])
        sent.num_blocks = len(table)

"""Scheduler: which sequences run each step, and how many tokens each computes.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: a running sequence
has `num_computed_tokens`, and a step gives it tokens toward `get_len()` under a token budget.
Order of each step: running groups (FCFS), preempting the newest when blocks run out; then
swapped groups; then waiting groups, both only when nothing was preempted this step.

The cache engine must apply `blocks_to_swap_out`, then `blocks_to_swap_in`, then
`blocks_to_copy`, all before the step's forward: a block freed by a swap-out may be handed
to another sequence in the same step.

With hundreds of decoding sequences this loop is on the critical path between two forwards,
so a step visits each running group once, reads `seqs_dict` directly instead of building
status-filtered lists, counts running sequences only when a queue could admit more, and
hands out the block manager's live block-number lists instead of copies.

Decode windows: when every running request is a plain decode, a step may run several decode
steps back to back (multi-step, lookahead slots reserved ahead). With async scheduling the
next step is scheduled while the current one still runs (`schedule_continuation`): the next
decode window, or after a step with prompt chunks the next chunks, the pending samples'
decodes and new admissions.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.block_manager import AllocStatus, BlockSpaceManager
from pagedllm.engine.sequence import FINISHED_STATUSES, Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from pagedllm.contract import StepResult
    from pagedllm.engine.lora_slots import LoRASlots

RUNNING = SequenceStatus.RUNNING


@dataclass(slots=True)
class ScheduledSequenceGroup:
    seq_group: SequenceGroup
    # New tokens for EACH running sequence of the group this step.
    token_chunk_size: int
    # The chunk reaches the last known token, so the step samples a new one.
    do_sample: bool


@dataclass
class SchedulerOutput:
    scheduled_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on gpu
    # seq_id -> block numbers of every scheduled running sequence. These are the block
    # manager's live lists, not copies: they are exact from the end of schedule() until the
    # next schedule() (or swap, abort, free) changes them. Read them during the step; copy
    # anything that must outlive it; never write them.
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    # Sequences whose block table a copy-on-write changed in place this step.
    cow_seq_ids: list[int] = field(default_factory=list)
    # Finished with FINISHED_IGNORED this step: they can never fit in the KV cache.
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    num_preempted: int = 0
    # Multi-step: the decode steps run back to back (>1 only for a plain decode of every
    # running request, with lookahead slots reserved).
    num_steps: int = 1
    # Async scheduling: tokens every scheduled sequence has sampled on the device in a step
    # still running, not yet appended; this step's input starts after them.
    num_pending_tokens: int = 0
    # Async scheduling after a step with prompt chunks: seq_id -> the tokens that step
    # computes of it (its chunk), not yet counted in num_computed_tokens; a sequence not
    # in it (admitted by this step) has none. Replaces num_pending_tokens where set.
    pending_tokens: dict[int, int] | None = None
    # Speculative decoding (see `reserve_speculative`): seq_id -> proposed tokens (n-gram),
    # or seq_id -> tokens the worker's draft model proposes.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    num_draft_tokens: dict[int, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (
            self.scheduled_seq_groups
            or self.blocks_to_swap_in
            or self.blocks_to_swap_out
            or self.blocks_to_copy
        )


@dataclass
class SchedulerStats:
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        updater=None,
        lora_slots: LoRASlots | None = None,
    ) -> None:
        """`updater`: a SequenceUpdater (engine/scheduler_update.py, which imports this
        module, hence no annotation), the engine's pieces a step's tokens reach; without one
        (a scheduler alone, in tests and benchmarks) it schedules but cannot
        `update_from_output`. `lora_slots`: with LoRA, a group is admitted only once its
        adapter has a slot (engine/lora_slots.py)."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.block_manager = BlockSpaceManager(
            cache_config.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.stats = SchedulerStats()
        self._groups: dict[str, SequenceGroup] = {}  # request_id -> group
        self._group_of_seq: dict[int, SequenceGroup] = {}
        self.lora_slots = lora_slots
        self.updater = updater
        if updater is not None:
            updater.bind(self)

    # ---- requests --------------------------------------------------------------------------

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        if seq_group.request_id in self._groups:
            raise ValueError(f"request id {seq_group.request_id!r} is already scheduled")
        seqs = seq_group.get_seqs()
        if len(seqs) != 1 or seqs[0].status != SequenceStatus.WAITING:
            raise ValueError(
                "a new request must hold exactly one waiting sequence "
                "(samples beyond the first are forked after the first step)"
            )
        if seqs[0].get_prompt_len() == 0:
            raise ValueError(f"request {seq_group.request_id!r} has an empty prompt")
        cfg = self.scheduler_config
        limit = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        if seq_group.max_num_samples > limit:
            raise ValueError(
                f"request {seq_group.request_id!r} needs {seq_group.max_num_samples} sequences "
                f"(n/best_of) but a step holds at most {limit} (max_num_seqs="
                f"{cfg.max_num_seqs}, max_num_batched_tokens={cfg.max_num_batched_tokens})"
            )
        self._groups[seq_group.request_id] = seq_group
        self._group_of_seq[seqs[0].seq_id] = seq_group
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> None:
        """Finish the given requests as aborted and free their blocks; unknown ids are skipped."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for queue in (self.waiting, self.running, self.swapped):
            aborted = [g for g in queue if g.request_id in ids]
            for group in aborted:
                queue.remove(group)
                for seq in group.get_seqs():
                    if not seq.is_finished():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self.block_manager.free(seq)
                self._forget(group)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Add `child` (forked from the running `parent`) to its group, sharing its blocks."""
        group = self._group_of_seq.get(parent.seq_id)
        if group is None or parent.status != SequenceStatus.RUNNING:
            raise ValueError(f"sequence {parent.seq_id} is not running in the scheduler")
        if child.seq_id in self._group_of_seq:
            raise ValueError(f"sequence id {child.seq_id} is already in use")
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        group.add(child)
        self._group_of_seq[child.seq_id] = group

    def update_from_output(self, out: SchedulerOutput, result: StepResult):
        """A step's samples into its sequences, the one place: append, mark computed, the
        token-level stops, free the finished. Returns the StepUpdate the output processor
        reads (engine/scheduler_update.py)."""
        if self.updater is None:
            raise ValueError("this scheduler was made without an updater: it schedules but "
                             "cannot update from a step's output")
        return self.updater.update(out, result)

    def finish_on_stop_string(self, seq: Sequence, stop: str, output_len: int,
                              update) -> None:
        """The output processor found `stop` completed by `seq`'s `output_len`-th output
        token: the sequence stops there (later tokens of the step dropped) and is freed."""
        self.updater.finish_on_stop_string(seq, stop, output_len, update)

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> list[SequenceGroup]:
        """Free the blocks of finished sequences; drop and return finished groups."""
        finished = []
        free = self.block_manager.free
        for group in self.running:
            group_finished = True
            for seq in group.seqs_dict.values():
                status = seq.status
                # `is not RUNNING` first: hashing an Enum member runs Python code.
                if status is not RUNNING and status in FINISHED_STATUSES:
                    free(seq)
                else:
                    group_finished = False
            if group_finished:
                finished.append(group)
        if finished:
            finished_ids = {id(g) for g in finished}
            self.running = deque(g for g in self.running if id(g) not in finished_ids)
            for group in finished:
                self._forget(group)
        return finished

    def _forget(self, group: SequenceGroup) -> None:
        self._groups.pop(group.request_id, None)
        for seq in group.get_seqs():
            self._group_of_seq.pop(seq.seq_id, None)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self, max_num_steps: int = 1, structured_ok: bool = False) -> SchedulerOutput:
        """The next step. With `max_num_steps > 1` it may be a multi-step decode window
        (`out.num_steps`, see `_decode_window_size`); `structured_ok`: also when sequences
        with structured outputs run (the engine fills each step's masks as it samples)."""
        num_steps = self._decode_window_size(max_num_steps, structured_ok) \
            if max_num_steps > 1 else 1
        out = SchedulerOutput()
        # Swapped and waiting groups only need the running-sequence count; with both queues
        # empty (steady decoding) it is never computed. Preemption only adds to them in
        # steps that then admit nothing, so this test is exact.
        count_slots = bool(self.swapped or self.waiting)
        num_seqs = self._schedule_running(out, count_slots)
        if out.num_preempted == 0 and self.swapped:
            num_seqs = self._schedule_swapped(out, num_seqs)
        if out.num_preempted == 0 and not self.swapped and self.waiting:
            self._schedule_waiting(out, num_seqs)
        if num_steps > 1 and self._is_whole_decode(out) and self.reserve_lookahead(
                out, num_steps - 1):
            out.num_steps = num_steps
        return out

    def schedule_continuation(self, prev: SchedulerOutput, max_num_steps: int,
                              structured_ok: bool = False) -> SchedulerOutput | None:
        """Async scheduling: the step after `prev` while `prev` still runs, assuming each of
        its sequences gets its `prev.num_steps` tokens. After a one-step `prev` with prompt
        chunks, or while a waiting request could start, that is `_continue_mixed`'s step.
        Otherwise a decode window that needs nothing of those tokens but their count:
        `prev` decoded every running request (one sequence each, sampling that reads
        nothing of its own output), nothing is swapped out, and the lookahead slots fit
        (then they are reserved). Sequences that surely finish by length in `prev` are left
        out; one that stops on a token or string costs one wasted step. None when the next
        step must wait for `prev`'s samples. `structured_ok`: sequences with structured
        outputs may go on in a window (the engine fills their first masks once `prev`'s
        samples are in)."""
        cfg = self.scheduler_config
        if self.swapped:
            return None
        admits = bool(self.waiting) and len(self.running) < cfg.max_num_seqs
        # A window of several steps decodes every row (`_is_whole_decode`, or a window
        # continued): only a one-step `prev` may hold prompt chunks.
        if prev.num_steps == 1 and (admits or not all(
                s.token_chunk_size == 1 and s.do_sample for s in prev.scheduled_seq_groups)):
            return self._continue_mixed(prev)
        if admits:
            return None
        k = prev.num_steps
        max_len = cfg.max_model_len
        seqs: list[Sequence] = []
        groups: list[SequenceGroup] = []
        live = self._live_rows(prev)
        if live is None:
            return None
        num_steps = max_num_steps
        longest = 1  # the most tokens any sequence may still take
        for scheduled, seq in live:
            group = scheduled.seq_group
            if self._reads_own_output(group) or self._one_step_at_a_time(group, structured_ok):
                return None
            if self._finishes_by_length(group, seq, k):
                continue
            max_tokens = group.sampling_params.max_tokens
            room = max_len - (seq.get_len() + k) + 1
            if room < num_steps:
                num_steps = room
            longest = max(longest, _tokens_left(seq, max_tokens, k))
            seqs.append(seq)
            groups.append(group)
        # Every running request is one of `prev`'s, so none waits behind the continuation.
        if not seqs or len(live) != len(self.running):
            return None
        num_steps = min(num_steps, longest)
        if not self._reserve_lookahead(seqs, k + num_steps - 1):
            return None
        out = SchedulerOutput(num_steps=num_steps, num_pending_tokens=k,
                              num_batched_tokens=len(seqs))
        tables = self.block_manager.block_number_tables
        for group, seq in zip(groups, seqs):
            out.scheduled_seq_groups.append(ScheduledSequenceGroup(group, 1, True))
            out.block_tables[seq.seq_id] = tables[seq.seq_id]
        return out

    def _continue_mixed(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling after a one-step `prev` with prompt chunks, or while requests
        wait: the step after it, as `schedule` would make it once `prev`'s samples are in.
        Each of `prev`'s sequences goes on where `prev` leaves it, in `prev`'s (FCFS)
        order under the token budget: one that samples in `prev` decodes that pending
        sample, one in the middle of its prompt takes its next chunk; then waiting requests
        are admitted. Only what needs nothing of `prev`'s samples but their count: every
        running request is one of `prev`'s, one sequence each, none reading its own output
        or constrained by a grammar; the prompt chunks need no block (a prompt's blocks
        come at admission) and the decode slots fit (then they are reserved); nothing is
        preempted. None otherwise. A sequence that stops on a token in `prev` costs one
        wasted token here."""
        cfg = self.scheduler_config
        out = SchedulerOutput(pending_tokens={})
        decodes: list[Sequence] = []
        rows: list[tuple[SequenceGroup, Sequence, int, bool]] = []
        budget = cfg.max_num_batched_tokens
        live = self._live_rows(prev)
        if live is None:
            return None
        for scheduled, seq in live:
            group = scheduled.seq_group
            if not self._continues(group):
                return None
            done = seq.num_computed_tokens + scheduled.token_chunk_size  # once `prev` ran
            if scheduled.do_sample:
                if self._finishes_by_length(group, seq, 1):
                    continue
                chunk, do_sample = min(1, budget), True
            else:
                if self.block_manager.num_blocks_to_append([seq]):
                    return None
                chunk = min(seq.get_len() - done, budget)
                do_sample = done + chunk == seq.get_len()
            if chunk <= 0:
                continue  # out of budget: `schedule` takes it up after this step
            budget -= chunk
            if scheduled.do_sample:
                decodes.append(seq)
            rows.append((group, seq, chunk, do_sample))
            out.pending_tokens[seq.seq_id] = scheduled.token_chunk_size
        if len(live) != len(self.running) or not self._reserve_lookahead(decodes, 1):
            return None
        tables = self.block_manager.block_number_tables
        for group, seq, chunk, do_sample in rows:
            out.scheduled_seq_groups.append(ScheduledSequenceGroup(group, chunk, do_sample))
            out.block_tables[seq.seq_id] = tables[seq.seq_id]
        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        if self.waiting:
            self._schedule_waiting(out, len(self.running), admit=self._continues)
        return out if out.scheduled_seq_groups or out.ignored_seq_groups else None

    @staticmethod
    def _live_rows(prev: SchedulerOutput) -> list[tuple[ScheduledSequenceGroup, Sequence]] | None:
        """`prev`'s groups still running (not aborted since), each with its one sequence;
        None when a group has several (its forks: the step after must see their samples)."""
        live = []
        for scheduled in prev.scheduled_seq_groups:
            seqs = scheduled.seq_group.seqs_dict
            if len(seqs) != 1:
                return None
            (seq,) = seqs.values()
            if seq.status is RUNNING:
                live.append((scheduled, seq))
        return live

    def _finishes_by_length(self, group: SequenceGroup, seq: Sequence, num_tokens: int) -> bool:
        """`seq` reaches max_tokens or max_model_len with `num_tokens` more tokens."""
        max_tokens = group.sampling_params.max_tokens
        return (max_tokens is not None and seq.get_output_len() + num_tokens >= max_tokens) \
            or seq.get_len() + num_tokens >= self.scheduler_config.max_model_len

    @staticmethod
    def _continues(group: SequenceGroup) -> bool:
        """A request `_continue_mixed` may carry on, and so admit: one sequence that
        neither reads its own output (nor forks) nor samples under a grammar."""
        return len(group.seqs_dict) == 1 and not Scheduler._reads_own_output(group) \
            and group.sampling_params.structured_outputs is None

    @staticmethod
    def _reads_own_output(group: SequenceGroup) -> bool:
        """Sampling that needs this sequence's latest tokens on the host before its step is
        launched (penalties) or forks it (best_of/n at a first sample); a pooling request
        (no sample at all: it finishes in the update of its prompt's last chunk)."""
        p = group.sampling_params
        return group.max_num_samples != 1 or p.has_penalties or group.pooling is not None

    @staticmethod
    def _one_step_at_a_time(group: SequenceGroup, structured_ok: bool) -> bool:
        """A grammar mask needs the token before it: without `structured_ok` (a worker that
        takes masks only at launch) constrained sequences decode one step per schedule."""
        return group.sampling_params.structured_outputs is not None and not structured_ok

    def _decode_window_size(self, max_num_steps: int, structured_ok: bool) -> int:
        """Decode steps the next step may run back to back: 1 unless every running request
        is decoding one sequence that may run several steps (`_reads_own_output`,
        `_one_step_at_a_time`), none is swapped out, and
        no waiting request could start now (the batch is full). Capped so no sequence
        passes max_model_len, and by the most tokens any sequence may still take (a window
        past every row's max_tokens would run sub-steps whose samples are all dropped)."""
        cfg = self.scheduler_config
        if self.swapped or not self.running:
            return 1
        if self.waiting and len(self.running) < cfg.max_num_seqs:
            return 1
        num_steps = max_num_steps
        longest = 1  # the most tokens any sequence may still take
        max_len = cfg.max_model_len
        for group in self.running:
            if len(group.seqs_dict) != 1:
                return 1
            (seq,) = group.seqs_dict.values()
            if seq.num_uncomputed_tokens != 1 or self._reads_own_output(group) or \
                    self._one_step_at_a_time(group, structured_ok):
                return 1
            room = max_len - seq.get_len() + 1
            if room < num_steps:
                num_steps = room
            longest = max(longest, _tokens_left(seq, group.sampling_params.max_tokens, 0))
        return max(min(num_steps, longest), 1)

    def _is_whole_decode(self, out: SchedulerOutput) -> bool:
        """`out` is the plain decode of every running request: nothing preempted, copied,
        swapped or ignored, one sampled token each."""
        return (
            not out.ignored_seq_groups and out.num_preempted == 0 and not out.blocks_to_copy
            and not out.blocks_to_swap_in and not out.blocks_to_swap_out
            and len(out.scheduled_seq_groups) == len(self.running)
            and all(s.token_chunk_size == 1 and s.do_sample for s in out.scheduled_seq_groups)
        )

    def reserve_lookahead(self, out: SchedulerOutput, num_tokens: int) -> bool:
        """Multi-step: blocks for `num_tokens` more tokens of every scheduled sequence, past
        the one this step computes. False, reserving nothing, when they do not all fit."""
        return self._reserve_lookahead(
            [seq for scheduled in out.scheduled_seq_groups
             for seq in scheduled.seq_group.seqs_dict.values() if seq.status is RUNNING],
            num_tokens)

    def _reserve_lookahead(self, seqs: list[Sequence], num_tokens: int) -> bool:
        bm = self.block_manager
        needed = sum(bm.num_lookahead_blocks(seq, num_tokens) for seq in seqs)
        if needed > bm.get_num_free_gpu_blocks():
            return False
        for seq in seqs:
            bm.reserve_lookahead(seq, num_tokens)
        return True

    def reserve_speculative(self, out: SchedulerOutput, seq: Sequence,
                            num_tokens: int) -> bool:
        """Speculative decoding: slots for `num_tokens` proposals after the last token of
        `seq`, a decode row of `out`, so its step computes 1 + num_tokens tokens. Only when
        the step's token budget and the free blocks allow it (speculation never preempts);
        False, reserving nothing, otherwise. Blocks past the tokens the step accepts go
        back with `BlockSpaceManager.trim`."""
        bm = self.block_manager
        if num_tokens > self._budget_left(out) or seq.get_len() + num_tokens > \
                self.scheduler_config.max_model_len:
            return False
        if bm.num_lookahead_blocks(seq, num_tokens) > bm.get_num_free_gpu_blocks():
            return False
        bm.reserve_lookahead(seq, num_tokens)
        out.num_batched_tokens += num_tokens
        return True

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` more tokens of `seq` have K/V in the cache (their ids are known):
        full blocks among them enter the prefix cache."""
        seq.num_computed_tokens += num_tokens
        self.block_manager.mark_blocks_computed(seq)

    def _budget_left(self, out: SchedulerOutput) -> int:
        return self.scheduler_config.max_num_batched_tokens - out.num_batched_tokens

    def _chunk_size(self, seqs: list[Sequence], budget: int) -> int:
        """Tokens per sequence this step (0: does not fit the budget now)."""
        # Hot path (every running group, every step): no min()/max() calls, one get_len().
        first = seqs[0]
        remaining = first.get_len() - first.num_computed_tokens
        num_seqs = len(seqs)
        if num_seqs == 1:
            if remaining <= budget:
                return remaining
            chunk = budget
        else:
            if any(s.num_uncomputed_tokens != remaining for s in seqs):
                raise RuntimeError(
                    f"sequences {[s.seq_id for s in seqs]} of one group are out of step"
                )
            chunk = budget // num_seqs
            if chunk >= remaining:
                return remaining
        if not self.scheduler_config.enable_chunked_prefill or chunk < 0:
            return 0
        return chunk

    def _add_scheduled(
        self,
        out: SchedulerOutput,
        group: SequenceGroup,
        seqs: list[Sequence],
        chunk: int,
        append_slots: bool = True,
    ) -> None:
        """Schedule `chunk` tokens of each of `seqs`; `append_slots=False` when the block
        manager said they need no new block (then appending would do nothing)."""
        bm = self.block_manager
        tables = out.block_tables
        for seq in seqs:
            if append_slots:
                copies = bm.append_slots(seq, chunk)
                if copies:
                    out.blocks_to_copy += copies
                    out.cow_seq_ids.append(seq.seq_id)
            tables[seq.seq_id] = bm.block_number_tables[seq.seq_id]  # the live list
        do_sample = seqs[0].num_computed_tokens + chunk == seqs[0].get_len()
        out.scheduled_seq_groups.append(ScheduledSequenceGroup(group, chunk, do_sample))
        out.num_batched_tokens += chunk * len(seqs)
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = time.monotonic()

    @staticmethod
    def _seq_slots(group: SequenceGroup) -> int:
        """Sequences the group runs once forked: a best_of request reserves all its samples."""
        num_finished = 0
        for seq in group.seqs_dict.values():
            if seq.status is not RUNNING and seq.status in FINISHED_STATUSES:
                num_finished += 1
        num_active = len(group.seqs_dict) - num_finished
        reserved = group.max_num_samples - num_finished
        return reserved if reserved > num_active else num_active

    def _schedule_running(self, out: SchedulerOutput, count_slots: bool) -> int:
        """Schedule the running groups. With `count_slots`, returns the sum of `_seq_slots`
        over the groups left running, counted as each is kept (else 0)."""
        kept: deque[SequenceGroup] = deque()
        num_slots = 0
        max_tokens = self.scheduler_config.max_num_batched_tokens
        num_blocks_to_append = self.block_manager.num_blocks_to_append
        running = self.running
        while running:
            group = running.popleft()
            seqs = list(group.seqs_dict.values())
            if len(seqs) > 1 or seqs and seqs[0].status is not RUNNING:
                seqs = [s for s in seqs if s.status is RUNNING]
            chunk = self._chunk_size(seqs, max_tokens - out.num_batched_tokens) if seqs else 0
            if chunk:
                needed = num_blocks_to_append(seqs)
                if needed and not self._make_room(group, seqs, bool(kept), out):
                    continue  # `group` itself was preempted or ignored
                self._add_scheduled(out, group, seqs, chunk, append_slots=needed > 0)
            kept.append(group)
            if count_slots:
                num_slots += self._seq_slots(group)
        self.running = kept
        return num_slots

    def _make_room(
        self, group: SequenceGroup, seqs: list[Sequence], others_kept: bool, out: SchedulerOutput
    ) -> bool:
        """Preempt the newest running groups until `seqs` can grow; False when `group` itself
        had to go instead (preempted, or ignored when it is alone and still does not fit)."""
        bm = self.block_manager
        while bm.num_blocks_to_append(seqs) > bm.get_num_free_gpu_blocks():
            if self.running:
                self._preempt(self.running.pop(), out)
                continue
            if others_kept:
                self._preempt(group, out)
            else:
                self._ignore(group, out)
            return False
        return True

    def _schedule_swapped(self, out: SchedulerOutput, num_seqs: int) -> int:
        """Swap groups back in while they fit; returns the running sequence slots after."""
        max_seqs = self.scheduler_config.max_num_seqs
        while self.swapped:
            group = self.swapped[0]
            status = self.block_manager.can_swap_in(group)
            if status == AllocStatus.NEVER:
                self.swapped.popleft()
                self._ignore(group, out)
                continue
            if status == AllocStatus.LATER:
                break
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            chunk = self._chunk_size(seqs, self._budget_left(out))
            slots = self._seq_slots(group)
            if chunk == 0 or num_seqs + slots > max_seqs or not self._lora_ready(group):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += self.block_manager.swap_in(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            num_seqs += slots
            self._add_scheduled(out, group, seqs, chunk)
        return num_seqs

    def _schedule_waiting(self, out: SchedulerOutput, num_seqs: int,
                          admit: Callable[[SequenceGroup], bool] | None = None) -> None:
        """Admit waiting groups in order while they fit; `admit`: stop at the first group
        it refuses (a continuation's)."""
        max_seqs = self.scheduler_config.max_num_seqs
        max_len = self.scheduler_config.max_model_len
        while self.waiting:
            group = self.waiting[0]
            if admit is not None and not admit(group):
                break
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            if seq.get_prompt_len() > max_len:
                self.waiting.popleft()
                self._ignore(group, out)
                continue
            status = self.block_manager.can_allocate(group)
            if status == AllocStatus.NEVER:
                self.waiting.popleft()
                self._ignore(group, out)
                continue
            slots = self._seq_slots(group)
            if status == AllocStatus.LATER or num_seqs + slots > max_seqs:
                break
            budget = self._budget_left(out)
            if budget <= 0:
                break
            if not self.scheduler_config.enable_chunked_prefill and seq.get_len() > budget:
                break
            if not self._lora_ready(group):
                break  # every adapter slot is in use by running groups: wait for one
            self.waiting.popleft()
            self.block_manager.allocate(group)
            seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            num_seqs += slots
            self._add_scheduled(out, group, [seq], self._chunk_size([seq], budget))

    def _lora_ready(self, group: SequenceGroup) -> bool:
        return self.lora_slots is None or self.lora_slots.acquire(group, self.running)

    # ---- preemption ------------------------------------------------------------------------

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        for seq in group.get_seqs():
            if seq.is_finished():
                self.block_manager.free(seq)
        running = group.get_seqs(SequenceStatus.RUNNING)
        if not running:  # finished, its blocks just freed: nothing left to preempt
            self._forget(group)
            return
        swap = len(running) > 1 or self.scheduler_config.preemption_mode == "swap"
        if swap and not self.block_manager.can_swap_out(group):
            if len(running) > 1:
                # Forks cannot be recomputed and there is no swap space left for them.
                self._ignore(group, out)
                return
            swap = False
        out.num_preempted += 1
        if swap:
            out.blocks_to_swap_out += self.block_manager.swap_out(group)
            for seq in running:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(group)
            self.stats.num_preemptions_swap += 1
        else:
            for seq in running:
                self.block_manager.free(seq)
                seq.reset_for_recompute()
            self.waiting.appendleft(group)
            self.stats.num_preemptions_recompute += 1

    def _ignore(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Finish a request that can never fit in the KV cache."""
        for seq in group.get_seqs():
            if not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_IGNORED
            self.block_manager.free(seq)
        out.ignored_seq_groups.append(group)
        self._forget(group)

    # ---- metrics ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions_recompute + self.stats.num_preemptions_swap

    @property
    def gpu_cache_usage(self) -> float:
        return self.block_manager.gpu_usage()

    @property
    def cpu_cache_usage(self) -> float:
        return self.block_manager.cpu_usage()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.block_manager.prefix_cache_hit_rate()


def _tokens_left(seq: Sequence, max_tokens: int | None, pending: int) -> int:
    """Output tokens `seq` may still take, `pending` more assumed (None: no limit known)."""
    if max_tokens is None:
        return 1 << 30
    return max_tokens - seq.get_output_len() - pending

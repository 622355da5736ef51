"""Property test: random requests, steps, multi-step decodes (lookahead slots), speculative
steps (proposal slots reserved, a random number kept, the rest rolled back), forks and
aborts on tiny KV pools never lose a block.

A hypothesis state machine plays the engine around Scheduler + BlockSpaceManager; after every
action the block pools and tables must agree, and once every request is done (run to
completion or aborted) every block must be free again.
"""
from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.config import CacheConfig, SchedulerConfig
from tests.scheduler_helpers import mark_step_computed
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.sampling_params import SamplingParams

MAX_TOKENS = 6
MAX_PROMPT = 16
# Small vocabulary: prompts often share prefixes, so the prefix cache gets hits.
tokens = st.integers(0, 2)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_gpu_blocks=st.integers(1, 16),
        num_cpu_blocks=st.integers(0, 8),
        preemption_mode=st.sampled_from(["recompute", "swap"]),
        caching=st.booleans(),
        budget=st.integers(3, 24),
        max_num_seqs=st.integers(3, 6),
    )
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, preemption_mode, caching,
              budget, max_num_seqs):
        self.block_size = block_size
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=MAX_PROMPT + MAX_TOKENS,
                preemption_mode=preemption_mode,
            ),
            CacheConfig(block_size=block_size, enable_prefix_caching=caching),
            num_gpu_blocks,
            num_cpu_blocks,
        )
        self.bm = self.scheduler.block_manager
        self.ids = itertools.count()
        self.groups: dict[str, SequenceGroup] = {}

    # ---- the engine's side -----------------------------------------------------------------

    @rule(prompt=st.lists(tokens, min_size=1, max_size=MAX_PROMPT),
          best_of=st.sampled_from([1, 1, 1, 2, 3]))  # mostly single: multi-step needs them
    def add_request(self, prompt, best_of):
        seq = Sequence(next(self.ids), prompt, self.block_size)
        group = SequenceGroup(f"r{seq.seq_id}", [seq], SamplingParams(n=1, best_of=best_of))
        self.scheduler.add_seq_group(group)
        self.groups[group.request_id] = group

    @rule(data=st.data())
    def step(self, data):
        self._step(lambda: data.draw(tokens), lambda: data.draw(st.integers(0, 4)) == 0)

    @precondition(lambda self: self.scheduler.has_unfinished_seqs())
    @rule(data=st.data())
    def abort(self, data):
        live = [g.request_id for q in (self.scheduler.waiting, self.scheduler.running,
                                       self.scheduler.swapped) for g in q]
        request_id = data.draw(st.sampled_from(live))
        self.scheduler.abort_seq_group(request_id)
        assert all(s.is_finished() for s in self.groups[request_id].get_seqs())

    @rule(data=st.data(), num_steps=st.integers(2, 5))
    def multi_step(self, data, num_steps):
        """The engine's multi-step decode: lookahead slots for a plain decode schedule, then
        up to `num_steps` tokens per sequence (fewer where one stops), then the count."""
        out = self.scheduler.schedule()
        self._check_output(out)
        plain = bool(out.scheduled_seq_groups) and out.num_preempted == 0 and not (
            out.blocks_to_copy or out.blocks_to_swap_in or out.blocks_to_swap_out) and all(
            s.token_chunk_size == 1 and s.do_sample and len(s.seq_group.seqs_dict) == 1
            and s.seq_group.max_num_samples == 1 for s in out.scheduled_seq_groups)
        if not (plain and self.scheduler.reserve_lookahead(out, num_steps - 1)):
            self._step(lambda: data.draw(tokens), lambda: False, out)
            return
        for scheduled in out.scheduled_seq_groups:
            (seq,) = scheduled.seq_group.seqs_dict.values()
            covered = len(out.block_tables[seq.seq_id]) * self.block_size
            assert covered >= seq.get_len() + num_steps - 1
            for _ in range(num_steps):
                seq.append_token(data.draw(tokens))
                if seq.get_output_len() >= MAX_TOKENS or data.draw(st.integers(0, 4)) == 0:
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    self.scheduler.free_seq(seq)
                    break
        mark_step_computed(self.scheduler, out, num_steps)
        self.scheduler.free_finished_seq_groups()

    @rule(data=st.data(), k=st.integers(1, 4))
    def speculative_step(self, data, k):
        """The engine's speculative step: up to k proposals' slots reserved for decode rows
        (where budget and blocks allow), then each such row keeps 1..n+1 tokens (fewer where
        it stops) and gives the blocks past its tokens back (BlockSpaceManager.trim)."""
        out = self.scheduler.schedule()
        self._check_output(out)
        spec: dict[int, int] = {}
        for scheduled in out.scheduled_seq_groups:
            if scheduled.token_chunk_size != 1 or not scheduled.do_sample:
                continue
            for seq in scheduled.seq_group.get_seqs(SequenceStatus.RUNNING):
                n = data.draw(st.integers(0, k))
                if seq.get_output_len() and n and self.scheduler.reserve_speculative(out, seq, n):
                    spec[seq.seq_id] = n
                    assert len(out.block_tables[seq.seq_id]) * self.block_size >= \
                        seq.get_len() + n
        assert out.num_batched_tokens <= self.budget
        stopping = {seq_id: data.draw(st.integers(0, 4)) == 0 for seq_id in spec}
        self._step(lambda: data.draw(tokens), lambda: False, out)
        for group in self.groups.values():
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                if seq.seq_id not in spec:
                    continue
                for _ in range(data.draw(st.integers(0, spec[seq.seq_id]))):
                    self.scheduler.mark_computed(seq, 1)  # the accepted proposal's K/V
                    seq.append_token(data.draw(tokens))
                    if seq.get_output_len() >= MAX_TOKENS or stopping[seq.seq_id]:
                        seq.status = SequenceStatus.FINISHED_STOPPED
                        self.scheduler.free_seq(seq)
                        break
                if seq.status == SequenceStatus.RUNNING:
                    self.bm.trim(seq)
                    table = self.bm.block_tables[seq.seq_id]
                    assert len(table) <= -(-seq.get_len() // self.block_size)
                    assert len(table) * self.block_size >= seq.num_computed_tokens
                    assert seq.num_computed_tokens == seq.get_len() - 1
        self.scheduler.free_finished_seq_groups()

    def _step(self, next_token, stop_now, out: SchedulerOutput | None = None) -> SchedulerOutput:
        if out is None:
            out = self.scheduler.schedule()
            self._check_output(out)
        mark_step_computed(self.scheduler, out)
        for scheduled in out.scheduled_seq_groups:
            if not scheduled.do_sample:
                continue
            group = scheduled.seq_group
            first_sample = group.num_seqs() == 1 and group.get_seqs()[0].get_output_len() == 0
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.append_token(next_token())
                if seq.get_output_len() >= MAX_TOKENS or stop_now():
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    self.scheduler.free_seq(seq)
            parent = group.get_seqs()[0]
            if first_sample and parent.status == SequenceStatus.RUNNING:
                for _ in range(group.max_num_samples - 1):
                    child = parent.fork(next(self.ids))
                    child.output_token_ids[-1] = next_token()  # a different first sample
                    self.scheduler.fork_seq(parent, child)
        self.scheduler.free_finished_seq_groups()
        return out

    def _check_output(self, out: SchedulerOutput) -> None:
        assert out.num_batched_tokens <= self.budget
        assert out.num_batched_tokens == sum(
            s.token_chunk_size * s.seq_group.num_seqs(SequenceStatus.RUNNING)
            for s in out.scheduled_seq_groups
        )
        if out.num_preempted:
            assert not out.blocks_to_swap_in
        for scheduled in out.scheduled_seq_groups:
            assert scheduled.token_chunk_size >= 1
            for seq in scheduled.seq_group.get_seqs(SequenceStatus.RUNNING):
                end = seq.num_computed_tokens + scheduled.token_chunk_size
                assert end <= seq.get_len()
                assert scheduled.do_sample == (end == seq.get_len())
                assert len(out.block_tables[seq.seq_id]) * self.block_size >= seq.get_len()
        for group in out.ignored_seq_groups:
            assert all(s.is_finished() for s in group.get_seqs())

    # ---- what must always hold -------------------------------------------------------------

    @invariant()
    def blocks_and_queues_agree(self):
        if not hasattr(self, "scheduler"):
            return
        self.bm.check_invariants()
        s = self.scheduler
        queued = [g.request_id for q in (s.waiting, s.running, s.swapped) for g in q]
        assert len(queued) == len(set(queued)), "a request sits in two queues"
        tables = self.bm.block_tables
        for group in s.waiting:
            for seq in group.get_unfinished_seqs():
                assert seq.status == SequenceStatus.WAITING and seq.seq_id not in tables
                assert seq.num_computed_tokens == 0
        num_running = 0
        for group in s.running:
            for seq in group.get_unfinished_seqs():
                assert seq.status == SequenceStatus.RUNNING
                assert tables[seq.seq_id][0].device == "gpu"
                assert seq.num_computed_tokens <= seq.get_len()
                num_running += 1
        assert num_running <= self.max_num_seqs
        for group in s.swapped:
            for seq in group.get_unfinished_seqs():
                assert seq.status == SequenceStatus.SWAPPED
                assert tables[seq.seq_id][0].device == "cpu"
        for group in self.groups.values():
            for seq in group.get_seqs():
                if seq.is_finished():
                    assert seq.seq_id not in tables, f"finished {seq} still holds blocks"

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        # Run every remaining request to its end: the scheduler must always make progress.
        for _ in range(2000):
            if not self.scheduler.has_unfinished_seqs():
                break
            self._step(lambda: 0, lambda: False)
            self.blocks_and_queues_agree()
        assert not self.scheduler.has_unfinished_seqs(), "requests never finished"
        assert all(g.is_finished() for g in self.groups.values())
        assert self.bm.get_num_free_gpu_blocks() == self.bm.num_total_gpu_blocks
        assert self.bm.get_num_free_cpu_blocks() == self.bm.num_total_cpu_blocks
        assert not self.bm.block_tables


SchedulerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerProperties = SchedulerMachine.TestCase


def test_abort_everything_frees_every_block():
    # The other ending: abort all requests mid-flight on a tiny pool with forks and swaps.
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=32, preemption_mode="swap"),
        CacheConfig(block_size=2, enable_prefix_caching=True),
        num_gpu_blocks=6,
        num_cpu_blocks=6,
    )
    ids = itertools.count()
    for i in range(4):
        seq = Sequence(next(ids), [1, 2, 3, i], 2)
        s.add_seq_group(SequenceGroup(f"r{i}", [seq], SamplingParams(n=2)))
    for _ in range(6):
        out = s.schedule()
        mark_step_computed(s, out)
        for scheduled in out.scheduled_seq_groups:
            if scheduled.do_sample:
                group = scheduled.seq_group
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    seq.append_token(7)
                if group.num_seqs() == 1:
                    parent = group.get_seqs()[0]
                    s.fork_seq(parent, parent.fork(next(ids)))
        s.block_manager.check_invariants()
    assert s.stats.num_preemptions_swap > 0
    s.abort_seq_group([f"r{i}" for i in range(4)])
    s.block_manager.check_invariants()
    assert s.block_manager.get_num_free_gpu_blocks() == 6
    assert s.block_manager.get_num_free_cpu_blocks() == 6

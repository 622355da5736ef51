"""EngineCore: one scheduling step at a time, schedule -> execute -> grammar masks -> sample
-> update.

The executor (pagedllm/contract.py: Executor) executes a StepBatch (plain data) and hands
back a handle; `sample(handle, masks)` gives the StepResult. With async scheduling the next
step (the next decode window, or the step after one with prompt chunks) is executed before
this one's samples are read (Scheduler.schedule_continuation), so the host's update
overlaps the device's next forward.
Requests come in through LLMEngine (engine/llm_engine.py), which adds tokenization and the
admission checks.
"""
from __future__ import annotations

import gc
import itertools
import weakref
from dataclasses import dataclass

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.contract import Executor, SpecStats, StepBatch, StepHandle, WorkerInfo
from pagedllm.engine.batch_builder import StepBatchBuilder
from pagedllm.engine.config_resolver import load_engine_tokenizer, resolve_config
from pagedllm.engine.grammar import GrammarSteps
from pagedllm.engine.lora_adapters import LoRAAdapters
from pagedllm.engine.lora_slots import LoRASlots
from pagedllm.engine.outputs import OutputProcessor, ignored_output
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.scheduler_update import SequenceUpdater
from pagedllm.engine.sequence import SequenceGroup, SequenceStatus
from pagedllm.engine.spec import Speculator
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.engine_args import EngineArgs
from pagedllm.outputs import RequestOutput
from pagedllm.worker.tp_worker import create_worker

RUNNING = SequenceStatus.RUNNING


@dataclass
class _InFlight:
    """An executed step whose samples the engine has not read yet."""

    out: SchedulerOutput
    handle: StepHandle
    batch: StepBatch


# Whether the engine froze the garbage collector's heap (gc's state is the process's).
_heap_frozen = False


def _freeze_heap() -> None:
    """The objects alive when an engine first steps (the block pools' blocks, the model's
    modules, everything imported) kept out of the collector's passes: a full pass walks
    every tracked object, a long pause between two steps. They stay frozen while the engine
    is idle too: unfrozen, the collector's count of old objects is left at the few it saw
    while frozen, so the next full pass would come soon after. Frozen even when the process
    froze some objects of its own first: gc.freeze only adds to what is frozen."""
    global _heap_frozen
    if not _heap_frozen:
        gc.freeze()
        _heap_frozen = True


def _unfreeze_heap() -> None:
    """An engine was shut down or dropped: its model (in a reference cycle) is collectable
    again. gc.unfreeze takes everything out of the permanent generation, what the process
    froze itself before too. A live engine freezes the heap anew at its next step."""
    global _heap_frozen
    if _heap_frozen:
        gc.unfreeze()
        _heap_frozen = False


def _has_running(out: SchedulerOutput) -> bool:
    return any(scheduled.seq_group.num_seqs(RUNNING) for scheduled in out.scheduled_seq_groups)


class EngineCore:
    def __init__(self, args: EngineArgs, executor: Executor | None = None) -> None:
        """`executor`: the one to drive (a fake, in tests, with its own `config` and
        `tokenizer`); by default the one the arguments ask for (create_worker), made after
        the arguments are resolved and the tokenizer loaded (resolve_config)."""
        self.args = args
        if executor is None:
            config = resolve_config(args)
            self.tokenizer, self.config = load_engine_tokenizer(config)
            executor = create_worker(args, self.config)
        else:
            self.config, self.tokenizer = executor.config, executor.tokenizer
        self.worker: Executor = executor
        weakref.finalize(self, _unfreeze_heap)
        self.info = info = self.worker.info()
        self.model_config = self.config.model_config
        # The names the server answers to; the first is the one its responses carry.
        self.served_model_names = args.served_model_names() or [info.source_name]
        self.model_name = self.served_model_names[0]
        self.max_model_len = info.max_model_len
        self.block_size = args.block_size
        self.eos_token_ids = set(info.eos_token_ids)
        self.requests: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        steps = args.num_scheduler_steps
        self.num_scheduler_steps = steps if steps is not None else (8 if info.on_cuda else 4)
        # On the CPU the forward runs while it is launched: nothing to overlap.
        self.async_scheduling = info.on_cuda if args.async_scheduling is None \
            else args.async_scheduling
        self.batch_builder = StepBatchBuilder()
        self._in_flight: _InFlight | None = None
        self.spec_stats = SpecStats()
        # Grammar matchers of requests with structured_outputs (engine/structured_output.py).
        self.structured = StructuredOutputManager(
            self.tokenizer, list(info.eos_token_ids), self.model_config.vocab_size,
            pin_masks=info.on_cuda)
        self.grammar = GrammarSteps(self.structured, info.defers_token_bitmask)
        self.lora_slots = LoRASlots(args.max_loras) if args.enable_lora else None
        self.scheduler = self._make_scheduler(args, info, SequenceUpdater(
            self.batch_builder, self.structured, self.eos_token_ids, self._seq_ids,
            self.spec_stats))
        self.speculative_config = args.speculative_config
        self.speculator = Speculator(args.speculative_config, self.scheduler,
                                     self.max_model_len, info.on_cuda)
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer)
        self.detokenizer = self.output_processor.detokenizer
        self.loras = LoRAAdapters(self.worker, args.enable_lora)

    def _make_scheduler(self, args: EngineArgs, info: WorkerInfo,
                        updater: SequenceUpdater) -> Scheduler:
        self.cache_config = CacheConfig(
            block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            preemption_mode=args.preemption_mode,
        )
        return Scheduler(self.scheduler_config, self.cache_config, info.num_gpu_blocks,
                         info.num_cpu_blocks, updater, self.lora_slots)

    @property
    def stream_outputs(self) -> bool:
        """Streaming (the server): text and an output every step. Offline generation
        (LLM.generate): finished requests only, their text once at the end."""
        return self.output_processor.stream

    @stream_outputs.setter
    def stream_outputs(self, stream: bool) -> None:
        self.output_processor.stream = stream

    @property
    def spec_batch_limit(self) -> int | None:
        return self.speculator.batch_limit

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs() or self._in_flight is not None

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule -> build the step batch -> the worker runs it -> the scheduler's update
        (append, fork, stop, free) -> the outputs (detokenize, stop strings, logprobs)."""
        _freeze_heap()
        return self._step()

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        running, self._in_flight = self._in_flight, None
        if running is None:
            running = self._schedule_and_launch(outputs)
            if running is None:
                return outputs
        # A window sampled at execute: the next one can go now (its inputs are these
        # samples, on the device); one sampled under masks: once its samples are in.
        early = not running.batch.defer_token_bitmask
        ahead = self._launch_ahead(running, outputs) if early else None
        result = self.worker.sample(running.handle, self.grammar.masks_for(running.batch))
        if not early:
            ahead = self._launch_ahead(running, outputs)
        if ahead is not None:
            self.grammar.start_ahead(running.batch, result, ahead.batch)
        self._in_flight = ahead
        update = self.scheduler.update_from_output(running.out, result)
        outputs += self.output_processor.process(update, result)
        if ahead is not None and not _has_running(ahead.out):
            # Every sequence of the step launched ahead finished in this one (on a token or a
            # stop string): nothing waits for its samples.
            self.worker.sample(ahead.handle, self.grammar.masks_for(ahead.batch))
            self._in_flight = None
        for group in self.scheduler.free_finished_seq_groups():
            self._forget(group)
        return outputs

    def _schedule_and_launch(self, outputs: list[RequestOutput]) -> _InFlight | None:
        """A new step (None: nothing to run); requests that can never fit go to `outputs`."""
        speculate = self.speculator.enabled()
        out = self.scheduler.schedule(1 if speculate else self.num_scheduler_steps,
                                      structured_ok=self.info.defers_token_bitmask)
        self._answer_ignored(out, outputs)
        if out.is_empty():
            return None
        if speculate:
            self.speculator.propose(out)
        return self._launch(out)

    def _answer_ignored(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        """Requests the scheduler found can never fit: finished, their outputs to `outputs`."""
        for group in out.ignored_seq_groups:
            outputs.append(ignored_output(group, self.info.num_gpu_blocks * self.block_size))
            self._forget(group)

    def _launch_ahead(self, running: _InFlight,
                      outputs: list[RequestOutput]) -> _InFlight | None:
        """Async scheduling: the step after `running`, launched before its samples are
        read (never around a speculative step, which needs the last step's tokens);
        waiting requests it finds can never fit go to `outputs`."""
        if not self.async_scheduling or running.out.spec_token_ids or \
                running.out.num_draft_tokens or self.speculator.enabled():
            return None
        after = self.scheduler.schedule_continuation(
            running.out, self.num_scheduler_steps, structured_ok=self.info.defers_token_bitmask)
        if after is None:
            return None
        self._answer_ignored(after, outputs)
        return None if after.is_empty() else self._launch(after, defer_masks=True)

    def _launch(self, out: SchedulerOutput, defer_masks: bool = False) -> _InFlight:
        """Build and execute a step; `defer_masks`: launched ahead (async scheduling), its
        constrained rows' masks filled once the previous step's tokens are known."""
        batch = self.batch_builder.build(out)
        if self.lora_slots is not None:
            self.lora_slots.fill(batch, (s.seq_group for s in out.scheduled_seq_groups))
        self.grammar.fill_at_launch(batch)
        return _InFlight(out, self.worker.execute(batch), batch)

    def _forget(self, group: SequenceGroup) -> None:
        self.requests.pop(group.request_id, None)
        self.batch_builder.free(group.seqs_dict)
        self.structured.free(group.seqs_dict)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (also done at exit)."""
        _unfreeze_heap()
        self.worker.shutdown()

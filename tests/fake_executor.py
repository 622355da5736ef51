"""An executor without a model (pagedllm/contract.py: Executor), for tests of the engine's
step alone: schedule -> execute -> masks -> sample -> update.

It keeps its own per-sequence tokens from the StepBatch deltas, as a real worker does, and
samples by a rule the test can predict: a row's next token is (its last token + 1) %
VOCAB. It has no tokenizer, so no grammar: masks are refused. It records every call in
`calls` (("execute", batch) and ("sample", batch)), so a test can see the launch order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedllm.config import EngineConfig
from pagedllm.contract import GrammarMasks, StepBatch, StepResult, WorkerInfo

VOCAB = 64


@dataclass
class FakeModelConfig:
    vocab_size: int = VOCAB
    hidden_size: int = 8


class FakeExecutor:
    tokenizer = None

    def __init__(self, on_cuda: bool = False, num_gpu_blocks: int = 64,
                 max_model_len: int = 256, eos_token_id: int = VOCAB - 1) -> None:
        # What the engine would have resolved for such a model (resolve_config).
        self.config = EngineConfig(
            model_config=FakeModelConfig(), source_name="fake", source_path=None,
            tokenizer_path=None, max_model_len=max_model_len, eos_token_ids=(eos_token_id,))
        self._info = WorkerInfo(
            num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0, max_model_len=max_model_len,
            max_num_batched_tokens=max_model_len, max_num_seqs=256,
            eos_token_ids=(eos_token_id,),
            on_cuda=on_cuda, defers_token_bitmask=True, weight_bytes=0, source_name="fake")
        self.tokens: dict[int, list[int]] = {}  # what the engine sent, then what was drawn
        self.last: dict[int, int] = {}  # each sequence's last token, sampled ones included
        self.calls: list[tuple[str, StepBatch]] = []
        self.forwards = 0  # sub-steps run (one forward each)

    def info(self) -> WorkerInfo:
        return self._info

    def execute(self, batch: StepBatch) -> tuple[StepBatch, StepResult]:
        """Applies the deltas and draws the samples now, as the contract says of a batch
        with no masks to wait for: the next batch may be executed before `sample`."""
        self.calls.append(("execute", batch))
        assert not batch.defer_token_bitmask
        for new in batch.new_seqs:
            self.tokens[new.seq_id] = list(new.prompt_token_ids)
            self.last[new.seq_id] = new.prompt_token_ids[-1]
        for fork in batch.forks:
            self.tokens[fork.child_seq_id] = list(self.tokens[fork.parent_seq_id])
            self.last[fork.child_seq_id] = self.last[fork.parent_seq_id]
        for seq_id in batch.freed_seq_ids:
            self.tokens.pop(seq_id)
            self.last.pop(seq_id)
        for seq_id, new_ids in zip(batch.seq_ids, batch.new_token_ids):
            self.tokens[seq_id] += new_ids
        return batch, self._draw(batch)

    def sample(self, handle: tuple[StepBatch, StepResult],
               masks: GrammarMasks | None) -> StepResult:
        self.calls.append(("sample", handle[0]))
        assert masks is None
        return handle[1]

    def _draw(self, batch: StepBatch) -> StepResult:
        rows = [s for s, do in zip(batch.seq_ids, batch.do_sample) if do]
        ids = np.zeros((batch.num_steps, len(rows)), dtype=np.int64)
        for step in range(batch.num_steps if rows else 0):
            self.forwards += 1
            for j, seq_id in enumerate(rows):
                ids[step, j] = self.last[seq_id] = (self.last[seq_id] + 1) % VOCAB
        if not rows:
            self.forwards += 1
            return StepResult()
        n = len(rows)
        return StepResult(
            seq_ids=rows, num_samples=[1] * n, num_logprobs=[0] * n, token_ids=ids,
            logprobs=np.zeros(ids.shape), ranks=np.ones(ids.shape, dtype=np.int64),
            top_token_ids=np.zeros((*ids.shape, 0), dtype=np.int64),
            top_logprobs=np.zeros((*ids.shape, 0)))

    def shutdown(self) -> None:
        pass

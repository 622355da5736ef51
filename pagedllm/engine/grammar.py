"""Grammar masks around an executed step (engine/structured_output.py holds the matchers
and fills the masks).

With the single-process worker a constrained batch's masks come with Executor.sample
(GrammarMasks): the first sub-step's, then each later sub-step's on the executor's call
`next(token_ids)`, which advances the grammars by the sub-step before's samples. Under async
scheduling the next window is executed before this window's samples are read: its first
masks are filled on a background thread while the engine updates the window before. The
tensor-parallel group takes the masks in the batch instead (every rank samples), and its
windows with constrained rows are one step.
"""
from __future__ import annotations

from pagedllm.contract import GrammarMasks, StepBatch, StepResult
from pagedllm.engine.structured_output import StructuredOutputManager


class GrammarSteps:
    def __init__(self, structured: StructuredOutputManager, masks_with_sample: bool) -> None:
        self.structured = structured
        self.masks_with_sample = masks_with_sample  # WorkerInfo.defers_token_bitmask

    def fill_at_launch(self, batch: StepBatch) -> None:
        """A batch with constrained rows: its masks come with sample, or are in it (also a
        speculative step's: one step, sampled at execute)."""
        structured = self.structured
        if not structured or not any(i in structured.matchers for i in batch.seq_ids):
            return
        if self.masks_with_sample and not (batch.spec_token_ids or batch.num_draft_tokens):
            batch.defer_token_bitmask = True
        else:
            structured.fill_bitmask(batch)

    def masks_for(self, batch: StepBatch) -> GrammarMasks | None:
        """The masks to sample `batch` under (None: it needs none, or carries them); a fill
        already started for it (async scheduling) is waited for."""
        if not batch.defer_token_bitmask:
            return None
        structured = self.structured
        if not structured.filling(batch):
            structured.start_fill(batch, background=False)
        structured.finish_fill()
        return GrammarMasks(batch.token_bitmask, batch.token_bitmask_rows,
                            lambda token_ids: self._next(batch, token_ids))

    def _next(self, batch: StepBatch, token_ids) -> GrammarMasks:
        """A window's next sub-step's masks, from the sub-step before's samples."""
        self.structured.advance(batch, token_ids)
        self.structured.fill_bitmask(batch)
        return GrammarMasks(batch.token_bitmask, batch.token_bitmask_rows,
                            lambda ids: self._next(batch, ids))

    def start_ahead(self, batch: StepBatch, result: StepResult, ahead: StepBatch) -> None:
        """Once a window's samples are in, with a window executed `ahead`: the ahead one's
        first masks start filling in the background from them (its matchers advanced by
        the window's last samples, ahead of the engine's append)."""
        if ahead.defer_token_bitmask:
            self.structured.advance(batch, result.token_ids[-1])
            self.structured.start_fill(ahead)

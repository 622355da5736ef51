"""Grammar masks around a launched step: when each sub-step of a constrained decode window
samples, and how the masks of the window launched ahead are filled while the engine updates
the one before (engine/structured_output.py holds the matchers and fills the masks).

A window's sub-step samples once its masks are in (`sample_with_bitmask`); its masks come
from the grammars advanced by the sub-step before's samples. Under async scheduling the
next window's forward is queued before this window's samples are read: its first masks are
filled on a background thread during this window's update, and its later sub-steps sample
between parts of that update as soon as their masks are in.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.contract import StepBatch, StepResult
from pagedllm.engine.structured_output import StructuredOutputManager


class GrammarSteps:
    def __init__(self, structured: StructuredOutputManager) -> None:
        self.structured = structured

    def fill_at_launch(self, batch: StepBatch, defer_masks: bool) -> None:
        """The batch's masks; `defer_masks`: constrained rows get theirs after the launch
        (async scheduling), once the previous step's tokens are known."""
        structured = self.structured
        if not structured:
            return
        if defer_masks and any(i in structured.matchers for i in batch.seq_ids):
            batch.defer_token_bitmask = True
        else:
            structured.fill_bitmask(batch)

    def sample_all(self, pending: Any, batch: StepBatch) -> None:
        """A decode window with constrained rows: each further step waits for the samples
        of the one before (its forward is already running), advances the grammars with
        them, and samples under the masks they give (a fill already started first)."""
        structured = self.structured
        if structured.filling(batch):
            self._sample_filled(pending, batch)
        while pending.awaits_bitmask:
            structured.advance(batch, pending.last_samples())
            structured.start_fill(batch, background=False)
            self._sample_filled(pending, batch)

    def overlap(self, batch: StepBatch, result: StepResult,
                ahead: Any | None) -> Callable[[], None] | None:
        """Once a window's samples are in, with a window launched `ahead` (its .pending and
        .batch): its first masks start filling from them; returns what the update runs
        between parts of itself (the window ahead's next sub-steps sampling as their masks
        come in), or None."""
        if ahead is None:
            return None
        if ahead.batch.defer_token_bitmask:
            self.structured.advance(batch, result.token_ids[-1])
            self.structured.start_fill(ahead.batch)
        if not ahead.pending.awaits_bitmask:
            return None
        return lambda: self._sample_when_ready(ahead.pending, ahead.batch)

    def _sample_when_ready(self, pending: Any, batch: StepBatch) -> None:
        """Without waiting: the window's next step samples once its masks are in, and the
        masks of the one after start filling once its samples are."""
        structured = self.structured
        if structured.filling(batch):
            if not structured.fill_ready():
                return
            self._sample_filled(pending, batch)
        if pending.awaits_bitmask and pending.last_samples_ready():
            structured.advance(batch, pending.last_samples())
            structured.start_fill(batch)

    def _sample_filled(self, pending: Any, batch: StepBatch) -> None:
        """The window's next step samples under the masks started last."""
        self.structured.finish_fill()
        pending.sample_with_bitmask(batch.token_bitmask, batch.token_bitmask_rows)

"""LoRASlots: which adapter each of the worker's max_loras device slots holds, decided by the
engine (the worker only copies adapters into the slots the batches name).

A group is admitted (waiting -> running, swapped -> running) only once its adapter has a
slot: the one already holding it, a free one, or the least recently used one no running
group uses (its adapter is evicted). With every slot in use by running groups the group
waits: more distinct adapters in flight than slots queue, never fail. Invariant: the
adapter of every running group sits in a slot, so each row of a step has one.
"""
from __future__ import annotations

from collections.abc import Iterable

from pagedllm.contract import LoRASlotLoad, StepBatch
from pagedllm.engine.sequence import SequenceGroup, SequenceStatus

RUNNING = SequenceStatus.RUNNING


def lora_int_id(group: SequenceGroup) -> int:
    """The group's adapter id; 0: the base model."""
    request = group.lora_request
    return 0 if request is None else request.lora_int_id


def adapter_names(groups: Iterable[SequenceGroup]) -> list[str]:
    """The adapters `groups` run under, each name once, sorted (the base model's: none)."""
    return sorted({g.lora_request.lora_name for g in groups if g.lora_request is not None})


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.slot_ids: list[int | None] = [None] * max_loras  # lora_int_id per slot
        self._last_used = [0] * max_loras  # a counter value: the least is the LRU slot
        self._clock = 0
        self._loads: list[tuple[int, LoRASlotLoad]] = []  # for the next batch

    def acquire(self, group: SequenceGroup, running: Iterable[SequenceGroup]) -> bool:
        """Whether `group` may run now: its adapter has (or was just given) a slot."""
        lora_id = lora_int_id(group)
        if not lora_id:
            return True
        self._clock += 1
        if lora_id in self.slot_ids:
            self._last_used[self.slot_ids.index(lora_id)] = self._clock
            return True
        slot = self._victim({lora_int_id(g) for g in running})
        if slot is None:
            return False
        request = group.lora_request
        self.slot_ids[slot], self._last_used[slot] = lora_id, self._clock
        self._loads.append((slot, LoRASlotLoad(lora_id, request.lora_name,
                                               request.lora_path)))
        return True

    def _victim(self, in_use: set[int]) -> int | None:
        """A free slot, else the least recently used one no running group uses."""
        if None in self.slot_ids:
            return self.slot_ids.index(None)
        idle = [s for s, held in enumerate(self.slot_ids) if held not in in_use]
        return min(idle, key=self._last_used.__getitem__) if idle else None

    def fill(self, batch: StepBatch, groups: Iterable[SequenceGroup]) -> None:
        """Each row's slot (rows in the batch builder's order: the step's scheduled groups,
        then their running sequences) and the loads queued since the last batch."""
        batch.lora_loads, self._loads = self._loads, []
        slots: list[int] = []
        for group in groups:
            lora_id = lora_int_id(group)
            slot = self.slot_ids.index(lora_id) if lora_id else -1
            slots += [slot] * sum(s.status is RUNNING for s in group.seqs_dict.values())
        if any(s >= 0 for s in slots):
            batch.lora_slots = slots

"""Which storages ops produced while the runtime ran: the activations (everything else is fixed).

A slot is a weak reference to the storage (the storage's Python object lives exactly as long as the
storage), keyed by ``id(storage)`` and removed by its callback when the memory is freed. It carries
the storage's lineage node (when recompute records it) and its saved-tensor entry (when autograd
saved it).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch


class Slot(weakref.ref):
    """Weak reference to a produced storage, with the runtime's facts about it."""

    __slots__ = ("key", "node", "entry", "last_entry", "stage")

    def __new__(cls, st: torch.UntypedStorage, callback: Any) -> "Slot":
        self = weakref.ref.__new__(cls, st, callback)
        self.key = id(st)
        self.node = None
        self.entry = None
        self.last_entry = None  # the entry it had when freed (a plan regenerates evicted tensors by it)
        self.stage = -1         # the step's stage it was produced in (a Graph tensor's producer)
        return self

    def __init__(self, st: torch.UntypedStorage, callback: Any) -> None:
        super().__init__(st, callback)


class ProducedTable:
    """``id(storage) -> Slot`` for storages produced by ops since the runtime was enabled."""

    def __init__(self) -> None:
        self.slots: dict[int, Slot] = {}

    def get(self, st: torch.UntypedStorage) -> Slot | None:
        return self.slots.get(id(st))

    def add(self, st: torch.UntypedStorage) -> Slot:
        slot = self.slots.get(id(st))
        if slot is None:
            slot = self.slots[id(st)] = Slot(st, self._gone)
        return slot

    def _gone(self, slot: Slot) -> None:
        # The storage is being freed. Identity check: the id may already belong to a new storage.
        if self.slots.get(slot.key) is slot:
            del self.slots[slot.key]
        slot.last_entry, slot.entry = slot.entry, None
        slot.node = None  # a node keeps its lineage; it just no longer has a live storage

    def __len__(self) -> int:
        return len(self.slots)

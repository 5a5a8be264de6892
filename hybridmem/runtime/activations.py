"""Which storages ops produced while the runtime ran: the activations (everything else is fixed).

A slot is a weak reference to the storage (the storage's Python object lives exactly as long as the
storage), keyed by ``id(storage)`` and removed by its callback when the memory is freed. It carries
the storage's lineage node (when recompute records it) and its saved-tensor entry (when autograd
saved it). On the simulated device a slot made for an op's new output (:meth:`ProducedTable.new`)
is also the meter's entry for the storage (a :class:`~hybridmem.runtime.meter.StorageRef`): one weak
reference and one callback per new storage instead of two.
"""
from __future__ import annotations

from typing import Any

import torch

from .meter import Meter, StorageRef


class Slot(StorageRef):
    """Weak reference to a produced storage, with the runtime's facts about it. Made by
    :func:`make_slot` (no Python ``__init__``: a slot is made for every new storage)."""

    __slots__ = ("node", "entry", "last_entry", "stage", "saved_step", "saved_bytes")


def make_slot(st: torch.UntypedStorage, k: int, nbytes: int, callback: Any) -> Slot:
    s = Slot(st, callback)
    s.key, s.nbytes = k, nbytes
    s.node = s.entry = None
    s.last_entry = None  # the entry it had when freed (a plan regenerates evicted tensors by it)
    s.stage = -1         # the step's stage it was produced in (a Graph tensor's producer)
    s.saved_step = -1    # monitor-only hooks: the step in which it was last counted as saved
    s.saved_bytes = 0    # monitor-only hooks: its bytes, once autograd saved it (counted in saved_live)
    return s


class ProducedTable:
    """``id(storage) -> Slot`` for storages produced by ops since the runtime was enabled. With a
    simulated-device ``meter``, :meth:`new` registers a new storage with both."""

    def __init__(self, meter: Meter | None = None) -> None:
        self.slots: dict[int, Slot] = {}
        self.saved_live = 0  # bytes of the storages autograd saved that are alive (monitor-only hooks count them)
        self.meter = meter if meter is not None and meter.simulated else None
        self._gone_cb = self._gone
        self._gone_counted_cb = self._gone_counted

    def get(self, st: torch.UntypedStorage) -> Slot | None:
        return self.slots.get(id(st))

    def add(self, st: torch.UntypedStorage) -> Slot:
        slot = self.slots.get(id(st))
        if slot is None:
            slot = self.slots[id(st)] = make_slot(st, id(st), 0, self._gone_cb)
        return slot

    def new(self, st: torch.UntypedStorage, k: int, nbytes: int) -> Slot:
        """A storage (``k = id(st)``) neither this table nor the meter knows: one slot for both."""
        m = self.meter
        assert m is not None
        slot = self.slots[k] = make_slot(st, k, nbytes, self._gone_counted_cb)
        m._live[k] = slot
        m._current += nbytes
        return slot

    def _gone(self, slot: Slot) -> None:
        # The storage is being freed. Identity check: the id may already belong to a new storage.
        if self.slots.get(slot.key) is slot:
            del self.slots[slot.key]
        slot.last_entry, slot.entry = slot.entry, None
        slot.node = None  # a node keeps its lineage; it just no longer has a live storage
        self.saved_live -= slot.saved_bytes

    def _gone_counted(self, slot: Slot) -> None:
        # _gone and Meter._freed in one callback (one runs per freed activation).
        k = slot.key
        if self.slots.get(k) is slot:
            del self.slots[k]
        slot.last_entry, slot.entry = slot.entry, None
        slot.node = None
        self.saved_live -= slot.saved_bytes
        m = self.meter
        live = m._live  # type: ignore[union-attr]
        if live.get(k) is slot:
            del live[k]
            m._current -= slot.nbytes  # type: ignore[union-attr]

    def __len__(self) -> int:
        return len(self.slots)

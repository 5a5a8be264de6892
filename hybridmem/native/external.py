"""Training state allocated before the native CPU meter was installed, counted against it while it lives.

The native allocator device (:mod:`.cpumeter`) counts what is allocated through it. Parameters, buffers, the
optimizer's state and a first batch usually come from before: :class:`ExternalBytes` adds each such storage's
bytes to the device's count (``add_external``) once, from when it is first seen until it is freed, and takes
them off while detached from the device (a runtime disabled, a compiled backend stopped), adding them back when
attached again. Used by the eager runtime's meter (:mod:`hybridmem.runtime.meter`), the monitor
(:mod:`hybridmem.runtime.monitor`) and the compiled backend's measurement (:mod:`hybridmem.compile.measured`).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch


def data_ptr(st: torch.UntypedStorage) -> int:
    """The storage's address; 0 for the data-less stand-ins of wrapper subclasses (a DTensor's global
    storage), whose bytes live in their local shards."""
    try:
        return st.data_ptr()
    except RuntimeError:
        return 0


class ExternalBytes:
    """Storages counted as external against the attached native device (see the module docstring)."""

    def __init__(self) -> None:
        # id(storage) -> bytes it adds to the device's count; read directly where a check is per save
        self.bytes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.native: Any = None
        self.added = 0   # storages ever counted (a step that counts one holds state no earlier step showed)

    def attach(self, native: Any) -> None:
        """Count against ``native`` (a :class:`~.cpumeter.CpuAllocatorMeter`), with what was counted before."""
        self.native = native
        if self.bytes:
            native.add_external(sum(self.bytes.values()))

    def detach(self) -> None:
        """Stop counting against the device; what was counted leaves its count until attached again."""
        native, self.native = self.native, None
        if native is not None and self.bytes:
            native.add_external(-sum(self.bytes.values()))

    def countable(self, st: torch.UntypedStorage) -> int:
        """The bytes :meth:`add` would count for ``st``: 0 where nothing is attached, it is counted already, or
        it was allocated through the device (counted by the device itself)."""
        native = self.native
        if native is None or id(st) in self.bytes:
            return 0
        nb = st.nbytes()
        if not nb or not (ptr := data_ptr(st)) or native.serial_of(ptr) >= 0:
            return 0
        return nb

    def add(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """Count ``nbytes`` of ``st`` (from :meth:`countable`, or a caller that read its serial) until it is
        freed; once."""
        k = id(st)
        if k in self.bytes:
            return
        self.bytes[k] = nbytes
        self._refs[k] = weakref.ref(st, lambda r, k=k: self._freed(k, r))
        self.added += 1
        self.native.add_external(nbytes)

    def count(self, st: torch.UntypedStorage) -> int:
        """Count ``st`` if it is external and not counted yet; the bytes newly counted."""
        nb = self.countable(st)
        if nb:
            self.add(st, nb)
        return nb

    def resized(self, st: torch.UntypedStorage) -> None:
        """``st`` was resized in place (FSDP's ``resize_``, through its old allocator): count its new size."""
        old = self.bytes.get(id(st))
        if old is not None and self.native is not None:
            nb = st.nbytes()
            self.bytes[id(st)] = nb
            self.native.add_external(nb - old)

    def _freed(self, k: int, ref: weakref.ref) -> None:
        # the id may already belong to a new storage counted after this one died: check the reference
        if self._refs.get(k) is not ref:
            return
        del self._refs[k]
        nb = self.bytes.pop(k, 0)
        if nb and self.native is not None:
            self.native.add_external(-nb)

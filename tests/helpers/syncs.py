"""Count what would make a CUDA host wait for its device, on the CPU where the device is the host.

A managed step must never synchronise the device: no ``.item()``/``int(t)``/``bool(t)`` of a device value,
no ``nonzero``/boolean indexing/``masked_select`` (their output size is on the device), no ``tolist()`` of
a device tensor, no ``torch.cuda.synchronize`` and no allocator statistics read through Python
(``torch.cuda.memory_allocated`` builds a dict per read). On the CPU none of these waits for anything, so
:class:`SyncCounter` counts them instead: the ops through a dispatch mode entered below the runtime's,
the Python calls by patching them.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops whose result the host must read from the device (their output's value or size)
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
           aten.equal.default, aten.is_nonzero.default, aten.unique_consecutive.default,
           aten._unique2.default, aten.repeat_interleave.Tensor}
# Python calls that synchronise a CUDA device or read its allocator's statistics the slow way
PATCHED = [(torch.Tensor, "tolist"), (torch.cuda, "synchronize"), (torch.cuda, "memory_allocated"),
           (torch.cuda, "max_memory_allocated"), (torch.cuda, "memory_reserved"), (torch.cuda, "memory_stats")]


class SyncCounter(TorchDispatchMode):
    """Counts, while entered, the ops and Python calls above (``counts``) and all ops (``ops``).

    Enter it *before* ``hybridmem.enable()``: the runtime's own mode then sits above it, so this sees the
    ops the runtime runs as well as the model's. ``tolist()`` of the pinned copies the compress policy reads
    once they have arrived (:class:`~hybridmem.plugins.codecs.DeviceStats`) reads no device and is not
    counted."""

    def __init__(self, monkeypatch: Any) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.ops = 0
        self._reading_host = 0
        for owner, name in PATCHED:
            real = getattr(owner, name)
            monkeypatch.setattr(owner, name, self._counted(name, real))
        from hybridmem.plugins import codecs
        result = codecs.DeviceStats.result

        def host_copy(stats: Any) -> Any:
            self._reading_host += 1
            try:
                return result(stats)
            finally:
                self._reading_host -= 1
        monkeypatch.setattr(codecs.DeviceStats, "result", host_copy)

    def _counted(self, name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._reading_host:
                self.counts[name] += 1
            return real(*args, **kwargs)
        return call

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        if func in SYNCING or (func is aten.index.Tensor and _bool_index(args)):
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def take(self) -> tuple[Counter[str], int]:
        """The counts so far, and the ops; both start again from zero."""
        got, ops = self.counts, self.ops
        self.counts, self.ops = Counter(), 0
        return got, ops


def _bool_index(args: tuple) -> bool:
    """``x[mask]``: an index with a bool tensor, whose result size is the mask's count."""
    return len(args) > 1 and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())

"""A synchronous stand-in for ``torch.cuda`` that records the order of stream and event operations, for
testing the swap policy's CUDA protocol (side streams, events, no host synchronisation) on the CPU."""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from hybridmem.plugins.swap import PinnedPool


class FakeEvent:
    def __init__(self, log, enable_timing=False):
        self.log, self.timing, self.stream = log, enable_timing, None

    def record(self, stream=None):
        self.stream = stream
        self.log.append(("record", stream.name, id(self)))

    def query(self):
        return True

    def synchronize(self):
        self.log.append(("event_sync", id(self)))

    def elapsed_time(self, end):
        return 2.0 if end.stream.name == "compute" else 5.0     # ms: stalls 2 ms, copies 5 ms


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, id(event)))


class FakeCuda:
    """Synchronous stand-in for torch.cuda that records the order of stream operations."""

    def __init__(self):
        self.log: list[tuple] = []
        self.compute = FakeStream(self.log, "compute")
        self._names = iter(["d2h", "h2d"])
        self.current = self.compute

    def Stream(self, device=None):
        return FakeStream(self.log, next(self._names))

    def Event(self, enable_timing=False):
        return FakeEvent(self.log, enable_timing)

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        self.log.append(("enter", s.name))
        try:
            yield
        finally:
            self.current = prev
            self.log.append(("exit", s.name))


class HostPool(PinnedPool):
    """The pool of host buffers a CUDA transport copies into, for the CPU as the device: the buffers come from
    numpy's allocator, not from the CPU allocator the budget caps (host memory is not the device's)."""

    def __init__(self) -> None:
        super().__init__(pin=False)

    def _new(self, size: int) -> torch.Tensor:
        return torch.from_numpy(np.empty(size, dtype=np.uint8))

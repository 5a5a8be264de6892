"""Random states of recorded ops: read before a random op runs, kept as host bytes, set around its replay.

A replay runs with the state its op drew from and puts the training run's state back afterwards, so
recomputing never moves the program's random stream.

During CUDA graph capture the CUDA generator's state cannot be read (``get_rng_state`` raises; the
captured graph draws from offsets it advances at replay): :func:`rng_state` records :data:`CAPTURED` for it
instead, and a replay of such an op refuses to run. The runtime keeps every tensor saved during capture
(:mod:`.capture`), so none is ever recomputed.
"""
from __future__ import annotations

from typing import Any

import torch

from ..native.capture import capturing

Tensor = torch.Tensor
CAPTURED = b""  # the CUDA state of an op recorded during graph capture: unknown, not replayable


class RngBefore:
    """The RNG states an op drew from: the default generators' and explicit ``generator=`` ones'."""

    __slots__ = ("default", "generators")

    def __init__(self, default: tuple[bytes, bytes | None], generators: dict[int, bytes]):
        self.default, self.generators = default, generators


def rng_state(device: torch.device) -> tuple[bytes, bytes | None]:
    """The default generators' states an RNG op on ``device`` draws from (CPU, and CUDA if used; during graph
    capture :data:`CAPTURED`)."""
    if device.type != "cuda":
        cuda = None
    elif capturing():
        cuda = CAPTURED
    else:
        cuda = host_state(torch.cuda.get_rng_state(device))
    return host_state(torch.get_rng_state()), cuda


def host_state(t: Tensor) -> bytes:
    """An RNG state as Python bytes: recorded states live outside the allocator the budget caps (a CPU
    generator's state is 5 KB per random op; on the simulated CPU device it would count as device bytes)."""
    return t.numpy().tobytes()


def state_tensor(b: bytes) -> Tensor:
    """The state tensor ``set_state`` takes, over a copy of ``b`` (no allocator bytes)."""
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


class _ForkedRNG:
    """Run with a recorded RNG state, then put the current state back (a replay leaves the training
    run's RNG stream untouched)."""

    def __init__(self, state: tuple[bytes, bytes | None], device: torch.device):
        self.state, self.device = state, device

    def __enter__(self) -> "_ForkedRNG":
        if self.state[1] == CAPTURED:
            raise RuntimeError("hybridmem: a random op recorded during CUDA graph capture cannot be replayed "
                               "(its generator state was not readable); tensors saved during capture are kept")
        if capturing():
            raise RuntimeError("hybridmem: a random op cannot be replayed during CUDA graph capture (the "
                               "generator's state cannot be set there)")
        self.saved = rng_state(self.device)
        self.rewind()
        return self

    def rewind(self) -> None:
        """Set the recorded state (again: an op the allocator refused may have drawn before it failed)."""
        torch.set_rng_state(state_tensor(self.state[0]))
        if self.state[1] is not None:
            torch.cuda.set_rng_state(state_tensor(self.state[1]), self.device)

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(state_tensor(self.saved[0]))
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(state_tensor(self.saved[1]), self.device)

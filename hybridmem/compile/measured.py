"""The real peak of compiled steps, beside the plan's prediction (``CompileStats.measured_peak_bytes``).

On CUDA it is the caching allocator's ``max_memory_allocated``. On the CPU it is the native allocator
meter (:mod:`hybridmem.native.cpumeter`), installed when the first region compiles: every allocation
from then on counts, and the training state from before (parameters, buffers, inputs, the optimizer's
state when the backend was given the optimizer) counts once a compiled region first reads it, for as
long as it lives. Compiling is not a step: the allocations of a compile (the scratch measurement, the
compiler's own tensors) are left out by starting a new peak window when each compile ends, after
folding the window before it into the figure.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from ..native.cpumeter import load, unavailable_reason
from ..native.external import ExternalBytes

__all__ = ["StepPeak"]


class _Shared:
    """One count of the state from before the allocator meter, for every backend in the process (so that
    each storage is counted once), attached while any backend measures."""

    external = ExternalBytes()
    users = 0


def _acquire(native: Any) -> ExternalBytes:
    if _Shared.users == 0:
        native.acquire()
        _Shared.external.attach(native)  # counts again the state it counted before a release
    _Shared.users += 1
    return _Shared.external


def _release() -> None:
    _Shared.users -= 1
    if _Shared.users == 0:
        native = _Shared.external.native
        _Shared.external.detach()
        if native is not None:
            native.release()


class StepPeak:
    """Real peak bytes of the device while compiled steps run (None where it cannot be read)."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.how = "not measured (no region compiled yet)"
        self._external: ExternalBytes | None = None   # the shared count, while this measures on the CPU
        self._floor = 0            # the largest peak of the windows closed so far
        self._optimizer: Any = None
        self._active = False
        self._seen: dict[int, weakref.ref] = {}  # id -> tensor the compiled regions read, checked already
        self._hold: Any = None     # releases the shared meter once: at stop(), or when this is collected unstopped

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self, device: torch.device, optimizer: Any = None) -> None:
        """Measure on ``device`` (the first region's): idempotent; after :meth:`stop`, measure again."""
        if self._active:
            return
        self._active = True
        if self.device is None:
            self.device, self._optimizer = device, optimizer
        device = self.device
        if device.type == "cuda":
            self.how = "CUDA caching allocator"
            self.compiled()
            return
        if device.type != "cpu":
            self.how = f"not measured (no allocator statistics on {device.type})"
            return
        native = load()
        if native is None:
            self.how = f"not measured (the native CPU allocator meter is not available: {unavailable_reason()})"
            return
        self._external = _acquire(native)
        # a backend dropped without stop() (torch._dynamo.reset(), a finished script) lets go of the meter too:
        # left installed, it would count every later allocation of the process against later budgets
        self._hold = weakref.finalize(self, _release)
        native.reset_peak()
        if self._optimizer is not None:
            self._count_state(t for st in self._optimizer.state.values() for t in st.values() if torch.is_tensor(t))
        self.how = "CPU allocator"

    def stop(self) -> None:
        """Stop measuring (on the CPU, uninstall the meter if this installed it): the figure so far stays."""
        if not self._active:
            return
        self._floor = self.peak_bytes or 0
        self._active = False
        if self._external is not None:
            self._external = None
            self._hold()

    # ---- compiles and steps ------------------------------------------------------------------------
    def compiling(self) -> None:
        """A compile begins: what was measured up to now is a step's (or nothing)."""
        if self._active:
            self._floor = max(self._floor, self._window())

    def compiled(self) -> None:
        """A compile ended: start a new window at the current level."""
        if not self._active:
            return
        if self._external is not None and self._external.native is not None:
            self._external.native.reset_peak()
        elif self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled`` counting the state it reads that predates the meter."""
        if self._external is None or not self._active:
            return compiled

        seen = self._seen

        @functools.wraps(compiled)
        def run(*args: Any) -> Any:
            # every call (one compiled block may run over the parameters of many: regional compilation),
            # but a tensor object once: parameters come back call after call
            flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args
            new = []
            for t in flat:
                if isinstance(t, torch.Tensor):
                    r = seen.get(id(t))
                    if r is None or r() is not t:
                        new.append(t)
            if new:
                self._count_state(new)
                for t in new:
                    seen[id(t)] = weakref.ref(t, lambda _, k=id(t): seen.pop(k, None))
            return compiled(*args)

        # AOTAutograd's boxed calling convention (one list argument) must survive the wrapper
        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def reset(self) -> None:
        """A new measurement window from now (``hybridmem.reset_stats()``)."""
        self._floor = 0
        self.compiled()

    # ---- readings -------------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int | None:
        if not self._active:
            return self._floor or None
        if self.device is None or (self.device.type != "cuda" and self._external is None):
            return None
        return max(self._floor, self._window())

    def _window(self) -> int:
        if not self._active:
            return 0
        if self._external is not None and self._external.native is not None:
            return self._external.native.peak_bytes
        if self.device is not None and self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return 0

    def _count_state(self, tensors: Any) -> None:
        m = self._external
        if m is None or m.native is None:
            return
        for t in tensors:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue  # wrapper subclasses without one storage: their parts are read separately
            if st.device.type == "cpu":
                m.count(st)

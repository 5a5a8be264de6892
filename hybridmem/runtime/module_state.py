"""Parameters and buffers are never activations, even when created while the runtime runs.

The runtime calls a storage an activation when an op produced it while enabled. A model built after
``enable()`` (the ``HYBRIDMEM_BUDGET=... python train.py`` path) has parameters and buffers produced
by ops too, so a global module forward pre-hook takes every module's parameters and buffers out of
the produced table the first time the module (or a module containing it) runs. Matching storages,
not tensors, also covers views such as the ``weight.t()`` a linear layer saves, and tied weights.

The same hook hands them to the meter, so the simulated device counts the whole model from the
first forward (as ``Graph.fixed_bytes`` does), not each parameter from the op that first reads it:
otherwise a first-seen weight would raise the live bytes in the middle of the cap's arithmetic. The
parameters' gradients go with them (kept from the step before, as gradient accumulation does, they are
held through the step), and so does the state of the optimizers that step them
(:func:`~hybridmem.graph.stepparts.optimizers_of`, once, at the first module call; a global optimizer step
pre-hook catches an optimizer made later): state made before ``enable()`` is training state the allocator
never saw.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..graph.stepparts import optimizers_of
from .hookless import GlobalPreHook
from .meter import Meter
from .activations import ProducedTable


class FixedMarker:
    """Global module pre-hook that un-marks module parameters and buffers as activations."""

    def __init__(self, produced: ProducedTable, meter: Meter, on_call: Callable[[torch.nn.Module], None],
                 on_optimizer_step: Callable[[], None] | None = None):
        self.produced = produced
        self.meter = meter
        self.on_call = on_call  # every module call (the step tracker starts steps here)
        self.on_optimizer_step = on_optimizer_step  # every optimizer step (steps as the user counts them)
        # id(module) -> weak reference: a lookup per module call (a WeakSet builds a weakref per test).
        self._seen: dict[int, weakref.ref] = {}
        self._optimizers: dict[int, weakref.ref] = {}
        self.calls = GlobalPreHook(self._pre)  # paused for a step that needs no module call seen
        self._opt_handle: Any = None
        self._looked = False  # the optimizers of the first module called were looked for

    def install(self) -> None:
        self.calls.install()
        self._opt_handle = register_optimizer_step_pre_hook(self._optimizer_step)
        for r in list(self._optimizers.values()):  # installed again: state its steps made meanwhile counts too
            opt = r()
            if opt is not None:
                self.meter.track(opt)

    def uninstall(self) -> None:
        self.calls.remove()
        if self._opt_handle is not None:
            self._opt_handle.remove()
            self._opt_handle = None

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any = (), kwargs: Any = None) -> None:
        if self.on_optimizer_step is not None:
            self.on_optimizer_step()
        r = self._optimizers.get(id(optimizer))
        if r is not None and r() is optimizer:
            return
        k = id(optimizer)
        self._optimizers[k] = weakref.ref(optimizer, lambda _: self._optimizers.pop(k, None))
        self.meter.track(optimizer)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self.on_call(module)
        seen = self._seen
        r = seen.get(id(module))
        if r is not None and r() is module:
            return
        slots = self.produced.slots
        fixed = []
        for m in module.modules():
            seen[id(m)] = weakref.ref(m, lambda _, k=id(m): self._forget(k))
            params = m._parameters.values()
            for t in (*params, *m._buffers.values(), *(p.grad for p in params if p is not None)):
                if t is not None:
                    fixed.append(t)
                    slot = slots.pop(id(t.untyped_storage()), None)
                    if slot is not None:
                        slot.node = slot.entry = None
        self.meter.track(*fixed)
        if not self._looked:
            self._looked = True
            for o in optimizers_of(module):
                self._optimizer_step(o)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers seen stepping the model (or found at its first call) that are still alive."""
        return [o for r in list(self._optimizers.values()) if (o := r()) is not None]

    def modules(self) -> list[torch.nn.Module]:
        """The modules called so far that are still alive."""
        return [m for r in list(self._seen.values()) if (m := r()) is not None]

    def _forget(self, k: int) -> None:
        r = self._seen.get(k)
        if r is not None and r() is None:
            del self._seen[k]

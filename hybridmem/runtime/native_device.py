"""The budget caps what the allocator holds: the native allocator device, wired into a runtime.

On the CPU, with a budget or a plan, the runtime installs hybridmem's wrapper around PyTorch's CPU
allocator (:mod:`hybridmem.native.cpumeter`) as the managed device:

- its bytes are every allocation of the process made through the allocator (kernel scratch and oneDNN
  buffers included) plus the training state from before it was installed: the parameters, buffers and
  gradients of the modules the step calls, and the saved inputs (the first batch). ``enable(budget=None)``
  counts the same, so its peak is in the units the budget caps;
- the allocator enforces the budget at allocation time: an allocation that would cross it first frees
  registered saved activations (those recompute can rebuild, whose storage only the runtime references),
  then raises ``torch.OutOfMemoryError``; the runtime catches it around the op, evicts with every policy
  and retries, and raises an OOM naming the smallest budget that could work when nothing more can go.

The runtime still evicts at op boundaries (its scorer, a plan's stages) from an estimate of each op's
new bytes; the allocator catches what no estimate saw. On CUDA, where the native library was built
against CUDA, the same registry answers the caching allocator's free-memory callback (a cache miss
before ``cudaMalloc``) and ``torch.cuda.set_per_process_memory_fraction`` is the backstop; elsewhere the
CUDA budget is enforced at op boundaries and by that backstop only, which ``stats().notes`` says.

On CUDA the device changes the caching allocator's process-wide settings (expandable segments, the
memory fraction) and puts them back as they were at uninstall (:class:`~.allocconf.SavedAllocator`). The
callback frees down to the budget less a headroom of at least two expandable-segment roundings plus the
workspace room, and the dispatch mode keeps as much free at each op (``Residency.reserve``; a quarter of
the budget at most): the fraction cap is checked on reserved bytes with that rounding added, and a miss
past it makes the allocator release its whole cache (a device synchronisation). A forked child of a CUDA-initialised
process (a DataLoader worker) cannot call CUDA: its release leaves the allocator alone.
"""
from __future__ import annotations

from typing import Any

import torch

from hybridmem.plugins.base import PolicyHints

from ..native.allocconf import EXPANDABLE_SLACK, SavedAllocator
from ..native.cpumeter import cuda_note, load, unavailable_reason
from .entry import Entry
from .meter import cap_cuda
from .parts import DeviceRuntime
from .residency import Residency

NOTE_CPU = "budget: the CPU allocator's bytes (native device: kernel scratch counted, enforced at allocation time)"
NOTE_PEAK = ("peak: torch.cuda.max_memory_allocated is left as it was at enable (it held a peak from before): "
             "stats().peak_bytes reads it, an upper bound, until hybridmem.reset_stats()")


def cuda_usable() -> bool:
    """False in a forked child of a CUDA-initialised process, where any CUDA call raises."""
    return not torch.cuda._is_in_bad_fork()


def cuda_headroom(res: Residency) -> int:
    """Room the free-memory callback keeps under the budget: the workspace room plus the larger of the
    slack and two expandable-segment roundings (a miss checks reserved bytes plus one rounding against the
    fraction cap; the request itself may need another)."""
    return res.workspace + max(res.slack, 2 * EXPANDABLE_SLACK)


class NativeDevice:
    """Installs the native allocator device for one runtime (see the module docstring)."""

    def __init__(self, native: Any, rt: DeviceRuntime):
        self.native = native
        self.rt = rt
        self.cuda = rt.device.type == "cuda"
        self.saved: SavedAllocator | None = None  # the allocator's settings before install (CUDA)
        self._installed = False                     # installed before (a session's outer runtime, again)

    def install(self) -> None:
        rt, native = self.rt, self.native
        if self.cuda:
            # a cache miss frees down to the budget less this (the miss may be a workspace: the hook does not
            # see the request's size)
            native.set_cuda_budget(rt.device.index or 0, rt.budget, cuda_headroom(rt.residency))
            # and so does the dispatch mode at each op (a quarter of the budget at most: a tiny budget still runs)
            res = rt.residency
            res.reserve = max(res.reserve, min(res.workspace + 2 * EXPANDABLE_SLACK, rt.budget // 4))
            self.saved = SavedAllocator.now(rt.device)
            # The backstop: the caching allocator itself refuses memory past the budget (reserved bytes).
            rt.stats.note(cap_cuda(rt.device, rt.budget, rt.cfg.extra.get("expandable", True)))
            counters = rt.meter.cuda
            if not self._installed and counters is not None and counters.peak() > counters.allocated():
                # enable() leaves the user's reading alone (the meter's next reset_peak is the runtime's own);
                # a later reset_stats() resets it, as asked
                rt.meter.keep_allocator_peak = True
                rt.stats.note(NOTE_PEAK)
            self._installed = True
        else:
            native.acquire()
            rt.meter.attach_native(native)
            rt.store.count_external = rt.meter.count_late
            native.set_budget(rt.budget)
        rt.meter.on_pressure = rt.residency.relieve_oom
        rt.meter.on_exhausted = rt.residency.exhausted
        rt.store.native = native
        rt.fsdp_sync.on_gather = self._gathered

    def lift(self, lifted: bool) -> None:
        """Take the cap off (a step the budget could not hold goes on to measure what it needs:
        runtime.survey), or put it back."""
        rt, native = self.rt, self.native
        if self.cuda:
            idx = rt.device.index or 0
            if lifted:
                native.set_cuda_budget(idx, None)
                # uncapped means as the user capped it (their own fraction), not past it
                torch.cuda.set_per_process_memory_fraction(self.saved.fraction if self.saved else 1.0, rt.device)
            else:
                native.set_cuda_budget(idx, rt.budget, cuda_headroom(rt.residency))
                cap_cuda(rt.device, rt.budget, rt.cfg.extra.get("expandable", True))
        else:
            native.set_budget(None if lifted else rt.budget)

    def soften(self, on: bool) -> None:
        """The cap of a steady-state step (no op hook to recover in): on the CPU a refusal goes through and is
        noted for the runtime's next hook (:meth:`let_through`). On CUDA the caching allocator raises it."""
        if not self.cuda:
            self.native.set_soft(on)

    def let_through(self) -> tuple[int, int, int]:
        """``(count, bytes, held)`` of the refusals :meth:`soften` let through since the last call."""
        return (0, 0, 0) if self.cuda else self.native.soft_take()

    def _gathered(self, nbytes: int) -> None:
        # FSDP's next unshard allocates this much again by resize_ (no op, no chance to make room then),
        # and its all-gather buffer as much: keep twice it free at op boundaries
        res = self.rt.residency
        res.reserve = max(res.reserve, 2 * nbytes)

    def uninstall(self) -> None:
        rt, native = self.rt, self.native
        rt.store.unregister_all()
        rt.store.native = None
        rt.fsdp_sync.on_gather = None
        if self.cuda:
            native.set_cuda_budget(rt.device.index or 0, None)
            rt.meter.keep_allocator_peak = False
            saved, self.saved = self.saved, None
            if saved is not None and cuda_usable():  # a forked child has no CUDA to restore (and cannot call it)
                saved.restore()
        else:
            native.set_soft(False)
            native.set_budget(None)
            rt.store.count_external = None
            rt.meter.detach_native()
            native.release()


def native_device(rt: DeviceRuntime, manages: bool) -> NativeDevice | None:
    """The native device for ``rt`` when it manages a budget and the library builds here, else None (and a
    note in the stats saying what the budget then counts)."""
    if not manages or rt.budget is None:
        return None

    native = load()
    if native is None:
        rt.stats.note(f"budget: storages counted at op boundaries, kernel scratch not seen (the native "
                      f"allocator device is not available: {unavailable_reason()})")
        return None
    if rt.device.type == "cuda" and not native.cuda_hook:
        rt.stats.note(f"budget: enforced at op boundaries only (no CUDA caching-allocator hook: {cuda_note()})")
        return None
    if rt.device.type == "cpu":
        rt.stats.note(NOTE_CPU)
    if "recompute" in rt.policies:
        rt.store.registrable = _registrable(rt.policies["recompute"], rt.residency.hints["recompute"])
    return NativeDevice(native, rt)


def _registrable(policy: Any, hints: PolicyHints) -> Any:
    """Which new entries the allocator may free (recompute can rebuild them), cheapest per byte first."""
    fused = hints.registration_cost
    if fused is not None:
        def fast(e: Entry) -> float | None:
            cost = fused(e)
            return None if cost is None else cost / max(e.nbytes, 1)
        return fast

    def priority(e: Entry) -> float | None:
        if not policy.applicable(e):
            return None
        return policy.cost(e) / max(e.nbytes, 1)
    return priority

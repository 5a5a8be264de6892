"""The budget caps what the allocator holds: the native allocator device, wired into a runtime.

On the CPU, with a budget or a plan, the runtime installs hybridmem's wrapper around PyTorch's CPU
allocator (:mod:`hybridmem.runtime.cpumeter`) as the managed device:

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
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .cpumeter import cuda_note, load, unavailable_reason
from .entry import Entry
from .meter import cap_cuda

if TYPE_CHECKING:
    from .core import Runtime

NOTE_CPU = "budget: the CPU allocator's bytes (native device: kernel scratch counted, enforced at allocation time)"


class NativeDevice:
    """Installs the native allocator device for one runtime (see the module docstring)."""

    def __init__(self, native: Any, rt: "Runtime"):
        self.native = native
        self.rt = rt
        self.cuda = rt.device.type == "cuda"

    def install(self) -> None:
        rt, native = self.rt, self.native
        if self.cuda:
            # a cache miss frees down to the budget less this: the slack, and the room kept for a workspace
            # (the miss may be one: the hook does not see the request's size)
            native.set_cuda_budget(rt.device.index or 0, rt.budget, rt.residency.slack + rt.residency.workspace)
            # The backstop: the caching allocator itself refuses memory past the budget (reserved bytes).
            rt.stats.note(cap_cuda(rt.device, rt.budget, rt.cfg.extra.get("expandable", True)))
        else:
            native.install()
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
                torch.cuda.set_per_process_memory_fraction(1.0, rt.device)
            else:
                native.set_cuda_budget(idx, rt.budget, rt.residency.slack + rt.residency.workspace)
                cap_cuda(rt.device, rt.budget, rt.cfg.extra.get("expandable", True))
        else:
            native.set_budget(None if lifted else rt.budget)

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
            torch.cuda.set_per_process_memory_fraction(1.0, rt.device)
        else:
            native.set_budget(None)
            rt.store.count_external = None
            rt.meter.detach_native()
            native.uninstall()


def native_device(rt: "Runtime", manages: bool) -> NativeDevice | None:
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
        rt.store.registrable = _registrable(rt.policies["recompute"])
    return NativeDevice(native, rt)


# Added to the allocator priority of what a followed plan keeps (priorities are seconds per byte, far
# below 1): the allocator frees every entry the plan recomputes before any of those.
PLAN_KEEPS_LAST = 1.0


def planned_first(registrable: Any, recomputed: set[Any]) -> Any:
    """``registrable`` with the entries whose lineage is in ``recomputed`` (what a followed plan evicts by
    recompute) ahead of all others in the allocator's order, each group in its own order. The others stay
    registered: where real bytes need more than the plan frees, the allocator goes on with them."""
    def priority(e: Entry) -> float | None:
        p = registrable(e)
        if p is None or e.lineage in recomputed:
            return p
        return p + PLAN_KEEPS_LAST
    return priority


def _registrable(policy: Any) -> Any:
    """Which new entries the allocator may free (recompute can rebuild them), cheapest per byte first."""
    fused = getattr(policy, "registration_cost", None)
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

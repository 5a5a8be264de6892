"""Monitor-only with nothing per op in Python: the allocator's own counters instead of a dispatch mode.

``enable(budget=None)`` on the CPU measures through :mod:`hybridmem.native.cpumeter` (a C++ wrapper around
PyTorch's CPU allocator) when it builds here: no dispatch mode, so an op costs what it costs without
hybridmem. What Python still does is per saved tensor and per module call, not per op:

- a saved-tensor hooks pair counts each activation storage once per step (``Stats.saved_bytes``): a
  storage the allocator handed out after the step's first module call (or, without modules, after the
  previous backward) is an activation; parameters, buffers and the batch made before are not. It also
  checks version counters at unpack (saved-tensor hooks switch off PyTorch's own in-place check);
- a global module pre-hook starts steps (as the op-level monitor does) and counts the parameters and
  buffers allocated before ``enable()``, which the allocator never saw, once each while they live;
- the first unpack of a backward pass queues the engine callback that ends the step.

A step whose inputs match those of a step watched whole (their shapes, dtypes and devices, the other
arguments' values, training mode and autocast: :func:`signature`) runs with none of that: the runtime's
saved-tensor hooks come off autograd's stack and the global module pre-hook off torch's table
(:mod:`.hookless`), the backward pass is seen at the root module's outputs and its first trainable parameter,
and the step counts what the watched step of those inputs saved. Peaks and current bytes stay the allocator's
own. The model's inputs made before ``enable()`` are counted at its call; a step that saves another tensor from
before ``enable()`` for the first time (a loss target made before it) is not such a model step, as its save is
what counts those bytes. A model whose saved bytes change with the values in its batch (data-dependent routing)
is reported with the saved bytes of the last watched step of its inputs' shapes.

Semantics (``Stats``): ``peak_bytes``/``current_bytes`` are the bytes PyTorch's CPU allocator handed out
and still holds (every thread: the allocator is process-wide), plus the training state from before
``enable()``, counted by the native device as external bytes: the parameters and buffers of the modules
the step calls, their gradients (kept from the step before, as gradient accumulation does), the state of
the optimizers that step them, and the batch: the same units a budget caps (:mod:`.device`). Unlike the
op-level monitor (``monitor="ops"``), this includes scratch memory kernels allocate inside an op and not
tensors made before ``enable()`` that are no training state; stages and ``min_budget_bytes`` are not
measured (both need every op).

**CUDA** (:class:`CudaAllocatorView`): the same hooks over the caching allocator's counters, read in C
(:mod:`.counters`): ``peak_bytes`` is ``torch.cuda.max_memory_allocated`` since ``enable()``, which counts
everything on the device, so nothing is added as external. Without allocation serials, a saved CUDA tensor
is an activation unless its storage is module state or the batch (the step's first module call's tensors).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from ..native.counters import CudaCounters
from ..native.cpumeter import CpuAllocatorMeter
from ..native.external import ExternalBytes
from ..graph.stepparts import optimizers_of
from .distributed import is_parameter_view, is_traceable_wrapper_subclass, plain_storages
from .hookless import GlobalPreHook, Hookless, RootHooks
from .saved import Kept, keep
from .stats import StatsRecorder
from .steps import BACKWARD, FORWARD, IDLE, StepTracker, _task_id
from .threads import OwnerThread, let_go

Tensor = torch.Tensor
_top = torch._C._autograd._top_saved_tensors_default_hooks
PROFILES = 256  # input signatures whose saved bytes are kept (per-batch padding: one per length)
NOTE = ("monitor: CPU allocator (native meter, no per-op hook): stages and min_budget_bytes are not "
        "measured; monitor='ops' measures them, per op (min_budget_bytes: a lower bound, what no budget could "
        "evict at the tightest op)")
NOTE_CUDA = ("monitor: CUDA caching allocator's counters (no per-op hook): stages and min_budget_bytes are not "
             "measured; monitor='ops' measures them, per op (min_budget_bytes: a lower bound, what no budget could "
             "evict at the tightest op)")


class CudaAllocatorView:
    """The CUDA caching allocator as the monitor's device: its counters, nothing to install; everything on
    the device is in its count already (no external bytes), and its allocations carry no serial."""

    serial = 0

    def __init__(self, device: torch.device, counters: CudaCounters):
        self.device, self.counters = device, counters

    def install(self) -> None:
        pass

    def uninstall(self) -> None:
        pass

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def peak_bytes(self) -> int:
        return self.counters.peak()

    @property
    def current_bytes(self) -> int:
        return self.counters.allocated()

    def add_external(self, nbytes: int) -> None:
        pass

    @staticmethod
    def serial_of_fn(ptr: int) -> int:
        return -1


class AllocatorMonitor:
    """Install/uninstall the native meter, the counting hooks and the step hook (see the module docstring)."""

    def __init__(self, native: CpuAllocatorMeter | CudaAllocatorView, stats: StatsRecorder) -> None:
        self.native = native
        self._serial_of = native.serial_of_fn  # the C function itself: the pack hook's one native call
        self.cuda: torch.device | None = native.device if isinstance(native, CudaAllocatorView) else None
        self._static: set[int] | None = None  # CUDA: data pointers of module state and of the step's batch
        self._batch: set[int] = set()    # ... of the step's batch
        self.stats = stats
        self.steps = StepTracker(self._step_started, self._step_ended)
        self.step_serial = 1             # allocations with a serial >= this are the current step's
        self._seen: set[int] = set()     # data pointers of the storages saved in the current step
        # state from before enable() (module state, the first batch), counted against the meter while it lives
        self.external = ExternalBytes()
        self._modules: dict[int, weakref.ref] = {}  # modules whose state was looked at
        self._frozen: tuple[int, int] | None = None  # (peak, current) at uninstall
        self._floor = 0                  # peak before an inner session reset the native peak
        self._hooks: Any = None
        self.calls = GlobalPreHook(self._module_called)  # paused for a step run without hooks
        self._opt_handle: Any = None
        self._optimizers: dict[int, weakref.ref] = {}  # optimizers whose state was looked at
        self.owner = OwnerThread()
        # steps of inputs watched before run without the hooks (module docstring)
        self.hookless = Hookless(self.pack, self.unpack, self.steps.backward_seen)
        self.root_hooks = RootHooks(self.hookless, self._root_called, self._root_returned)
        self._fresh = False              # a step started at the root's call, its inputs not looked at yet
        self._signature: tuple | None = None    # of the step going on, where the root's call started it
        self._added = 0                  # external storages counted when it started
        self._profiles: dict[tuple, tuple[int, int]] = {}  # signature -> (saved bytes, storages) of a whole step
        self._following: tuple[int, int] | None = None     # the profile a step without hooks counts

    # ---- install / uninstall -----------------------------------------------------------------
    def install(self, reset_peak: bool = True) -> None:
        self.owner.claim()
        self.native.acquire()
        if reset_peak:
            self.native.reset_peak()
            self._floor = 0
        elif self._frozen is not None:
            self._floor = max(self._floor, self._frozen[0])
        self._frozen = None
        self.step_serial = self.native.serial + 1  # the serial the next allocation gets
        self.external.attach(self.native)  # module state seen before (a session inside ours)
        self.calls.install()
        self._opt_handle = register_optimizer_step_pre_hook(self._optimizer_stepping)
        for r in list(self._optimizers.values()):  # installed again: state its steps made meanwhile counts too
            opt = r()
            if opt is not None:
                self._state(t for state in opt.state.values() for t in state.values() if isinstance(t, Tensor))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        self.root_hooks.on()  # installed again: the root's hooks go back before its next call

    def uninstall(self) -> None:
        if self._hooks is None:
            return
        self.hookless.restore()  # after a step run without the hooks: they go back first, then off
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] != self.pack:
            raise RuntimeError("hybridmem.disable() called inside another saved_tensors_hooks context "
                               "(e.g. torch.autograd.graph.save_on_cpu) opened after enable(): leave it first")
        self._hooks.__exit__(None, None, None)
        self._detach()

    def release(self) -> None:
        """``uninstall`` from another thread than the installing one (see ``Runtime.release``)."""
        if self._hooks is None:
            return
        let_go(self.owner, self.pack)
        self._detach()

    def _detach(self) -> None:
        self._hooks = None
        self.calls.remove()
        self._opt_handle.remove()
        self._opt_handle = None
        self.root_hooks.off()  # the root is held weakly, its hooks go back at the next install
        self._following = None
        self.hookless.active = self.hookless.off = False  # off another thread's stack by then (release)
        self._frozen = (self.peak_bytes, self.current_bytes)
        self.external.detach()
        self.native.release()

    # ---- measurements ------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int:
        if self._frozen is not None:
            return self._frozen[0]
        return max(self._floor, self.native.peak_bytes)

    @property
    def current_bytes(self) -> int:
        if self._frozen is not None:
            return self._frozen[1]
        return self.native.current_bytes

    def reset_peak(self) -> None:
        self._floor = 0
        if self._frozen is not None:
            self._frozen = (self._frozen[1], self._frozen[1])
        else:
            self.native.reset_peak()

    # ---- hooks -------------------------------------------------------------------------------
    def pack(self, t: Tensor) -> Any:
        if self._hooks is None:
            return t  # left on a thread by a release elsewhere: counts nothing (the meter is someone else's now)
        if type(t) is not Tensor and is_traceable_wrapper_subclass(t):
            return keep(t)  # DTensor: not counted here
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return t  # sparse, nested: nothing to count
        steps = self.steps
        if steps.phase == IDLE and _task_id() == -1:
            steps.saved_seen()  # a program that calls no module: the step starts here
        ptr = st.data_ptr()
        seen = self._seen
        if ptr not in seen:
            seen.add(ptr)  # one look per storage and step
            if self.cuda is not None:
                static = self._static
                if static is None:  # the step's first save: module state as it is now (a step without saves
                    static = self._static = self._state_ptrs() | self._batch  # or hooks needs none)
                if t.device == self.cuda and ptr not in static and not is_parameter_view(t):
                    self.stats.saved(st.nbytes())
            else:
                serial = self._serial_of(ptr)
                if t.is_cpu and serial >= self.step_serial and not is_parameter_view(t):
                    self.stats.saved(st.nbytes())
                elif serial < 0 and t.is_cpu:  # made before enable() (the first batch): the allocator never saw it
                    self.external.add(st, st.nbytes())
        return keep(t)

    def unpack(self, h: Any) -> Tensor:
        if self._hooks is not None and self.steps.phase != BACKWARD and _task_id() != -1:
            self.steps.backward_seen()  # queues the engine callback that ends the step
        if type(h) is Kept:
            return h.read()
        return h

    def _module_called(self, module: torch.nn.Module, args: Any) -> None:
        if not self.owner.here():  # its saved tensors are not counted there (hooks are per thread)
            self.owner.foreign_module_call()
            return
        starts = self.steps.phase != FORWARD
        self.steps.module_called()
        if starts and self.steps.phase == FORWARD:  # a step starts here
            if self.cuda is not None:
                # the batch is no activation (on the CPU its serial says so)
                self._batch.update(a.untyped_storage().data_ptr() for a in args if isinstance(a, Tensor))
            root = self.root_hooks.module()
            if root is None:  # its hooks run from its next call on (torch reads a module's hooks before them)
                self.root_hooks.attach(module)
                root = module
            self._fresh = root is module
        r = self._modules.get(id(module))
        if r is not None and r() is module:
            return
        if not self._modules and self.cuda is None:  # the first module called: its optimizers' state too
            for o in optimizers_of(module):
                self._optimizer_step(o)
        for m in module.modules():
            self._modules[id(m)] = weakref.ref(m, lambda _, k=id(m): self._modules.pop(k, None))
            params = m._parameters.values()
            self._state(t for t in (*params, *m._buffers.values(),
                                    *(p.grad for p in params if p is not None)) if t is not None)

    # ---- steps without hooks (module docstring) -----------------------------------------------
    def _root_returned(self, m: torch.nn.Module, args: tuple, out: Any) -> None:
        if self._hooks is not None and self.owner.here():
            top = _top(False)  # a context above the hooks: its reads are no unpack of ours (see the end)
            self.hookless.root_returned(out, watch=top is not None and top[0] != self.pack)

    def _root_called(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._hooks is None or not self.owner.here():
            return
        if self.calls.paused:
            # a step run without hooks that has not ended: its forward raised (this call continues it, as a
            # watched step would), or it calls the model again; module calls are seen again from here
            self.calls.resume(module, args)
        if not self._fresh:
            return
        self._fresh = False
        top = _top(False)
        if top is None or top[0] != self.pack:
            return  # a context opened above the hooks takes the step's saves: no step to repeat
        leaves = tree_leaves((args, kwargs))
        if self.cuda is None:
            # the batch, where made before enable() (the allocator never saw it): counted here, with or without
            # the hooks, so that a step saving it is no step that counts state no earlier one showed
            self._state(a for a in leaves if isinstance(a, Tensor))
        else:  # the batch is no activation, keyword arguments too (the global pre-hook sees none)
            batch = [a.untyped_storage().data_ptr() for a in leaves if isinstance(a, Tensor)]
            self._batch.update(batch)
            if self._static is not None:
                self._static.update(batch)
        sig = self._signature = signature(module, args, kwargs, leaves)
        self._added = self.external.added
        got = self._profiles.get(sig)
        if got is not None and self.hookless.start():
            self._following = got
            self.calls.pause()  # torch calls each module's forward directly; the step's end puts the hook back

    def _optimizer_stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook: a step as the user counts them; the optimizer's state looked at."""
        self.stats.optimizer_stepped()
        self._optimizer_step(optimizer)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The state of an optimizer made before ``enable()`` is training state the allocator never saw
        (counted once per optimizer; later state is allocated through it)."""
        r = self._optimizers.get(id(optimizer))
        if r is not None and r() is optimizer:
            return
        self._optimizers[id(optimizer)] = weakref.ref(optimizer, lambda _, k=id(optimizer): self._optimizers.pop(k, None))
        self._state(t for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor))

    def _state(self, tensors: Any) -> None:
        """Training state: on the CPU counted where allocated before ``enable()`` (the allocator never saw it);
        on CUDA noted as no activation (the caching allocator counts it already)."""
        for t in tensors:
            for st in plain_storages(t):  # a DTensor's bytes are in its local shard
                if self.cuda is not None:
                    if t.device == self.cuda and self._static is not None:  # else counted at the step's first save
                        self._static.add(st.data_ptr())
                elif t.is_cpu:
                    self.external.count(st)  # where the meter did not allocate it (counted once)

    def _state_ptrs(self) -> set[int]:
        """CUDA: data pointers of the parameters, buffers and gradients of the modules seen, alive now."""
        out: set[int] = set()
        for r in list(self._modules.values()):
            m = r()
            if m is not None:
                for t in (*m._parameters.values(), *m._buffers.values()):
                    if t is not None and t.device == self.cuda:
                        out.add(t.untyped_storage().data_ptr())
                        if t.grad is not None:
                            out.add(t.grad.untyped_storage().data_ptr())
        return out

    # ---- steps -------------------------------------------------------------------------------
    def _step_started(self) -> None:
        if self.hookless.off and self.owner.here():
            self.hookless.restore()  # a step run without the hooks before: this one decides again
        self._signature, self._fresh = None, False
        self._seen.clear()
        if self.cuda is not None:
            # the last step's batch goes; this step's is added at its call, the state at its first save
            self._static, self._batch = None, set()
        if self.steps.modules:
            # the next allocation's serial (``serial`` is the last one's): the batch and the weights come before
            self.step_serial = self.native.serial + 1
        self.stats.step_started()

    def _step_ended(self, stages: int) -> None:
        stats = self.stats
        if self.hookless.active:
            self.hookless.step_ended()
            self.calls.resume()
            if self._following is not None:
                stats.saved_bytes_step, stats.saved_tensors_step = self._following  # what its inputs' step saved
        elif self._signature is not None and self.external.added == self._added:
            profiles = self._profiles
            if len(profiles) >= PROFILES and self._signature not in profiles:
                del profiles[next(iter(profiles))]
            profiles[self._signature] = (stats.saved_bytes_step, stats.saved_tensors_step)
        self._signature = self._following = None
        stats.step_done(0)  # stages are not counted without an op hook
        if not self.steps.modules:
            self.step_serial = self.native.serial + 1


def signature(module: torch.nn.Module, args: tuple, kwargs: dict, leaves: list[Any] | None = None) -> tuple:
    """What decides the tensors a step of ``module`` saves, besides its code: how many positional arguments and
    which keywords it takes; its arguments' leaves (``leaves``: ``tree_leaves((args, kwargs))``): the tensors'
    shapes, dtypes and devices, the other values (their types where they have no plain value); its training
    mode, and autocast."""
    key: list[Any] = [module.training, torch._C._is_any_autocast_enabled(), len(args), *kwargs]
    for a in tree_leaves((args, kwargs)) if leaves is None else leaves:
        if isinstance(a, Tensor):
            key.append((a.shape, a.dtype, a.device, a.requires_grad))
        elif a is None or type(a) in (bool, int, float, str):
            key.append(a)
        else:
            key.append(type(a))
    return tuple(key)

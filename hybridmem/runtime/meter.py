"""Device memory meter: how many bytes the managed device holds now, at its peak, and against a budget.

    with Meter(device="cpu") as m:
        loss = model(x).sum(); loss.backward()
    m.peak_bytes

**CUDA.** ``current_bytes`` is the caching allocator's allocated bytes (``torch.cuda.memory_allocated``),
``peak_bytes`` their peak (``max_memory_allocated``; reset by ``reset_peak()`` and on entering the meter,
except once after ``keep_allocator_peak`` is set: the runtime's enable leaves the user's reading alone),
both read in C where hybridmem's native library has its CUDA hook (:mod:`.counters`). To make
the budget a real cap, call :meth:`Meter.apply_cuda_cap` (the caching allocator then raises
``torch.OutOfMemoryError`` beyond it). Allocation failures reach the runtime in two ways: every op
run under :class:`MeterMode` (entered by the meter when ``on_pressure`` or a budget is set) is retried
through :meth:`Meter.retry_oom`, which calls ``on_pressure(bytes the allocator tried to get)`` and
retries while something is freed; an allocation the runtime makes itself outside an op (a swap-in
buffer) should go through the same helper: ``meter.retry_oom(torch.empty, n, device=dev)``.

**CPU and meta: a simulated device.** The meter counts the live bytes of the storages it *tracks*:

- every storage an op returns that the meter has not seen (a new allocation) while a
  :class:`MeterMode` of this meter is active;
- every storage first seen as an op *input* (any tensor argument, also inside lists and ``out=``)
  while the mode is active: parameters, buffers, inputs, optimizer state. They are registered on
  first sight and count from then on;
- tensors passed to :meth:`Meter.track` (e.g. the model and inputs before the step, so that the
  meter counts them from the start, as ``Graph.fixed_bytes`` does).

A storage counts once however many tensors view it (keyed by ``t.untyped_storage()``, the same Python
object for a tensor and all its views) and counts ``storage.nbytes()`` bytes, until the storage is
freed (a weak reference callback on the storage object subtracts it; PyTorch keeps the storage's
Python object alive exactly as long as the storage). ``peak_bytes`` is the largest ``current_bytes``
sampled right after each op's outputs are registered, while the op's inputs are still alive (and
after ``track``): the memory model of :mod:`hybridmem.graph`. Frees between ops are applied at once;
peaks are only sampled at op ends. Allocations *inside* a kernel that it frees before returning
(workspaces, e.g. im2col buffers of a CPU convolution) are invisible at op boundaries and not
counted; ops run inside the mode's own hooks or inside ``on_pressure`` are not metered (PyTorch
disables a dispatch mode while its handler runs), so call :meth:`Meter.track` for device tensors
allocated there.

**CPU: the allocator as the device** (:meth:`Meter.attach_native`). The runtime gives the meter the native
allocator device (:mod:`hybridmem.native.cpumeter`) when it builds: ``current_bytes``/``peak_bytes`` are then
what PyTorch's CPU allocator holds (kernel scratch included) plus the training state allocated before it
was installed (:meth:`Meter.count_external`: module state passed to :meth:`Meter.track`, saved inputs;
counted once each while they live), and the allocator itself enforces the budget at allocation time. The
storage ledger above stays for attribution (which op made which storage), not for the budget.

**Hard cap.** With ``budget`` and ``raise_on_exceed=True``, after every op the meter checks the
budget: if ``current_bytes`` exceeds it, ``on_pressure(needed_bytes) -> freed_bytes`` is called (if
set) and, if memory is still over budget, ``torch.OutOfMemoryError`` is raised, naming the bytes the
op requested, the bytes live and the budget: where a device of the budget's size would have failed to
allocate. :meth:`Meter.check` does the same check for an allocation the caller is about to make.
"""
from __future__ import annotations

import re
import weakref
from typing import Any, Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from ..graph.ops import op_info, written_tensors
from ..graph.outputs import output_tensors, storage_of
from ..native.allocconf import prefer_expandable_segments
from ..native.counters import CudaCounters, cuda_counters
from ..native.external import ExternalBytes
from .distributed import plain_storages
from ..graph.units import fmt_bytes, parse_bytes

Tensor = torch.Tensor
PressureHook = Callable[[int], int]

__all__ = ["Meter", "MeterMode", "StorageRef", "profiler_peak"]

_TRIED = re.compile(r"[Tt]ried to allocate\s+([0-9.]+\s*[KMGT]?i?B)")
_RETRIES = 8  # an op refused this often after evictions freed memory each time is out of memory
# hybridmem's native allocator device names the exact bytes requested and held at the refusal
_REFUSED = re.compile(r"Tried to allocate [^(]*\((\d+) bytes\) with [^(]*\((\d+) bytes\) held")


def _refusal(e: BaseException) -> tuple[int, int | None]:
    """What an allocator's OOM message says: the bytes it tried to allocate (1 where it names none), and
    the bytes held then where it names them (hybridmem's native device), else None."""
    exact = _REFUSED.search(str(e))
    if exact:
        return int(exact.group(1)), int(exact.group(2))
    m = _TRIED.search(str(e))
    return (parse_bytes(m.group(1).replace(" ", "")) if m else 1), None


def cap_cuda(device: torch.device, budget: int, expandable: bool = True) -> str:
    """Make the CUDA caching allocator refuse reserved bytes beyond ``budget``, from now on; returns a note on
    its segments (``expandable``: make new ones expandable unless the user chose, :mod:`.allocconf`).

    ``set_per_process_memory_fraction`` is checked only when the allocator asks the driver for a new
    segment: blocks it cached earlier (an unmanaged step before, a previous budget) would serve
    allocations past the budget unchecked, and its free-memory callbacks (hybridmem's hook) run only on
    a cache miss. Emptying the cache makes every byte past what is allocated now go through both. Runs
    once, when a budget is installed (it synchronises the device)."""
    note = prefer_expandable_segments() if expandable else "CUDA allocator: left as configured (expandable: false)"
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    torch.cuda.synchronize(device)  # blocks freed on side streams are released once their work is done
    torch.cuda.empty_cache()
    return note


class StorageRef(weakref.ref):
    """The meter's entry for one tracked storage: a weak reference (its callback subtracts the bytes
    when the storage is freed) carrying the storage's id and counted size. The runtime's produced
    table subclasses it, so that one weak reference per new storage serves both ledgers."""

    __slots__ = ("key", "nbytes")


class Meter:
    """Bytes live on one device, their peak, and an optional hard budget (see the module docstring).

    ``device``: ``"cpu"`` or ``"meta"`` (simulated device) or ``"cuda[:i]"`` (allocator statistics).
    ``budget``: bytes (int or ``"8GiB"``) or None. ``raise_on_exceed``: check the budget after every
    op and raise ``torch.OutOfMemoryError`` when it is exceeded. ``on_pressure(needed) -> freed`` is
    called before raising. ``mode_cls``: the :class:`MeterMode` subclass entering the meter installs.
    """

    def __init__(self, device: str | torch.device = "cpu", budget: int | str | None = None, *,
                 raise_on_exceed: bool = False, on_pressure: PressureHook | None = None,
                 mode_cls: type["MeterMode"] | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.simulated = self.device.type != "cuda"
        # the allocator's counters, read per op: natively where the library has its CUDA hook
        self.cuda: CudaCounters | None = None if self.simulated else cuda_counters(self.device)
        self._cuda_allocated: Callable[[], int] = self.cuda.allocated if self.cuda is not None else int
        self.budget_bytes: int | None = None if budget is None else parse_bytes(budget, what="budget")
        self.raise_on_exceed = raise_on_exceed
        self.on_pressure = on_pressure
        self.mode_cls = mode_cls or MeterMode
        # Simulated-device ledger: id(storage) -> StorageRef (a weak reference whose callback subtracts
        # its bytes). Keyed by id: the callback removes the entry before the id can be reused.
        self._live: dict[int, StorageRef] = {}
        self._freed_cb = self._freed  # one bound method for every reference (not one per storage)
        self._current = 0
        self._peak = 0
        self._relieving = False
        self.oom_retries = 0  # allocator refusals caught and retried (retry_oom, the mode's ops)
        # CUDA: the next reset_peak leaves torch's max_memory_allocated as it is (the user's reading)
        self.keep_allocator_peak = False
        self._mode: MeterMode | None = None
        self.native: Any = None                  # the native allocator device while attached
        self._frozen: tuple[int, int] | None = None  # its (peak, current) when detached
        self._native_current: Callable[[], int] = int
        self._floor = 0  # the peak before a detach: an inner session may reset the native peak meanwhile
        # storages from before the native device, counted against it while they live (native.external)
        self.external = ExternalBytes()
        self._external = self.external.bytes     # its id(storage) -> bytes, checked per save
        # the OOM to raise when nothing more can be freed: (bytes requested, what, bytes held or None); None
        # from it: the cap was lifted (runtime.survey) and the call runs again, uncapped
        self.on_exhausted: Callable[[int, str, int | None], BaseException | None] | None = None

    def attach_native(self, native: Any) -> None:
        """Read bytes from the native allocator device (:class:`hybridmem.native.cpumeter.CpuAllocatorMeter`),
        counting the storages from before its install that this meter has seen (again, after a detach)."""
        self.native = native
        self._native_current = native.current_fn  # read once or twice per op: the C function itself
        if self._frozen is not None:
            self._floor = max(self._floor, self._frozen[0])
        self._frozen = None
        self.external.attach(native)

    def detach_native(self) -> None:
        """Stop reading the native device; the bytes counted as external leave its count until attached."""
        native, self.native = self.native, None
        if native is None:
            return
        self._frozen = (native.peak_bytes, native.current_bytes)  # what stats() reports after disable()
        self.external.detach()

    # ---- readings ------------------------------------------------------------------------------
    @property
    def current_bytes(self) -> int:
        if self.native is not None:
            return self._native_current()
        if self._frozen is not None:
            return self._frozen[1]
        if self.simulated:
            return self._current
        return self._cuda_allocated()

    @property
    def peak_bytes(self) -> int:
        if self.native is not None:
            return max(self._floor, self.native.peak_bytes)
        if self._frozen is not None:
            return self._frozen[0]
        if self.simulated:
            return self._peak
        return self.cuda.peak()

    @property
    def live_storages(self) -> int:
        """Number of tracked storages alive (simulated device only; 0 on CUDA)."""
        return len(self._live)

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        self._floor = 0
        if self.native is not None:
            self.native.reset_peak()
        elif self._frozen is not None:
            self._frozen = (self._frozen[1], self._frozen[1])
        if self.simulated:
            self._peak = self._current
        elif self.keep_allocator_peak:
            self.keep_allocator_peak = False
        else:
            torch.cuda.reset_peak_memory_stats(self.device)

    # ---- tracking (simulated device) ----------------------------------------------------------
    def track(self, *objs: Any) -> int:
        """Count these tensors' storages from now on; accepts tensors, modules (parameters and buffers),
        optimizers (state), dicts and iterables of those. Returns the bytes newly counted."""
        if not self.simulated:
            return 0
        before = self._current
        for t in _tensors_in(objs):
            st = storage_of(t)
            if st is not None and id(st) not in self._live:
                self._add(st)
            if self.native is not None:
                # a DTensor's bytes are its local shard's: its own storage is a data-less stand-in
                for inner in ((st,) if type(t) in (Tensor, torch.nn.Parameter) else plain_storages(t)):
                    if inner is not None:
                        self.count_external(inner)
        if self._current > self._peak:
            self._peak = self._current
        return self._current - before

    def refresh(self, t: Tensor | torch.UntypedStorage) -> None:
        """Re-read the size of a tracked storage after ``storage.resize_()`` (not an op: not seen)."""
        st = t if isinstance(t, torch.UntypedStorage) else storage_of(t)
        if st is None or not self.simulated:
            return
        entry = self._live.get(id(st))
        if entry is None:
            self._add(st)
        else:
            nb = st.nbytes()
            self._current += nb - entry.nbytes
            entry.nbytes = nb
            self.external.resized(st)  # resized through its old allocator
        if self._current > self._peak:
            self._peak = self._current

    def _add(self, st: torch.UntypedStorage) -> int:
        # A weakref with a callback costs well under 1 us; weakref.finalize about 10x more (its registry).
        nb = st.nbytes()
        k = id(st)
        r = StorageRef(st, self._freed_cb)
        r.key, r.nbytes = k, nb
        self._live[k] = r
        self._current += nb
        return nb

    def count_external(self, st: torch.UntypedStorage) -> int:
        """With the native device: count a storage of the training state (module state, a saved input)
        that was allocated before the device was installed, while it lives; returns the bytes newly
        counted. Other storages an op merely reads (a model that is only copied) are not counted, as
        ``enable(budget=None)`` does not. Under a budget, room is made first (``on_pressure``): the bytes
        are held already, so counting them must not take the count past the cap."""
        if id(st) in self._external or not (nb := self.external.countable(st)):
            return 0  # counted already, no device attached, or allocated through the device
        budget = self.native.budget
        if budget is not None and self.current_bytes + nb > budget and self.on_pressure is not None \
                and not self._relieving:
            self._ask(nb)  # where nothing frees enough, the next allocation raises the OOM
        if id(st) not in self._live:
            self._add(st)
        self.external.add(st, nb)
        return nb

    def count_late(self, st: torch.UntypedStorage) -> int:
        """``count_external`` for a storage first met mid-step (saved by an op): returns by how much the
        count's peak so far may have read low against the budget (it held these bytes all along), else 0."""
        native = self.native
        if native is None:
            return 0
        peak, budget = native.peak_bytes, native.budget
        nb = self.count_external(st)
        return max(0, peak + nb - budget) if nb and budget is not None else 0

    def _freed(self, ref: StorageRef) -> None:
        # Weak-reference callback: the storage is being deallocated. Check identity: the id may
        # already belong to a new storage registered after this one died.
        live = self._live
        if live.get(ref.key) is ref:
            del live[ref.key]
            self._current -= ref.nbytes

    # ---- budget --------------------------------------------------------------------------------
    def check(self, extra_bytes: int = 0, *, what: str = "") -> None:
        """Raise ``torch.OutOfMemoryError`` if ``extra_bytes`` more would not fit the budget, after
        giving ``on_pressure`` the chance to free the difference. No-op without a budget."""
        budget = self.budget_bytes
        if budget is None or self.current_bytes + extra_bytes <= budget:
            return
        if self._relieve(extra_bytes):
            return
        self._raise(extra_bytes, self.current_bytes, what)

    def _relieve(self, extra_bytes: int) -> bool:
        """Ask ``on_pressure`` for the bytes over budget until it fits or nothing more is freed."""
        budget = self.budget_bytes
        assert budget is not None
        if self.on_pressure is None or self._relieving:
            return False
        self._relieving = True  # eviction code runs ops: do not recurse into the listener
        try:
            for _ in range(16):
                needed = self.current_bytes + extra_bytes - budget
                if needed <= 0:
                    return True
                if not self.on_pressure(needed):
                    break
            return self.current_bytes + extra_bytes <= budget
        finally:
            self._relieving = False

    def _ask(self, nbytes: int) -> Any:
        """``on_pressure(nbytes)``, once, with the listener shut: eviction code runs ops."""
        assert self.on_pressure is not None
        self._relieving = True
        try:
            return self.on_pressure(nbytes)
        finally:
            self._relieving = False

    def _raise(self, requested: int, live: int, what: str) -> None:
        where = f"simulated {self.device.type} device" if self.simulated else str(self.device)
        raise torch.OutOfMemoryError(
            f"hybridmem: {where} out of memory{f' in {what}' if what else ''}: tried to allocate "
            f"{fmt_bytes(requested)} ({requested} bytes) with {fmt_bytes(live)} ({live} bytes) live; "
            f"budget {fmt_bytes(self.budget_bytes or 0)} ({self.budget_bytes} bytes)")

    def _after_op_over(self, new_bytes: int, func: Any) -> None:
        """An op's outputs took the device over budget (called by MeterMode)."""
        if self._relieve(0):
            return
        self._raise(new_bytes, self.current_bytes - new_bytes, str(func))

    def retry_oom(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn``; if the allocator raises ``torch.OutOfMemoryError``, call ``on_pressure`` with
        the bytes it tried to allocate (parsed from the message, else 1) and retry while it frees
        something. This is how a real device's allocation failure reaches the runtime's evictor;
        :class:`MeterMode` wraps every op with it, so code outside ops (a swap-in copy) may call it
        directly: ``meter.retry_oom(torch.empty, n, device="cuda")``."""
        for attempt in range(_RETRIES):
            try:
                return fn(*args, **kwargs)
            except torch.OutOfMemoryError as e:
                if self.on_pressure is None or self._relieving:
                    raise
                self.oom_retries += 1
                needed, held = _refusal(e)
                last = attempt == _RETRIES - 1  # evicting freed memory each time and it still did not fit
                # What the op had allocated when it was refused is free again now, and the retry
                # allocates it once more: ask for room for that too.
                if last or not self._ask(needed if held is None else needed + max(0, held - self.current_bytes)):
                    if self.on_exhausted is None:
                        raise
                    exc = self.on_exhausted(needed, f"op {getattr(fn, '__name__', fn)}", None if last else held)
                    if exc is None:
                        return fn(*args, **kwargs)
                    try:
                        raise exc from e
                    finally:
                        exc = None  # no cycle through this frame (see Residency.refuse)
        raise AssertionError("unreachable")

    def apply_cuda_cap(self) -> None:
        """Make the CUDA caching allocator itself refuse memory beyond the budget
        (``torch.cuda.set_per_process_memory_fraction``; it caps *reserved* bytes, allocator cache
        included), so that a real allocation fails where a device of the budget's size would."""
        if self.simulated or self.budget_bytes is None:
            return
        cap_cuda(self.device, self.budget_bytes)

    # ---- context manager -----------------------------------------------------------------------
    def __enter__(self) -> "Meter":
        """Start a new peak window and (simulated device, or a CUDA budget to enforce) install the mode."""
        self.reset_peak()
        if self.simulated or (self.budget_bytes is not None and self.raise_on_exceed) or self.on_pressure:
            self._mode = self.mode_cls(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)

    def __repr__(self) -> str:
        b = "" if self.budget_bytes is None else f", budget={fmt_bytes(self.budget_bytes)}"
        return (f"Meter({self.device}, current={fmt_bytes(self.current_bytes)}, "
                f"peak={fmt_bytes(self.peak_bytes)}{b})")


class MeterMode(TorchDispatchMode):
    """The dispatch mode that meters each op for a :class:`Meter`.

    Subclass it to act around every op (the runtime does): override :meth:`before_op` and
    :meth:`after_op` and call ``super()``. ``before_op`` registers first-seen input storages;
    ``after_op`` registers new output storages, applies the budget and samples the peak. Ops run inside
    the hooks are not metered (PyTorch disables the mode while its handler runs).
    """

    def __init__(self, meter: Meter):
        super().__init__()
        self.meter = meter
        self._sim = meter.simulated
        self._live = meter._live

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps every subclass's __torch_dispatch__ in torch._disable_dynamo, which
        # imports torch._dynamo on the first op (2-9 s here) and adds a wrapper call to every op. The
        # meter runs eager steps only, so opt out (subclasses inherit this).
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.run_op(func, args, {} if kwargs is None else kwargs)

    def run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``before_op``, the op (on CUDA: evict and retry once on allocation failure), ``after_op``."""
        self.before_op(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except torch.OutOfMemoryError:
            if self.meter.on_pressure is None:
                raise
            out = self.meter.retry_oom(func, *args, **kwargs)
        self.after_op(func, args, kwargs, out)
        return out

    def before_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Called before each op. Base: register input storages seen for the first time."""
        if self._sim:
            _register_inputs(self.meter, self._live, args, kwargs)

    def after_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Called after each op with its outputs. Base: register new output storages, enforce the
        budget (``raise_on_exceed``) and sample the peak."""
        m = self.meter
        if self._sim:
            new = 0
            live = self._live
            for o in output_tensors(out):
                new += _register(m, live, o)
            if _may_resize(func):  # a written storage may have grown: re-read its size
                new += _reread_written(m, func, args, kwargs)
            if m.raise_on_exceed and m.budget_bytes is not None and m._current > m.budget_bytes:
                m._after_op_over(new, func)
            if m._current > m._peak:
                m._peak = m._current
        elif m.raise_on_exceed and m.budget_bytes is not None and m.current_bytes > m.budget_bytes:
            m._after_op_over(0, func)


_RESIZING: dict[int, bool] = {}  # by id(func): hashing an OpOverload runs Python


def _may_resize(func: Any) -> bool:
    r = _RESIZING.get(id(func))
    if r is None:
        r = _RESIZING[id(func)] = op_info(func).may_resize
    return r


def _reread_written(m: Meter, func: Any, args: tuple, kwargs: dict) -> int:
    """An op that may resize what it writes (``out=`` variants, ``resize_``) ran: re-read the sizes of
    its written storages; returns the bytes they grew by."""
    new = 0
    live = m._live
    for t in written_tensors(func, args, kwargs):
        st = storage_of(t)
        entry = live.get(id(st)) if st is not None else None
        if entry is not None and entry.nbytes != st.nbytes():
            new += st.nbytes() - entry.nbytes
            m.refresh(st)
    return new


def _register_inputs(m: Meter, live: dict, args: tuple, kwargs: dict) -> None:
    """Count the storages of an op's tensor arguments (also in lists and keyword arguments) that the
    meter sees for the first time. Plain tensors inline: this runs for every argument of every op."""
    for a in args:
        if type(a) is Tensor:
            try:
                st = a.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if id(st) not in live:
                m._add(st)
        elif isinstance(a, Tensor):
            _register(m, live, a)
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, Tensor):
                    _register(m, live, b)
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, Tensor):
                _register(m, live, a)


def _register(m: Meter, live: dict, t: Tensor) -> int:
    """Count ``t``'s storage if new; returns the bytes added. A traceable wrapper subclass (DTensor:
    FSDP2's sharded parameters and gradients) has a data-less storage of the *global* size, and the
    mode never sees its local ops: count the inner tensors' storages instead."""
    tp = type(t)
    if tp is Tensor or tp is torch.nn.Parameter:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return 0
        return m._add(st) if id(st) not in live else 0
    new = 0
    for st in plain_storages(t):
        if id(st) not in live:
            new += m._add(st)
    return new


def _tensors_in(objs: Iterable[Any]) -> Iterable[Tensor]:
    for o in objs:
        if isinstance(o, Tensor):
            yield o
        elif isinstance(o, torch.nn.Module):
            yield from o.parameters()
            yield from o.buffers()
            yield from (p.grad for p in o.parameters() if p.grad is not None)
        elif isinstance(o, torch.optim.Optimizer):
            for state in o.state.values():
                yield from _tensors_in(state.values())
        elif isinstance(o, dict):
            yield from _tensors_in(o.values())
        elif isinstance(o, (list, tuple, set)):
            yield from _tensors_in(o)


def profiler_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Peak of the CPU allocator's net allocation while ``fn`` runs, measured independently of the
    meter: ``torch.profiler`` with ``profile_memory=True`` records every allocation and free
    (``[memory]`` events, kernel workspaces included); their bytes summed in time order give the live
    total, whose maximum (relative to the start, so never below 0) is returned."""

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args, **kwargs)
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("torch.profiler returned no results (another profiler active?)")
    cpu = torch._C._autograd.DeviceType.CPU
    events = sorted((e for e in results.events() if e.name() == "[memory]" and e.device_type() == cpu),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        if live > peak:
            peak = live
    return peak

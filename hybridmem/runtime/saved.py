"""The saved-tensor hooks' state: one entry per saved activation storage, and small handles for autograd.

``pack`` turns a tensor autograd saves into a handle: a *kept* handle (the tensor itself, detached
from its node) for storages that existed before the runtime saw them (parameters, buffers, inputs,
tensors on another device), or a *saved* handle pointing to the storage's :class:`Entry` plus the
view (size, stride, offset, dtype) and the version counter the tensor had. Many saves of one storage
share one entry; the entry lives while handles do (autograd frees them with its nodes).

Without a budget or a plan nothing is ever evicted, so the runtime installs :meth:`SavedStore.pack_counting`
instead: it only counts each activation storage once per step for ``Stats.saved_bytes`` and keeps
the tensor (a *kept* handle): no entry, no view, no handle with a finalizer per save.

With the native allocator device (:mod:`hybridmem.native.cpumeter`), an entry that recompute can rebuild is
*registered* with the allocator once the device nears its budget (:meth:`SavedStore.register_pending`,
called by the dispatch mode; far below the budget nothing is registered, which costs nothing): from then
on the allocator may free its bytes at any allocation that would cross the budget, as long as only the
runtime references the storage. Before the
runtime reads a registered entry it *claims* it back (:meth:`SavedStore.claim`); an entry whose bytes
were freed is then recorded as evicted by recompute and regenerated like any other.

``unpack`` makes the entry resident (regenerating it if a policy evicted it), checks the version
counter (saved-tensor hooks switch off PyTorch's own check, so a saved tensor modified in place
would otherwise give silently wrong gradients) and rebuilds the view.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol

import torch

from ..graph.units import fmt_bytes
from .entry import Entry, new_entry

from .distributed import is_parameter_view, is_traceable_wrapper_subclass
from .lineage import View
from .replay import flat
from .activations import ProducedTable
from .stats import StatsRecorder
from .steps import Clock

Tensor = torch.Tensor
_use_count = torch._C._storage_Use_Count


def _calibrate_sole() -> int:
    """Storage use count when one tensor holds a storage whose Python object exists (it is kept
    alive with the storage once created, and counts as a reference)."""
    t = torch.empty(1)
    t.untyped_storage()
    return _use_count(t.untyped_storage()._cdata)


_SOLE = _calibrate_sole()
# New entries are registered with the allocator once less than budget / REGISTER_BELOW is free (the
# dispatch mode checks before each op, a steady-state step at each save): far from the budget, nothing is.
REGISTER_BELOW = 4


class Kept:
    """Handle of a storage the runtime does not manage: the tensor itself and its version."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor, version: int):
        self.tensor, self.version = tensor, version

    def read(self) -> Tensor:
        """The tensor, unless it was written in place since it was saved (PyTorch refuses that read)."""
        t = self.tensor
        if t._version != self.version:
            raise _modified(tuple(t.shape), t.dtype, "", self.version, t._version)
        return t


def keep(t: Tensor) -> Kept:
    """The handle of a saved tensor kept as it is. A tensor with a grad_fn is held as a detached alias (same
    version counter): holding it would keep its own node alive (a saved output forms a cycle through the
    hook's handle). Where a dispatch mode is active, :func:`keep_below_mode`."""
    if t.grad_fn is not None:
        t = t.detach()
    return Kept(t, t._version)


def keep_below_mode(t: Tensor) -> Kept:
    """:func:`keep` inside the runtime's dispatch mode: the detach runs below it (it is no op of the step)."""
    if t.grad_fn is not None:
        with torch._C._DisableTorchDispatch():
            t = t.detach()
    return Kept(t, t._version)


class Saved:
    """Handle of a managed saved tensor; dropping the last one releases the entry. ``view`` is None
    when the saved tensor has exactly the geometry of the entry's tensor."""

    __slots__ = ("store", "entry", "view", "version", "counter")

    def __init__(self, store: "SavedStore", entry: Entry, view: View, version: int, counter: Any):
        self.store, self.entry, self.view, self.version, self.counter = store, entry, view, version, counter

    def __del__(self) -> None:
        e = self.entry
        e.refs -= 1
        if e.refs == 0:
            try:
                self.store.release(e)
            except Exception:  # interpreter shutdown: modules half torn down, nothing left to free
                pass


class Keeper(Protocol):
    """What the store asks of the residency that evicts its entries (runtime.residency.Residency)."""

    def ensure(self, e: Entry) -> None: ...         # make an evicted entry resident again
    def discard(self, e: Entry) -> None: ...        # the last handle went: release what eviction kept
    def forget_offers(self, e: Entry) -> None: ...  # an entry's bytes were regenerated
    def dropped(self, e: Entry) -> None: ...        # the allocator freed a registered entry's bytes


class Order(Protocol):
    """Told each new entry and each read (runtime.prefetch.Prefetcher learns the read order from them)."""

    def saved(self, e: Entry) -> None: ...
    def read(self, e: Entry) -> None: ...


class SavedStore:
    """Entries of saved activation storages and the pack/unpack hooks that use them, for the ``keeper`` that
    evicts and regenerates them (which builds the store: ``Residency``); ``order``, if any, is told each save
    and read. ``resident`` maps ``uid -> entry`` for the entries whose bytes are on the device: the eviction
    candidates.
    """

    def __init__(self, device: torch.device, produced: ProducedTable, stats: StatsRecorder, clock: Clock,
                 keeper: Keeper, order: Order | None = None):
        self.device = device
        self.clock = clock
        self.produced = produced
        self.stats = stats
        self.resident: dict[int, Entry] = {}
        # the keeper's and the order's methods, bound once: the hooks call them per save and read
        self.ensure, self.discard, self.changed = keeper.ensure, keeper.discard, keeper.forget_offers
        self.on_saved: Callable[[Entry], None] = _nothing if order is None else order.saved
        self.on_read: Callable[[Entry], None] = _nothing if order is None else order.read
        self.last_op = ""  # set by the mode: named in error messages
        self.epoch = 0     # steps started (pack_counting counts a storage once per step)
        # The native allocator device's registry (None: no allocation-time eviction). ``registrable``
        # says whether a new entry may be freed by the allocator, and with which priority (None: no);
        # ``dropped`` records an entry whose bytes the allocator freed.
        self.native: Any = None
        self.registrable: Callable[[Entry], float | None] = _never
        self.dropped: Callable[[Entry], None] = keeper.dropped
        self.registered: dict[int, Entry] = {}
        self.registrations = 0  # entries ever registered (the steady state asks whether a step came near)
        self.pending: dict[int, Entry] = {}  # entries made since the last register_pending()
        # the native device counts a saved storage from before it was installed (the first batch), and
        # returns by how much its count may have read low until then (Meter.count_late)
        self.count_external: Callable[[torch.UntypedStorage], int] | None = None

    # ---- hooks -------------------------------------------------------------------------------
    def pack(self, t: Tensor) -> Any:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return t  # sparse, nested, wrapper subclasses: not ours to manage
        if t.device != self.device:
            return self._keep(t)
        slot = self.produced.get(st)
        if slot is None:
            if self.count_external is not None and (late := self.count_external(st)):
                self._counted_late(late)
            return self._keep(t)
        return self.pack_slot(t, st, slot, True)

    def pack_bound(self, t: Tensor, st: torch.UntypedStorage, slot: Any, register: bool = False) -> Any:
        """``pack`` in a steady-state step of a tensor over storage ``st``, which the step has just bound to
        its program node (``slot``): the storage and its slot are known, and no dispatch mode is active.
        ``register``: register the new entry with the allocator at once (a step whose recording came near
        its budget registers every entry as it is made) rather than through ``register_pending``.

        On the CPU each tensor attribute read here runs right after a kernel has swept the caches, and
        costs several times what it costs in a loop: the usual case (``t`` is its storage's contiguous
        root) reads ``t``'s geometry once, for the entry's view and the covering test alike."""
        if slot.entry is not None or t._base is not None or t.device != self.device:
            return self._pack_bound_general(t, st, slot)
        view = View.of(t)
        item = view.dtype.itemsize
        nbytes = st.nbytes()
        if view.offset or not _contiguous(view.size, view.stride, nbytes // item) or nbytes % item:
            return self._pack_bound_general(t, st, slot)
        # The program node says the recorded step saved an activation here (FSDP's unsharded parameters
        # and wrapper subclasses have none), so pack_slot's checks for those are not repeated.
        version = t._version
        e = new_entry(t.detach(), nbytes, view.dtype, self.device, slot.node, version, slot.stage)
        e.root, e.view, e.origin = weakref.ref(t), view, self.last_op
        self._enter(e, slot, nbytes, not register)
        if register and self.native is not None:
            priority = self.registrable(e)
            if priority is not None:
                self._register(e, st, _SOLE + 1, priority)
        e.refs = 1
        e.last_access = self.clock.now
        return Saved(self, e, None, version, None)

    def _pack_bound_general(self, t: Tensor, st: torch.UntypedStorage, slot: Any) -> Any:
        # a view, an entry made by an earlier save of the storage, another device: pack_slot's general
        # path (a new entry is left pending: the step's after-pack call registers it)
        if t.device != self.device:
            return self.keep(t)
        return self.pack_slot(t, st, slot, False)

    def pack_slot(self, t: Tensor, st: torch.UntypedStorage, slot: Any, guard: bool) -> Any:
        """``pack`` of a tensor over activation storage ``st`` on the device, whose slot is ``slot``;
        ``guard``: a dispatch mode may be active (the tensors made here must not go through it)."""
        e = slot.entry
        if e is None:
            if is_parameter_view(t) or (type(t) is not Tensor and is_traceable_wrapper_subclass(t)):
                # FSDP's unsharded parameters are made by ops during the step; a DTensor's storage is a
                # data-less stand-in of the global size. Neither is an activation: fixed from now on.
                self.produced.slots.pop(id(st), None)
                slot.node = slot.entry = None
                return self._keep(t) if guard else self.keep(t)
            e, same = self._new_entry(t, st, slot, guard)
            if same:  # the saved tensor is the entry's tensor: its geometry, its version counter
                e.refs += 1
                e.last_access = self.clock.now
                return Saved(self, e, None, t._version, None)
        e.refs += 1
        e.last_access = self.clock.now
        root = t._base if t._base is not None else t
        counter = None if e.root is not None and e.root() is root else weakref.ref(root)
        view = View.of(t)
        return Saved(self, e, None if view == e.view else view, t._version, counter)

    def pack_counting(self, t: Tensor) -> Any:
        """Monitor-only ``pack``: count an activation storage the first time this step saves it (as
        ``pack`` counts a new entry) and keep the tensor itself, with its version for ``unpack``."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return t
        slot = self.produced.slots.get(id(st))
        if slot is not None and slot.saved_step != self.epoch and t.device == self.device:
            if is_parameter_view(t) or (type(t) is not Tensor and is_traceable_wrapper_subclass(t)):
                self.produced.slots.pop(id(st), None)  # not an activation: see pack
                slot.node = slot.entry = None
            else:
                slot.saved_step = self.epoch
                nbytes = st.nbytes()
                self.stats.saved(nbytes)
                if not slot.saved_bytes:  # alive and saved: what a budget could evict (the ops monitor's floor)
                    slot.saved_bytes = nbytes
                    self.produced.saved_live += nbytes
        return keep_below_mode(t)

    def unpack(self, h: Any) -> Tensor:
        if type(h) is Kept:
            return h.read()
        if type(h) is not Saved:
            return h
        e = h.entry
        self.on_read(e)
        if e.registered:
            self.claim(e)
        if e.tensor is None:
            # evicted as it was saved, and the step wrote the tensor in place since (seen by the steady step
            # while the tensor lived, or now): what would come back is the bytes saved, not the tensor's
            # (PyTorch raises here without hooks)
            r = e.root() if e.root is not None else None
            now = r._version + e.vshift if r is not None else e.written
            if now >= 0 and now != e.version:
                v = h.view or e.view
                raise _modified(v.size, v.dtype, e.origin, e.version, now)
            self.ensure(e)
        if h.counter is None:
            now = e.tensor._version + e.vshift
        else:
            r = h.counter()
            now = h.version if r is None else r._version
        if now != h.version:
            v = h.view or e.view
            raise _modified(v.size, v.dtype, e.origin, h.version, now)
        e.last_access = self.clock.now
        if h.view is None:  # the saved tensor is the entry's tensor: a fresh alias is enough
            with torch._C._DisableTorchDispatch():
                return e.tensor.detach()
        return h.view.on(e.tensor)

    # ---- entries -----------------------------------------------------------------------------
    keep = staticmethod(keep)  # a steady-state step's light pack (no dispatch mode)
    _keep = staticmethod(keep_below_mode)

    def _counted_late(self, over: int) -> None:
        # A storage from before the device was installed that no step input or module state reached (a
        # loss target held by the loss function) is counted from its first save on: the count's peak
        # before it may have been ``over`` bytes short of the real bytes against the budget.
        # (autograd saves an op's inputs before the op runs: the op named is the one before the saver)
        after = f" after {self.last_op}" if self.last_op else ""
        self.stats.note(f"state allocated before hybridmem was enabled was first counted mid-step, saved by "
                        f"an op{after}: the step's count until then may have read up to {fmt_bytes(over)} low "
                        f"against the budget; create such tensors after enable(), or pass them to the model")

    def _new_entry(self, t: Tensor, st: torch.UntypedStorage, slot: Any,
                   guard: bool = True) -> tuple[Entry, bool]:
        """A resident entry for ``t``'s storage, and whether its tensor is ``t`` itself detached (``t`` is a
        root covering its storage: same geometry, same version counter)."""
        root = t._base if t._base is not None else t
        nbytes = st.nbytes()
        if guard:
            with torch._C._DisableTorchDispatch():
                base, shared, covers = _covering(root, st, nbytes, t.device)
        else:
            base, shared, covers = _covering(root, st, nbytes, t.device)
        e = new_entry(base, nbytes, base.dtype, t.device, slot.node, base._version, slot.stage)
        e.root = weakref.ref(root) if shared else None
        e.view = View.of(base)
        e.origin = self.last_op
        self._enter(e, slot, nbytes, True)
        return e, covers and root is t

    def _enter(self, e: Entry, slot: Any, nbytes: int, pending: bool) -> None:
        """A new entry becomes its slot's and node's, resident and counted as saved; ``pending``: left for
        ``register_pending`` (with the native device)."""
        slot.entry = e
        if slot.node is not None:
            slot.node.entry = e
        self.resident[e.uid] = e
        self.stats.saved(nbytes)
        self.on_saved(e)
        if pending and self.native is not None:
            self.pending[e.uid] = e

    # ---- the allocator's registry ------------------------------------------------------------
    def register(self, e: Entry, priority: float) -> None:
        """Let the allocator free ``e``'s bytes while only the runtime references its storage."""
        t = e.tensor
        assert t is not None
        # our tensor (and its base), the Python object, the registry
        self._register(e, t.untyped_storage(), _SOLE + (t._base is not None) + 1, priority)

    def _register(self, e: Entry, st: torch.UntypedStorage, limit: int, priority: float) -> None:
        if self.native.register(e.uid, st, limit, priority):
            e.registered = True
            e.priority = priority
            self.registered[e.uid] = e
            self.registrations += 1

    def register_pending(self) -> None:
        """Register the resident entries made since the last call that recompute can rebuild (the device
        is near its budget: from now on the allocator may need to free them)."""
        pending, self.pending = self.pending, {}
        for e in pending.values():
            if e.tensor is not None and not e.registered:
                priority = self.registrable(e)
                if priority is not None:
                    self.register(e, priority)

    def register_again(self, entries: list[Entry]) -> None:
        """Entries claimed for a while (the sources of a recompute chain, while it ran): the allocator may
        free them again, in the order it had them."""
        if self.native is None:
            return
        for e in entries:
            if e.tensor is not None and not e.registered and e.uid in self.resident:
                self.register(e, e.priority)

    def claim(self, e: Entry) -> bool:
        """Take ``e`` back from the allocator's registry before reading it. False when the allocator had
        freed its bytes: ``e`` is then evicted (by recompute) and must be regenerated."""
        if not e.registered:
            return e.tensor is not None
        e.registered = False
        self.registered.pop(e.uid, None)
        if self.native.claim(e.uid) == 0:
            self.dropped(e)
            return False
        return True

    def drain(self) -> None:
        """Record the entries whose bytes the allocator freed since the last call."""
        if self.native is not None and self.native.pending_drops:
            # drained even when nothing is registered any more: entries claimed since (a freed one claims
            # as dropped) leave their keys in the allocator's list
            for key in self.native.drain():
                e = self.registered.get(key)
                if e is not None:
                    self.claim(e)

    def unregister_all(self) -> None:
        """Claim every registered entry (the runtime is being uninstalled)."""
        self.pending.clear()
        self.drain()
        for e in list(self.registered.values()):
            self.claim(e)

    def release(self, e: Entry) -> None:
        """The last handle died: forget the entry and drop whatever it held."""
        self.pending.pop(e.uid, None)
        if e.registered:
            self.claim(e)
        self.resident.pop(e.uid, None)
        if e.tensor is not None:
            slot = self.produced.get(e.tensor.untyped_storage())
            if slot is not None and slot.entry is e:
                slot.entry = None
        self.discard(e)
        node = e.lineage
        if node is not None:
            if node.entry is e:
                node.entry = None
            slot = node.storage  # evicted as it was saved: the storage may outlive its entry's handles
            if getattr(slot, "entry", None) is e:
                slot.entry = None
        e.tensor = e.handle = e.lineage = None

    def sole_owner(self, e: Entry) -> bool:
        """Whether only this entry references its storage (evicting anything else frees nothing)."""
        t = e.tensor
        return t is not None and (_use_count(t.untyped_storage()._cdata)
                                  <= _SOLE + (t._base is not None) + e.registered)

    def before_evict(self, e: Entry) -> None:
        """Record the version counter the packs saw; the entry stops being a candidate."""
        e.version = e.tensor._version + e.vshift
        self.resident.pop(e.uid, None)

    def after_evict(self, e: Entry, policy: str, handle: Any, keep_slot: bool = False) -> None:
        """``keep_slot``: the step still holds the storage (evicted as it was saved): later saves of it find
        the evicted entry through its slot."""
        if e.tensor is not None and not keep_slot:
            slot = self.produced.get(e.tensor.untyped_storage())
            if slot is not None and slot.entry is e:
                slot.entry = None
        e.tensor, e.policy, e.handle = None, policy, handle

    def adopt(self, e: Entry, t: Tensor) -> None:
        """``t`` (over a storage with ``e``'s regenerated bytes) becomes ``e``'s resident tensor."""
        st = t.untyped_storage()
        base = flat(st, e.dtype, e.device)
        if e.view is not None and View.of(base) != e.view:
            base = e.view.on(base)  # same geometry as before eviction: handles rely on it
        e.tensor, e.policy, e.handle = base, None, None
        e.vshift = e.version - base._version
        e.root = weakref.ref(base)
        slot = self.produced.add(st)
        slot.entry = e
        node = e.lineage
        if node is not None:
            slot.node, node.storage = node, slot
        self.resident[e.uid] = e
        if self.native is not None:
            self.pending[e.uid] = e  # rebuilt, it may be freed again near the budget (DTR-style)
        self.changed(e)

    def resident_bytes(self) -> int:
        return sum(e.nbytes for e in self.resident.values())


def _covering(root: Tensor, st: torch.UntypedStorage, nbytes: int,
              device: torch.device) -> tuple[Tensor, bool, bool]:
    """(a tensor over the whole storage, whether it shares ``root``'s version counter, whether it is
    ``root`` itself detached): policies copy or encode the whole storage through it."""
    d = root.detach()  # shares the root's version counter, holds no autograd graph
    item = d.dtype.itemsize
    if nbytes % item == 0:
        n = nbytes // item
        if d.storage_offset() == 0 and d.numel() == n and d.is_contiguous():
            return d, True, True
        return d.as_strided((n,), (1,), 0), True, False
    return flat(st, torch.uint8, device), False, False


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...], n: int) -> bool:
    """Whether a tensor of ``size`` and ``stride`` at offset 0 is contiguous and has ``n`` elements (what
    ``is_contiguous()`` and ``numel()`` say, without two more reads of the tensor: see ``pack_bound``)."""
    expected = 1
    for k, step in zip(reversed(size), reversed(stride)):
        if k == 0:
            return n == 0
        if k != 1:
            if step != expected:
                return False
            expected *= k
    return expected == n


def _modified(size: tuple[int, ...], dtype: torch.dtype, origin: str, saved: int, now: int) -> RuntimeError:
    where = f" (saved around op {origin})" if origin else ""
    return RuntimeError(
        f"hybridmem: one of the tensors saved for backward, of shape {list(size)} and dtype "
        f"{str(dtype).removeprefix('torch.')}{where}, has been modified by an in-place operation: it is at "
        f"version {now}; expected version {saved} instead. PyTorch would raise this error too, but "
        "saved-tensor hooks disable its check, so hybridmem checks itself. Make the in-place operation "
        "out-of-place (e.g. inplace=False, x = x + y instead of x += y) or clone the tensor before modifying it.")


def _nothing(e: Entry) -> None:
    return None


def _never(e: Entry) -> float | None:
    return None

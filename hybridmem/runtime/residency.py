"""Residency: evict entries until an allocation fits the budget, and regenerate them on demand.

Victims are chosen among resident, unpinned entries whose storage only the runtime still references
(evicting a tensor the program also holds frees nothing), over every applicable policy, by the
scorer (``cost / (bytes freed x staleness)``, DTR-style). When nothing more can be evicted the
runtime raises ``torch.OutOfMemoryError`` naming the smallest budget that could have worked.

Policy work runs *quiet* (unmetered): a swap's host buffer is not device memory. The device tensors
a policy keeps (a compressed copy) or returns (a swapped-in tensor) are handed to the meter
explicitly. A policy whose hints say ``metered`` (recompute) instead runs ordinary ops that the mode
meters and caps one by one.
"""
from __future__ import annotations

import hashlib
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import numpy as np
import torch

from hybridmem.plugins.base import EvictionDeclined, Policy, PolicyHints, hints_of

from .entry import Entry
from .meter import Meter
from ..graph.units import fmt_bytes
from ..scorer import select_victims
from .saved import SavedStore
from .stats import StatsRecorder
from .survey import Survey

# Residency._evict_by: the policy found no room for what its eviction allocates, or declined on the bytes
_REFUSED = object()

Tensor = torch.Tensor


class Contexts(Protocol):
    """What the dispatch mode offers residency: run ops unmetered, or metered as internal work."""

    def quiet(self) -> AbstractContextManager[None]: ...

    def metered(self) -> AbstractContextManager[None]: ...


class NoMode:
    """Contexts when no dispatch mode is active (the runtime was disabled while entries live on)."""

    def quiet(self) -> AbstractContextManager[None]:
        return nullcontext()

    metered = quiet


def _in_a_step() -> bool:
    return True


def _no_state() -> int:
    return 0


@dataclass(frozen=True)
class Around:
    """What residency asks of the runtime it serves, given when it is built (defaults: no runtime around)."""

    in_step: Callable[[], bool] = _in_a_step           # whether a training step is running
    state_to_come: Callable[[], int] = _no_state       # optimizer state its optimizers hold from their first step
    on_budget: Callable[[int], None] | None = None     # told the budget the dispatch mode makes room under
    # A step the budget cannot hold goes on uncapped to measure what it needs (runtime.survey): lift_cap(True)
    # then lift_cap(False) after it; None: the first refusal raises.
    lift_cap: Callable[[bool], None] | None = None


class Residency:
    """Evicts and regenerates the entries of the :class:`SavedStore` it builds (``store_of(self)``: the store
    calls it back) under one budget. ``workspace``: room kept
    free beside the count for kernels' workspaces (``plugins: {workspace: N}``); ``verify``: hash each evicted
    entry's bytes and check them when it is regenerated (``plugins: {verify: true}``)."""

    def __init__(self, store_of: Callable[["Residency"], SavedStore], policies: dict[str, Policy], meter: Meter,
                 stats: StatsRecorder, budget: int | None, around: Around = Around(), workspace: int = 0,
                 verify: bool = False):
        self.policies, self.meter, self.stats = policies, meter, stats
        self.budget = budget
        # What the runtime reads of each policy beyond its protocol methods, read here once (by the policies'
        # names; ``_hints`` by the policy object's id, for the paths that hold a policy, not its name)
        self.hints: dict[str, PolicyHints] = {name: hints_of(p) for name, p in policies.items()}
        self._hints: dict[int, PolicyHints] = {id(p): self.hints[name] for name, p in policies.items()}
        # Hysteresis: free this much beyond what an op needs (1/64 of the budget), so that a run of
        # allocations near the cap pays one scoring pass instead of one per op.
        self.slack = 0 if budget is None else budget // 64
        # A policy whose eviction allocates first (compress encodes into a new buffer) cannot run at the
        # cap: keep this much free when making room, so that it can (not enforced when nothing can go).
        allocating = any(h.allocates_to_evict for h in self.hints.values())
        self.reserve = (budget // 32 if budget is not None and allocating else 0) + workspace
        self.workspace = workspace   # of ``reserve``
        self.mode: Contexts = NoMode()
        self._order = list(policies.values())
        # (policy, whether its cost is asked each time) for the offers, and the release hooks, in order
        self._offering = [(p, self._hints[id(p)].dynamic_cost) for p in self._order]
        self._releases = [h.release for h in self.hints.values() if h.release is not None]
        self._touched: dict[int, None] = {}   # uids of entries ever evicted (policies may keep state)
        self._offer_cache: dict[int, list[tuple[Policy, float | None, int]]] = {}
        self._ensuring: set[int] = set()
        # the store of the entries this residency keeps, built for it (it calls ensure, discard, ... back)
        self.store = store_of(self)
        # the steady state's recording step listens: on_evicted(entry, policy name, handle)
        self.on_evicted: Callable[[Entry, str, Any], None] | None = None
        self.rescues: dict[str, int] = {}  # evictions by policy that made room for an allocation refused in an op
        self._rescuing = False
        self.survey: Survey | None = None   # the step going on uncapped, if one is (see Around.lift_cap)
        self.lift_cap, self.in_step = around.lift_cap, around.in_step
        self.state_to_come, self.on_budget = around.state_to_come, around.on_budget
        self.verify: dict[int, tuple[bytes, str]] | None = {} if verify else None   # entry uid -> hash, op

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, e: Entry, policy: Policy) -> int:
        """Evict ``e`` by ``policy``; returns the device bytes that went away (0 if the policy could not
        allocate what it needs, e.g. a compressed copy, within the budget: ``e`` then stays)."""
        if e.registered and not self.store.claim(e):
            return 0  # the allocator freed it meanwhile: evicted by recompute already
        before = self.meter.current_bytes
        handle = self._evict_by(e, policy)
        if handle is _REFUSED:
            return 0  # still resident: another victim must do
        self._record_eviction(e, policy, handle)
        return before - self.meter.current_bytes

    def evict_early(self, e: Entry, name: str) -> bool:
        """Evict ``e`` by policy ``name`` as it is saved (a steady-state step evicts what its recorded step
        evicted by swap or compress). The step still holds the tensor, so its storage keeps the entry: a
        later save of it shares the evicted entry. False where the policy cannot evict it now (compress
        has not decided, or its encoding found no room)."""
        policy = self.policies.get(name)
        if policy is None or e.tensor is None or not policy.applicable(e):
            return False
        if e.registered and not self.store.claim(e):
            return False  # the allocator freed it meanwhile: evicted by recompute already
        handle = self._evict_by(e, policy)
        if handle is _REFUSED:
            return False
        self._record_eviction(e, policy, handle, keep_slot=True)
        return True

    def _evict_by(self, e: Entry, policy: Policy) -> Any:
        """``policy.evict(e)`` with the entry's digest kept for ``verify``; :data:`_REFUSED` (``e`` resident
        again) where the policy found no room for what it allocates, or declined once it read the bytes
        (:class:`~hybridmem.plugins.base.EvictionDeclined`)."""
        if self.verify is not None and self._hints[id(policy)].verifiable:
            with self.mode.quiet():
                self.verify[e.uid] = (digest(e.tensor), policy.name)
        self.store.before_evict(e)
        try:
            with self.mode.quiet():
                return policy.evict(e)
        except (torch.OutOfMemoryError, EvictionDeclined):
            self.store.resident[e.uid] = e
            if self.verify is not None:
                self.verify.pop(e.uid, None)
            return _REFUSED

    def dropped(self, e: Entry) -> None:
        """The allocator freed ``e``'s bytes at an allocation (a registered recompute candidate)."""
        policy = self.policies["recompute"]
        self.store.before_evict(e)
        self._record_eviction(e, policy, policy.evict(e))

    def _record_eviction(self, e: Entry, policy: Policy, handle: Any, keep_slot: bool = False) -> None:
        if self.on_evicted is not None:
            self.on_evicted(e, policy.name, handle)
        if self._rescuing:
            self.rescues[policy.name] = self.rescues.get(policy.name, 0) + 1
        self._touched[e.uid] = None
        self._offer_cache.pop(e.uid, None)
        self._track_kept(policy, handle)
        self.store.after_evict(e, policy.name, handle, keep_slot)
        self.stats.evicted(policy.name, e)

    def _track_kept(self, policy: Policy, handle: Any) -> None:
        # A policy's handle may keep device memory (a compressed copy); on the simulated device the
        # meter only counts it if told. Host copies look like device tensors on the CPU, so a policy
        # that moves bytes to the host says so (``moves_to_host``) or names its device tensors
        # (``device_tensors(handle)``); otherwise every tensor in the handle counts.
        if not self.meter.simulated or handle is None or isinstance(handle, (int, float, str)):
            return
        hints = self._hints[id(policy)]
        if hints.device_tensors is not None:
            kept = list(hints.device_tensors(handle))
        elif not hints.moves_to_host:
            kept = _tensors_in(handle, self.store.device)
        else:
            kept = []
        if kept:
            self.meter.track(*kept)

    def discard(self, e: Entry) -> None:
        """A once-evicted entry died: let policies free what they keep for it (host checkpoints)."""
        self._offer_cache.pop(e.uid, None)
        if self.verify is not None:
            self.verify.pop(e.uid, None)  # evicted and never read again
        if self._touched.pop(e.uid, None) is None:
            return
        with self.mode.quiet():
            for release in self._releases:
                release(e)

    def candidates(self) -> list[Entry]:
        store = self.store
        return [e for e in store.resident.values() if not e.pinned and store.sole_owner(e)]

    def relieve(self, need: int, extra: int = 0, slack: int = 0, min_bytes: int = 0) -> int:
        """Evict until ``need`` bytes are freed or nothing more can go; returns the bytes freed.
        ``extra``: bytes about to be allocated (for the minimum-budget bound). ``slack``: evict up to
        this much more if it comes with the same victims' order (spares the next ops a scoring pass).
        ``min_bytes``: only entries at least this large (a block the refused allocation fits in)."""
        need_min, need = need, need + slack
        freed = 0
        self.store.drain()  # entries the allocator freed are no candidates
        while freed < need:
            pairs, costs, saves, last, best = self._score_inputs(min_bytes)
            if not min_bytes:
                self._raise_floor(self.meter.current_bytes - best + extra)
            if not pairs:
                break
            picks = select_victims(costs, saves, last, float(self.store.clock.now), need - freed)
            done: set[int] = set()
            progress = False
            for i in picks:
                e, p = pairs[int(i)]
                if e.uid in done or e.tensor is None:
                    continue
                done.add(e.uid)
                freed += self.evict(e, p)
                progress = progress or e.tensor is None
                if freed >= need:
                    break
            if not progress:
                break
            if freed >= need_min:
                break  # the slack is best effort: one scoring pass only
        return freed

    def relieve_oom(self, need: int) -> int:
        """An allocation inside an op failed (``Meter.on_pressure``): ``need`` more bytes must fit. Under a
        budget, evict what takes the live bytes plus ``need`` to it; else (the device itself is full) free
        ``need``. Returns the bytes freed (1 when they fit already: the op may be retried as it is). The
        evictions are counted by policy in ``rescues`` (the steady state asks what made room)."""
        self._rescuing = True
        try:
            return self._relieve_oom(need)
        finally:
            self._rescuing = False

    def _relieve_oom(self, need: int) -> int:
        if self.budget is None:
            return self.relieve(max(need, 1), need)
        over = self.meter.current_bytes + need - self.budget
        if over <= 0:
            if self._fragmented():
                # The CUDA allocator caps its reserved bytes, and they hold free blocks too small for the
                # request (a new segment of up to 20 MiB does not fit under the cap): free a block it fits
                # in, else any, which coalesces with free neighbours or empties a segment it gives back.
                return self.relieve(need, need, 0, min_bytes=need) or self.relieve(need, need, self.slack)
            return 1
        return self.relieve(over + self.reserve, need, self.slack)

    def _fragmented(self) -> bool:
        """A real CUDA device whose allocator holds more than it has allocated (cached free blocks)."""
        c = self.meter.cuda
        if c is None or self.meter.native is not None:
            return False
        return c.reserved() > c.allocated()

    def _score_inputs(self, min_bytes: int = 0) -> tuple[list[tuple[Entry, Policy]], np.ndarray, np.ndarray,
                                                         np.ndarray, int]:
        """Candidates' (entry, policy) pairs, costs, savings and last accesses, plus the sum over
        candidate entries of their best savings (for the floor), in one pass."""
        pairs: list[tuple[Entry, Policy]] = []
        costs: list[float] = []
        saves: list[int] = []
        last: list[float] = []
        best_total = 0
        for e in self.candidates():
            if e.nbytes < min_bytes:
                continue
            best = 0
            for p, cost, save in self._offers(e):
                pairs.append((e, p))
                costs.append(p.cost(e) if cost is None else cost)
                saves.append(save)
                last.append(e.last_access)
                best = max(best, save)
            best_total += best
        return (pairs, np.asarray(costs, np.float64), np.asarray(saves, np.int64),
                np.asarray(last, np.float64), best_total)

    def _offers(self, e: Entry) -> list[tuple[Policy, float | None, int]]:
        """(policy, cost or None = ask each time, savings) for each policy applicable to ``e``.

        Cached until the entry's bytes change (eviction, regeneration) or the step ends: asking
        every policy about every candidate at every eviction is what would make the cap slow.
        Policies whose cost moves with other entries' state (``dynamic_cost``: recompute's chain)
        are asked for the cost each time."""
        got = self._offer_cache.get(e.uid)
        if got is None:
            got = self._offer_cache[e.uid] = [
                (p, None if dynamic else p.cost(e), p.savings(e))
                for p, dynamic in self._offering if p.applicable(e)]
        return got

    def forget_offers(self, e: Entry | None = None) -> None:
        if e is None:
            self._offer_cache.clear()
        else:
            self._offer_cache.pop(e.uid, None)

    def _raise_floor(self, floor: int) -> None:
        """Lower bound on any workable budget: what no policy can evict now, plus the new bytes."""
        if floor > self.stats.min_budget_bytes:
            self.stats.min_budget_bytes = floor

    # ---- the cap -------------------------------------------------------------------------------
    def make_room(self, extra: int, what: "str | Callable[[], str]") -> None:
        """Ensure ``extra`` more bytes fit the budget, evicting as needed; raise OOM if they cannot. ``what``
        names what needs them in that error (a function where naming it costs: called only then)."""
        budget = self.budget
        if budget is None:
            return
        over = self.meter.current_bytes + extra + self.reserve - budget
        if over <= 0:
            return
        self.relieve(over, extra, self.slack)
        if self.meter.current_bytes + extra > budget:
            self.refuse(extra, what if isinstance(what, str) else what())

    def refuse(self, extra: int, what: str, held: int | None = None) -> None:
        """``extra`` bytes do not fit, and nothing more can be evicted: raise the OOM, or (runtime.survey) note
        what the budget must hold here and go on uncapped."""
        err = self.exhausted(extra, what, held)
        if err is not None:
            try:
                raise err
            finally:
                err = None  # a frame in the traceback holding its own error is a cycle: the step's tensors with it

    def exhausted(self, extra: int, what: str, held: int | None) -> torch.OutOfMemoryError | None:
        """``Meter.on_exhausted`` (and ``refuse``): the OOM to raise where nothing more can be evicted, or None
        where the step goes on uncapped to measure what it needs (runtime.survey): what the budget must hold
        here is noted. The OOM is made, not raised: its raiser's traceback is the one a user reads."""
        if self.survey is None:
            err = self.out_of_memory(extra, what, held)
            if self.lift_cap is None:
                return err
            self.survey = Survey(err, self.budget or 0)
            self.lift_cap(True)
            self.stats.note(f"the budget could not hold {what}: the step goes on without the cap to measure what "
                            "it needs, and raises when it ends (runtime.survey)")
        self.survey.note(self.need(extra, self.meter.current_bytes if held is None else held), what, self.in_step())
        self.evict_as_needed()
        return None

    def need(self, extra: int, held: int) -> int:
        """What a budget must hold for ``extra`` more bytes refused with ``held`` held, everything evictable
        now evicted (the survey's measure of a refusal)."""
        return max(held, self.meter.current_bytes) + extra - self._evictable_bytes()

    def evict_as_needed(self) -> None:
        """A surveyed step evicts for the most it has needed so far, not for the budget that failed: it then
        makes the choices (what stays, what a rebuild holds) a run at the budget it will name makes."""
        need = self.survey.need if self.survey is not None else 0
        if need > (self.budget or 0):
            self._set_budget(need)

    def _set_budget(self, budget: int) -> None:
        self.budget = budget
        if self.on_budget is not None:
            self.on_budget(budget)

    def survey_op(self, peak: int, inputs: set[int], what: str) -> None:
        """An op of a surveyed step ran: its peak, less what was evictable then (not its inputs: they were in
        use), is what a budget must hold there."""
        survey = self.survey
        assert survey is not None
        survey.ops += 1
        survey.note(peak - self._evictable_bytes(inputs), what, self.in_step())
        self.evict_as_needed()

    def end_survey(self) -> torch.OutOfMemoryError | None:
        """Put the cap back; the OOM naming the budget the surveyed step needed (None: no survey)."""
        survey, self.survey = self.survey, None
        if survey is None:
            return None
        self._set_budget(survey.budget)
        if self.lift_cap is not None:
            self.lift_cap(False)
        with self.mode.quiet():  # sizing an optimizer's state runs ops on meta copies: not the device's
            err = survey.error(self.state_to_come())
        self.stats.min_budget_bytes = max(self.stats.min_budget_bytes, err.min_budget_bytes)
        return err

    def out_of_memory(self, extra: int, what: str, held: int | None = None) -> torch.OutOfMemoryError:
        """The OOM to raise: ``extra`` bytes did not fit with what is live (``held``: the bytes the allocator
        held when it refused them, inside the op, before the op's own allocations were unwound). Its
        ``min_budget_bytes`` is the smallest budget that could work, as the message says."""
        budget = self.budget or 0
        live = self.meter.current_bytes if held is None else max(held, self.meter.current_bytes)
        # this budget just failed, whatever the bound says: the smallest that could work is above it
        floor = max(self.stats.min_budget_bytes, live + extra - self._evictable_bytes(), budget + 1)
        self.stats.min_budget_bytes = floor
        held, pinned, shared = self._resident_summary()
        if budget and live + extra <= budget:
            # refused with room by count: the CUDA allocator caps reserved bytes, its cache's free blocks
            # included, and none of those (nor any eviction) gave a block this large
            why = (f"which the budget holds by count ({fmt_bytes(budget - live)} of it unallocated), but the "
                   "allocator refused it: its cache's free blocks are too small for it and evicting made none "
                   "large enough (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True fragments less)")
        else:
            why = "and nothing more can be evicted"
        err = torch.OutOfMemoryError(
            f"hybridmem: the budget of {fmt_bytes(budget)} ({budget} bytes) is too small: {what} needs "
            f"{fmt_bytes(extra)} ({extra} bytes) more with {fmt_bytes(live)} ({live} bytes) live, {why}. "
            f"Smallest budget that could work: at least {fmt_bytes(floor)} ({floor} bytes) "
            f"(a lower bound: the bytes no policy could evict at the tightest op seen so far plus that op's "
            f"new outputs; later ops of the step may need more). Resident: {held}; {pinned}; {shared}; the rest "
            f"({fmt_bytes(max(live - self.store.resident_bytes(), 0))}) is parameters, buffers, inputs, "
            f"gradients, optimizer state and tensors the program holds. A budget that works: the peak of a step "
            f"run without one (`hybridmem run SCRIPT` without --budget, or stats().peak_bytes after "
            f"hybridmem.enable(budget=None)); the least lies between the two.")
        err.min_budget_bytes = floor  # the number the message names, for a program that retries
        return err

    def _evictable_bytes(self, exclude: set[int] | None = None) -> int:
        """What evicting every candidate would free (``exclude``: ids of storages in use, not candidates)."""
        total = 0
        for e in self.candidates():
            if exclude and e.tensor is not None and id(e.tensor.untyped_storage()) in exclude:
                continue
            total += max((save for _, _, save in self._offers(e)), default=0)
        return total

    def _resident_summary(self) -> tuple[str, str, str]:
        entries = list(self.store.resident.values())
        pinned = [e for e in entries if e.pinned]
        shared = [e for e in entries if not e.pinned and not self.store.sole_owner(e)]
        free = [e for e in entries if not e.pinned and self.store.sole_owner(e)]
        big = sorted(entries, key=lambda e: -e.nbytes)[:3]
        held = (f"{len(entries)} saved tensors ({fmt_bytes(sum(e.nbytes for e in entries))}), largest "
                + ", ".join(f"{fmt_bytes(e.nbytes)} {str(e.dtype).removeprefix('torch.')}"
                            + (f" from {e.origin}" if e.origin else "") for e in big)) if entries else "no saved tensors"
        no_policy = [e for e in free if not any(p.applicable(e) for p in self._order)]
        return (held, f"{len(pinned)} in use by the running op, {len(no_policy)} with no applicable policy "
                      f"({', '.join(self.policies)})",
                f"{len(shared)} also referenced by the program ({fmt_bytes(sum(e.nbytes for e in shared))})")

    # ---- regeneration --------------------------------------------------------------------------
    def ensure(self, e: Entry) -> None:
        """Make an evicted entry resident again (unpack, a plan action, or a recompute chain)."""
        if e.tensor is not None:
            return
        name = e.policy or ""
        policy = self.policies.get(name)
        if policy is None:
            raise RuntimeError(f"hybridmem: a saved tensor was evicted by policy {name!r}, which is not active")
        t0 = time.perf_counter()
        hints = self._hints[id(policy)]
        if hints.in_flight is None or not hints.in_flight(e):  # a prefetched swap-in holds its device buffer already
            self.make_room(e.nbytes, lambda: f"regenerating a saved {str(e.dtype).removeprefix('torch.')} "
                                             f"tensor ({fmt_bytes(e.nbytes)}) by {name}")
        t1 = time.perf_counter()
        self._ensuring.add(e.uid)
        try:
            if hints.metered:
                with self.mode.metered():
                    t = policy.regenerate(e)
            else:
                with self.mode.quiet():
                    # the policy's own allocation (a swap-in buffer, a decoded copy) is refused by a real
                    # allocator like an op's: evict and retry (it allocates before it changes anything)
                    t = self.meter.retry_oom(policy.regenerate, e)
                self.meter.track(t)
        finally:
            self._ensuring.discard(e.uid)
        t2 = time.perf_counter()
        if e.uid not in self.store.resident:  # recompute hands its result back itself (adopt)
            self.store.adopt(e, t)
        if self.verify is not None:
            self._check(e)
        self.stats.regenerated(name, e, t2 - t1, t2 - t0)

    def _check(self, e: Entry) -> None:
        """``plugins: {verify: true}``: the regenerated bytes are the evicted ones, else raise naming them."""
        got = self.verify.pop(e.uid, None) if self.verify is not None else None
        if got is None or e.tensor is None:
            return
        with self.mode.quiet():
            now = digest(e.tensor)
        if now != got[0]:
            raise RegenerationMismatch(
                f"hybridmem (verify): a saved {str(e.dtype).removeprefix('torch.')} tensor of "
                f"{fmt_bytes(e.nbytes)}{f' from {e.origin}' if e.origin else ''}, evicted by {got[1]}, came back "
                f"with other bytes than it was evicted with: the gradients of this step would be wrong")

    def adopt_replayed(self, e: Entry, t: Tensor) -> None:
        """A recompute chain rebuilt ``e`` on its way (``Replayer.adopt``): resident again, counted."""
        name = e.policy or "recompute"
        self.store.adopt(e, t)
        if self.verify is not None:
            self._check(e)
        if e.uid not in self._ensuring:  # the entry ensure() asked for is counted there, with its time
            self.stats.regenerated(name, e, 0.0, 0.0, logged=False)  # its time is in the outer regeneration's

    def fetch(self, e: Entry) -> Tensor:
        """``ensure`` and return the entry's tensor (a recompute chain starting from a host checkpoint)."""
        self.ensure(e)
        assert e.tensor is not None
        return e.tensor

    def prefetch(self, entries: Iterable[Entry]) -> None:
        """Start regenerating ``entries`` ahead of use where the budget has room now (a prefetch never
        evicts: it would trade a certain cost for a hoped-for one)."""
        for e in entries:
            if self.prefetch_one(e) is None:
                return

    def prefetch_one(self, e: Entry) -> bool | None:
        """Start regenerating ``e`` ahead of use if the budget has room for it now (and its reserve): True
        when started (or nothing to do), False when there is no room by count, None when the allocator
        refused the room the count promised (its cache's free blocks too small): read on demand."""
        policy = self.policies.get(e.policy or "")
        if e.tensor is not None or policy is None:
            return True
        if self.budget is not None and self.meter.current_bytes + e.nbytes + self.reserve > self.budget:
            return False
        try:
            with self.mode.quiet():
                policy.prefetch(e)
        except torch.OutOfMemoryError:
            return None
        return True


class RegenerationMismatch(RuntimeError):
    """``plugins: {verify: true}`` found a regenerated saved tensor whose bytes differ from the evicted ones."""


def digest(t: Tensor) -> bytes:
    """A hash of ``t``'s bytes, computed on the host (no device memory: it runs at the cap)."""
    flat = t.detach().reshape(-1).cpu()
    return hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()


def _tensors_in(obj: Any, device: torch.device, depth: int = 3) -> list[Tensor]:
    """Tensors on ``device`` inside a policy handle (attributes, sequences, mappings; a few levels)."""
    if isinstance(obj, Tensor):
        return [obj] if obj.device == device else []
    if depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return []
    if isinstance(obj, dict):
        items: Iterable[Any] = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) or list(getattr(obj, "__slots__", ()))
        items = [getattr(obj, n, None) for n in names]
    else:
        return []
    return [t for v in items for t in _tensors_in(v, device, depth - 1)]

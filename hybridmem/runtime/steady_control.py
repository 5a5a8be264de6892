"""Which regime runs each step, and what the steady state does between a step's saves and reads.

A step runs under the dispatch mode (the first ones, and one that records a *program*: runtime.program) or
in the steady state, following a program with the saved-tensor hooks alone (runtime.steady). This part of
the runtime chooses at each step's first module call (``_choose_step``; ``_restart_step`` once the step's
inputs are seen: runtime.programs), keeps room after each save and read of a steady step
(``_steady_after``), recovers where an op's allocation went past the budget (``_recover``), and ends a
recording (``_finish_program``). :class:`SteadyControl` is one job of :class:`~.compose.Runtime` (which it is
mixed into); what it reads of the rest of the runtime is annotated on the class.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..config import Config
from ..graph.units import fmt_bytes
from .entry import Entry
from .hookless import Hookless
from .module_state import FixedMarker
from .meter import Meter
from .program import ProgramRecorder, StepProgram
from .programs import ProgramSet, growth, signature_of
from .residency import Residency
from .rises import RiseRecorder
from .saved import REGISTER_BELOW, Saved, SavedStore
from .steady import SteadyParts, SteadyStep
from .stats import StatsRecorder
from .steps import StepTracker

# Added to the allocator priority of what a followed plan keeps (priorities are seconds per byte, far
# below 1): the allocator frees every entry the plan recomputes before any of those.
PLAN_KEEPS_LAST = 1.0


class SteadyControl:
    """The steady state's control (see the module docstring)."""

    # what it reads of the runtime (built by Runtime.__init__)
    budget: int | None
    device: torch.device
    policies: dict[str, Any]
    meter: Meter
    store: SavedStore
    residency: Residency
    stats: StatsRecorder
    steps: StepTracker
    fixed: FixedMarker
    follower: Any       # PlanFollower | None (runtime.follow)
    hookless: Hookless
    owner: Any          # OwnerThread (runtime.threads): the hooks are taken off the installing thread's stack
    native: Any         # NativeDevice | None (runtime.native_device)
    mode: Any           # RuntimeMode | None (runtime.dispatch_mode)
    buckets: Any
    _pack: Any
    _module: torch.nn.Module | None

    def _init_steady(self, cfg: Config) -> None:
        # Steady state (runtime.program, runtime.steady): a step like the recorded one runs with the
        # saved-tensor hooks alone. It needs the allocator to enforce the budget (the native device) and no
        # per-stage work: a followed plan's recomputes become the allocator's order (_finish_program); what
        # the recorded step evicted by swap or compress is evicted as it is saved.
        self.steady_possible = (self.native is not None and self.buckets is None and cfg.extra.get("steady", True))
        if self.steady_possible and self.device.type == "cuda" and not cfg.extra.get("steady_cuda", True):
            self.steady_possible = False
            self.stats.note("steady state: off on CUDA (plugins: {steady_cuda: false}): each op stays under the "
                            "dispatch mode")
        self._steady_parts = SteadyParts(
            self._pack, self.store.pack_bound, self._bind, self._steady_after, self._diverged, self.store.keep,
            self._far, self.stats.saved, self._offload, self.store.sole_owner,
            # prefetch pays where copies overlap compute (CUDA side streams); on the simulated CPU device it
            # is a synchronous regeneration done early, memory spent for nothing
            self._prefetch_one if self.device.type == "cuda" else None, self.store.claim, self._pack_plain)
        self._registrable = self.store.registrable  # the allocator's order without a plan (runtime.native_device)
        self.plan_recomputes: set[Any] = set()      # program nodes a followed plan recomputes (steady state)
        self.programs = ProgramSet()  # recorded programs by input signature (runtime.programs)
        self.mode_on = False  # the dispatch mode is entered (off during steady-state steps)
        self._below: Any = None  # the dispatch mode under this runtime's when it left it for the steady state
        # the native CPU meter's peak window: how far the bytes rose between saves and reads of a recording
        self._window = self.native.native if self.native is not None and self.device.type == "cpu" else None
        self._rises: RiseRecorder | None = None  # what rose between the recording's saves and reads
        self._program_rec: ProgramRecorder | None = None
        self._steady: SteadyStep | None = None
        self._packfn: Any = self._pack
        self._light_base = self._light_top = 0   # bytes at a steady step's start, and the most read at its saves
        self._light_external = 0                 # storages from before the native device counted by then (the
        #                                          step's inputs included: counted with or without the hooks)
        self._evicted_before: dict[str, int] = {}
        self._registered_before = 0
        self._refused_before = 0
        self._rescues_before: dict[str, int] = {}
        # a steady step's cap lets a refusal through, for its next hook to recover from (_recover)
        self._soft = self.native is not None and self.residency.lift_cap is not None
        self._soft_on = False  # the soft cap is on now (a steady step's own ops run)
        self._retired: StepProgram | None = None  # the program a refusal retired this step
        self._overran = False  # a steady step went past the budget once (said in the notes)
        self._pass_started = 0.0  # host clock at the step's start, and the elements of its inputs (_pass_cost)
        self._pass_size = 0

    def _choose_step(self) -> None:
        """Before a step starts: steady state if a program is ready and the dispatch mode can be left
        (nothing entered above it), else the dispatch mode, recording a program."""
        prog, mode = self.programs.last, self.mode
        if mode is None:
            return
        follower = self.follower
        verifying = follower is not None and follower.state == "pending"
        if verifying:
            prog = None                 # step 1 verifies the plan under the dispatch mode
        if prog is not None and (not self.mode_on or _get_current_dispatch_mode() is mode):
            if self.mode_on:
                mode.__exit__(None, None, None)
                self.mode_on = False
                self._below = _get_current_dispatch_mode()  # a mode entered before enable(), if any
            self._follow(prog)
            self._program_rec = None
            return
        if not self.mode_on:
            self._enter_mode()
        self._steady = None
        # The first step is not recorded: the optimizer's state appears after it, so later steps hold more.
        # (With a plan, the first step verifies it: the step after, which follows it, is recorded.)
        if self.steps.steps >= 1 and not verifying and self.programs.may_record(self.steps.steps):
            self._program_rec = ProgramRecorder()
            self._packfn = self._pack_recording
        else:
            self._program_rec = None
            self._packfn = self._pack

    def _restart_step(self, steady: SteadyStep, tensors: list[torch.Tensor]) -> None:
        """The step's inputs differ from those of the program it started with (another sequence length or
        batch): follow the program recorded for their signature, or that of nearby ones scaled
        (runtime.programs), or run this step under the dispatch mode and record one. Called at the step's first
        module call, before any of its ops."""
        steady.program.unbind()
        sig = signature_of((t.shape, t.dtype) for t in tensors)
        prog = self.programs.get(sig)
        # a larger step than any program only where the recording measured what rose between its hooks (the
        # CPU allocator's window) and a refusal is let through to recover from (the soft cap): on CUDA a
        # steady step's refusal is the caching allocator's OOM
        grow = self._window is not None and self._soft
        if prog is None and (prog := self.programs.scaled(sig, "swap" in self.policies, grow)) is not None:
            g = growth(sig, prog)
            # grown past its program: what rose between two hooks, grown with the sizes (attention's with their
            # square)
            self._follow(prog, sig, g * g)
            self._note_shapes()
            return
        if prog is not None:
            steady = self._follow(prog)
            prog.bind_inputs(tensors)
            if 1 in prog.random_at and self._module is not None:  # the random ops after this very call
                why = prog.module_called(1, self._module, self._rng_now)
                if why:
                    steady.leave(why)
            if not steady.off:
                self._maybe_hookless(steady)
            return
        self._steady = None
        self._enter_mode()
        if self.programs.may_record(self.steps.steps):
            self._begin_recording()
        else:
            self._packfn = self._pack

    def _note_shapes(self) -> None:
        self.stats.note("steady state: one program per input shape (a new shape follows the program of a larger "
                        "one, or of a smaller one it exceeds by at most 1.25x, swapping what it recomputed, until "
                        "that has cost more than recording its own; a larger one is recorded at once)")

    def _follow(self, prog: StepProgram, sig: Any = None, grow: float = 1.0) -> SteadyStep:
        """Run the step that starts in the steady state, following ``prog`` (scaled, for inputs of signature
        ``sig``, where that is not the program's, and ``grow`` times the room it rose by where larger)."""
        prog.start_step()
        self._light_base = self._light_top = self.meter.current_bytes   # the step's start (runtime.hookless)
        self._light_external = self.meter.external.added
        self._steady = steady = SteadyStep(prog, self._steady_parts, sig=sig,
                                           swap=sig is not None and "swap" in self.policies, grow=grow)
        self._packfn = steady
        if self._soft:
            self._soften(True)
        return steady

    def _soften(self, on: bool) -> None:
        self._soft_on = on
        self.native.soften(on)

    def _offload(self, e: Any, policy: str) -> bool:
        """Evict a steady step's entry now by ``policy`` (SteadyParts.offload); the allocations it makes are
        refused, not let through (the policy stands another in, or keeps the tensor)."""
        if not self._soft_on:
            return self.residency.evict_early(e, policy)
        self._soften(False)
        try:
            return self.residency.evict_early(e, policy)
        finally:
            self._soften(True)

    def _enter_mode(self) -> None:
        """The dispatch mode runs the step from here: it retries a refused op itself (no soft cap)."""
        if self._soft_on:
            self._soften(False)
            self._recover()
        self.mode.__enter__()
        self.mode_on = True

    def _pass_cost(self) -> None:
        """The pass that ends: its host time per input element, for the regime it ran in (runtime.programs,
        ``PassCosts``: how long new sizes follow another program before they are recorded)."""
        size, self._pass_size = self._pass_size, 0
        steady = self._steady
        if not size or self.residency.survey is not None:
            return
        if steady is not None:
            if steady.off or self._retired is not None:
                return
            regime = "scaled" if steady.scaled else "own"
        elif self._program_rec is not None:
            regime = "record"
        else:
            return
        self.programs.costs.add(regime, time.perf_counter() - self._pass_started, size)

    def _pack_recording(self, t: torch.Tensor) -> Any:
        h = self._pack(t)
        rec = self._program_rec
        if rec is not None:
            rec.saved(t, h.entry if type(h) is Saved else None)
            rises = self._measuring()
            if rises is not None:
                rises.mark(False, len(rec.saves) - 1)
        return h

    def _measuring(self) -> RiseRecorder | None:
        """What measures the recording's rises between saves and reads (runtime.rises), unless a survey reads
        the same window now."""
        return self._rises if self.residency.survey is None else None

    def _evicted_bytes(self) -> int:
        return sum(p.evicted_bytes for p in self.stats.policies.values())

    def _bind(self, node: Any, st: torch.UntypedStorage) -> Any:
        slot = self.produced.add(st)
        slot.node, node.storage = node, slot
        return slot

    def _far(self) -> bool:
        """Whether the device is far from its budget (at least half of it free); the most bytes read here in
        the step are noted for its program (runtime.hookless)."""
        cur = self.meter.current_bytes
        if cur > self._light_top:
            self._light_top = cur
        return self.budget is None or self.budget - cur >= self.budget // 2

    def _light_step_ended(self, prog: StepProgram) -> None:
        """A steady step of ``prog``'s own shapes ended light (never near the budget): note how far it rose above
        its start at a save, and what it counted as saved, for the steps of ``prog`` that run without hooks."""
        # it saved a storage from before the native device not counted before (a batch made before enable()),
        # which its save counts: a step without hooks could not. Only the last light step tells: state counted
        # once (a model made before its first step) keeps no later step's hooks on
        prog.light_external = self.meter.external.added != self._light_external
        if prog.light_external:
            return
        rise = max(self._light_top - self._light_base, 0)
        prog.light_rise = rise if prog.light_rise is None else max(prog.light_rise, rise)
        prog.light_saved = (self.stats.saved_bytes_step, self.stats.saved_tensors_step)

    def _maybe_hookless(self, steady: SteadyStep) -> None:
        """At the first module call of a light steady step of its program's own shapes, its inputs bound: run it
        without the saved-tensor hooks where it keeps half the budget free by what its program's light steps
        rose (runtime.hookless)."""
        prog, budget = steady.program, self.budget
        if budget is None or not steady.light or steady.scaled or prog.light_rise is None or prog.light_external \
                or self.residency.survey is not None or self._retired is not None or not self.owner.here():
            return
        if self.meter.current_bytes + prog.light_rise + steady.headroom > budget - budget // 2:
            return
        if not self.hookless.start():
            return
        self.fixed.calls.pause()  # no module call of the step needs seeing: torch's fast path (the step's end resumes)
        if self._soft_on:
            self._soften(False)  # no save or read to recover at: the allocator refuses what crosses the cap
        self._packfn = self.store.keep  # a save that still comes to the hook (a region it was handed to)
        if self.hookless.steps == 1:
            self.stats.note("steady state: steps far from the budget run without saved-tensor hooks (their "
                            "program's light steps kept half the budget free; docs/reference.md, "
                            '"Steady state")')

    def _steady_after(self) -> None:
        """After each save and read of a steady step: what the dispatch mode does before each op, per saved
        tensor. A step whose recording came near the budget registers each entry as it is made (the allocator
        frees it at allocation time); and the most new bytes an op of the recorded step needed stay free, by
        eviction where the allocator alone could not free them (an op's own allocations cannot be retried
        without the dispatch mode)."""
        budget = self.budget
        if budget is None or self.residency.survey is not None:  # a surveyed step only measures
            return
        steady = self._steady
        store = self.store
        free = budget - self.meter.current_bytes
        if free < 0 and self._soft_on:
            self._soften(False)
            self._recover()
            self._soften(True)
            free = budget - self.meter.current_bytes
        if store.pending and ((steady is not None and steady.program.pressure) or free < budget // REGISTER_BELOW):
            store.register_pending()
        room = steady.room_now if steady is not None else 0
        if free < room and not self.plan_recomputes:  # a followed plan's order is the allocator's (planned_first)
            soft = self._soft_on  # evicting may allocate (an encoding): the runtime's own work is never let through
            if soft:
                self._soften(False)
            self.residency.relieve(room - free)
            if soft:
                self._soften(True)

    def _recover(self) -> None:
        """A steady step is over its budget: the soft cap let an allocation through that the allocator alone
        could not make room for (or bytes were counted late: a batch). Evict with every policy, as the
        dispatch mode does around a refused op; where nothing more can go, the budget is too small for the
        step and the survey measures the one it needs (runtime.survey). A refusal retires the program: the
        next step of its shape is recorded again, under the dispatch mode, which makes room around each op.
        Called with the soft cap off: what it evicts may allocate."""
        count, nbytes, held = self.native.let_through()
        budget, residency, steady = self.budget, self.residency, self._steady
        assert budget is not None
        if count and steady is not None and residency.survey is None:
            self.stats.cap_overruns += count
            if residency.need(nbytes, held) > budget:  # the dispatch mode could not have made room either
                residency.exhausted(nbytes, "an allocation of a steady-state step", held)
                return
        over = self.meter.current_bytes - budget
        if over > 0:
            residency.relieve(over)
        if count and steady is not None and residency.survey is None and self._retired is None:
            if steady.sig is not None:
                self.programs.record_next(steady.sig)  # a scaled step: its sizes get a program of their own
            else:
                self._retired = steady.program
            if self._overran:
                return
            self._overran = True  # said once: stats().cap_overruns counts them all
            self.stats.note(f"steady state: at step {self.steps.steps + 1} an allocation of {fmt_bytes(nbytes)} "
                            f"went {fmt_bytes(max(held + nbytes - self.budget, 0))} past the budget (the allocator "
                            "alone could not free enough; the step evicted to recover): its input shape is "
                            "recorded again under the dispatch mode")

    def _diverged(self, why: str) -> None:
        steady = self._steady
        resume = self.programs.left(steady.program if steady is not None else None, self.steps.steps + 1)
        self.stats.note(f"steady state left at step {self.steps.steps + 1}: {why}; the dispatch mode runs "
                        f"again from the next step" + ("" if not resume else
                                                       f" (the steps keep changing: recording again at step "
                                                       f"{resume + 1})"))
        if self.follower is not None and self.follower.state == "following":
            self.stats.plan_note = (f"{_first_clause(self.stats.plan_note)}; steady state left at step "
                                    f"{self.steps.steps + 1} ({why}): the dispatch mode follows the plan again")

    def _finish_program(self, stages: int) -> None:
        """End of a recording step: keep its program if later steps may follow it."""
        rec, self._program_rec = self._program_rec, None
        self.residency.on_evicted = None
        why = self._steady_refusal(rec)
        prog = None
        if rec is not None and not why:
            prog = rec.finish(self._module_state())
            why = prog.cannot_rebuild(rec.evicted) or self._offload_refusal(prog)
        pressure = self._pressure()
        if prog is None or why:
            self.stats.note(f"steady state: not used ({why})")
            return
        prog.stages, prog.pressure = stages, pressure
        if self.mode is not None:
            reserve = self.residency.reserve
            rises = self._rises
            most = (0, 0) if rises is None else rises.most
            prog.headroom = max(self.mode.most_new, most[0]) + reserve
            prog.gross_headroom = max(self.mode.most_new, most[1]) + reserve
            if rises is not None:
                prog.room = rises.room(len(prog.saves), rec.first_ordinals(), reserve)
        self._rises = None
        for old in self.programs.add(prog):
            old.unbind()
        self.stats.programs = self.programs.recorded
        if len(self.programs) > 1:
            self._note_shapes()
        if prog.offload:
            by = {n: sum(1 for p in prog.offload.values() if p == n) for n in sorted(set(prog.offload.values()))}
            self.stats.note(f"steady state from step {self.steps.steps + 1}: "
                            + ", ".join(f"{c} saved tensor(s) evicted by {n}" for n, c in by.items())
                            + " as they are saved (the recorded step evicted them)"
                            + ("; swap-ins prefetched in the recorded read order" if "swap" in by
                               and self._steady_parts.prefetch is not None else ""))
        if self.recorder is not None:
            self.recorder.keep = self.programs.keep()
        follower = self.follower
        if follower is not None and follower.state == "following":
            # what the plan recomputes goes first when the allocator frees; the rest after it, so that real
            # bytes the plan did not count (kernel scratch) are still made room for
            self.plan_recomputes = set(follower.recomputed)
            self.store.registrable = planned_first(self._registrable, self.plan_recomputes)
            self.stats.plan_note = (f"{_first_clause(self.stats.plan_note)}; from step {self.steps.steps + 1} in "
                                    f"the steady state: the allocator frees the {len(follower.recomputed)} "
                                    "storages the plan recomputes first, at allocation time")

    def _steady_refusal(self, rec: ProgramRecorder | None) -> str:
        if rec is None or not rec.saves:
            return "the step saved nothing"
        if not self.steps.modules:
            return "steps start at module calls only"
        refused = self._refusals() - self._refused_before
        rescues = {n: c - self._rescues_before.get(n, 0) for n, c in self.residency.rescues.items()}
        # what swap or compress evicted to make room is evicted as it is saved in the steady state; what
        # recompute evicted (or nothing, where the retry fitted) only the dispatch mode would evict again
        if refused and (rescues.get("recompute", 0) or not any(rescues.values())):
            # the allocator alone (all a steady-state step has) could not free enough there: the dispatch
            # mode evicted the rest around the op it retried
            return f"the allocator alone ran out {refused} time(s) in the recorded step; the dispatch mode made room"
        return ""

    def _refusals(self) -> int:
        """Allocations refused in ops (or in regenerations) so far that the dispatch mode caught, made room for
        and retried; not those of the policies' own work at the cap (an encoding refused its buffer), which
        another policy stood in for."""
        return self.meter.oom_retries if self.native is not None else 0

    def _offload_refusal(self, prog: StepProgram) -> str:
        """Why the program cannot evict at pack what its recorded step compressed, or "". On CUDA compress
        may only use a codec that decides without reading the bytes on the host (a bool mask's bitmask):
        the others wait for the device. Those saves are swapped instead where swap is a policy."""
        if self.device.type != "cuda":
            return ""
        compress = self.policies.get("compress")
        for k, policy in list(prog.offload.items()):
            codec = prog.codecs.get(k, "")
            if policy != "compress" or compress is None or not compress.reads_bytes_to_decide(codec):
                continue
            if "swap" not in self.policies:
                return (f"the recorded step compressed a tensor with the {codec!r} codec, which decides from the "
                        "tensor's bytes (on CUDA a host wait for the device in each step); add swap to the "
                        "policies to have the steady state swap such tensors instead")
            prog.offload[k] = "swap"
        return ""

    def _pressure(self) -> bool:
        """Whether the step that is ending came near its budget (entries registered or evicted)."""
        return (self.store.registrations > self._registered_before
                or any(p.evicted > self._evicted_before.get(n, 0) for n, p in self.stats.policies.items()))

    def _module_state(self) -> set[int]:
        """Storage ids of the parameters and buffers of every module called so far."""
        out: set[int] = set()
        for r in self.fixed.modules():
            for t in (*r._parameters.values(), *r._buffers.values()):
                if t is not None:
                    out.add(id(t.untyped_storage()))
        return out

    def _begin_recording(self) -> None:
        """Record this step's program (the step has started; none of its ops has run)."""
        self._program_rec = ProgramRecorder()
        self._packfn = self._pack_recording
        self._count_from_here(self._program_rec)

    def _count_from_here(self, rec: ProgramRecorder) -> None:
        """What the recorded step evicts, registers and is refused is counted from here."""
        self._evicted_before = {n: p.evicted for n, p in self.stats.policies.items()}
        self._registered_before = self.store.registrations
        self._refused_before = self._refusals()
        self._rescues_before = dict(self.residency.rescues)
        self.residency.on_evicted = rec.evicted_entry
        if self.mode is not None:
            self.mode.most_new = 0
        self._rises = RiseRecorder(self._window, self._evicted_bytes) if self._window is not None else None


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


def _first_clause(note: str) -> str:
    """A plan note without what the steady state added to it (``; ...``)."""
    return note.split("; ", 1)[0]

"""The runtime's hooks: the global module pre-hook that starts steps, the saved-tensor pack and unpack hooks,
and what runs when a step starts and ends.

:class:`StepHooks` is one job of :class:`~.compose.Runtime` (which it is mixed into); what it reads of the rest
of the runtime is annotated on the class. Each hook hands the step to its regime (runtime.steady_control):
the dispatch mode's pack, a recording's, or a steady step's.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..errors import CaptureError
from ..graph.optstate import optimizer_state
from ..graph.outputs import storage_of
from ..native.capture import capturing
from .estimate import OutputEstimator
from .hookless import Hookless, RootHooks
from .module_state import FixedMarker
from .meter import Meter
from .activations import ProducedTable
from .residency import Residency
from .rng import rng_state
from .saved import Kept, Saved, SavedStore
from .stats import StatsRecorder
from .steps import FORWARD, StepTracker
from .threads import OwnerThread


class StepHooks:
    """The hooks (see the module docstring)."""

    # what it reads of the runtime (built by Runtime.__init__)
    device: torch.device
    meter: Meter
    produced: ProducedTable
    store: SavedStore
    residency: Residency
    stats: StatsRecorder
    steps: StepTracker
    fixed: FixedMarker
    follower: Any       # PlanFollower | None (runtime.follow)
    hookless: Hookless
    root_hooks: RootHooks
    estimator: OutputEstimator
    owner: OwnerThread
    mode: Any           # RuntimeMode | None (runtime.dispatch_mode)
    recorder: Any
    prefetcher: Any
    buckets: Any
    fsdp_sync: Any
    _policy_step_ends: list[Any]

    def _init_hooks(self) -> None:
        self._calls = 0                      # module calls in this step (random ops' states are read at them)
        self._last_random_call = -1          # the module call after which the last random op ran
        self._module: torch.nn.Module | None = None
        self._shapes: list[torch.Size] = []  # the shapes of the step's inputs (from the second step on)

    def _module_called(self, module: torch.nn.Module) -> None:
        """Global module pre-hook (every thread): steps start on the installing thread only."""
        if not self.owner.here():
            self.owner.foreign_module_call()
            return
        steps = self.steps
        if self.steady_possible and steps.phase != FORWARD and torch.is_grad_enabled() \
                and torch._C._current_graph_task_id() == -1:
            self.hookless.restore()  # the last step may have run without the hooks: this one decides again
            self._choose_step()  # a step starts here: with the dispatch mode, or in the steady state
        steps.module_called()
        self._calls += 1
        self._module = module
        if self._calls == 1 and self.root_hooks.module() is None:  # the first model, or one after it
            self.root_hooks.attach(module)
        steady = self._steady
        if steady is None or self.hookless.active:  # without hooks: nothing of the program is followed
            return
        if steady.off:
            if not self.mode_on and steps.phase == FORWARD and torch._C._current_graph_task_id() == -1 \
                    and not self.mode.quiet_depth and _get_current_dispatch_mode() is self._below:
                # the step left its program part-way: the dispatch mode takes the rest of it over from this
                # module call, evicting as the budget needs (the allocator alone frees only what is registered)
                self._enter_mode()
        elif self._calls in steady.program.random_at:
            why = steady.program.module_called(self._calls, module, self._rng_now)
            if why:
                steady.leave(why)

    def _root_called(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The root's pre-hook (runtime.hookless.RootHooks), with keyword arguments: from the second step on, the
        step's tensor arguments (the batch) are given to the program."""
        if self.fixed.calls.paused:
            # a step run without hooks that has not ended: its forward raised (this call starts the next step,
            # unseen by the module pre-hook), or it calls the model again; the hook goes back first
            self.fixed.calls.resume(m, args)
        if self.mode is not None and self._calls == 1:
            self._step_inputs([*(a for a in args if isinstance(a, torch.Tensor)),
                               *(kwargs[k] for k in sorted(kwargs) if isinstance(kwargs[k], torch.Tensor))])

    def _root_returned(self, m: torch.nn.Module, args: tuple, out: Any) -> None:
        if self.mode is not None:
            self.hookless.root_returned(out)

    def _step_inputs(self, tensors: list[torch.Tensor]) -> None:
        self._pass_size = sum(t.numel() for t in tensors)
        self._shapes = [t.shape for t in tensors]
        if self.recorder is not None:
            self.recorder.as_inputs(tensors)
        count = self.store.count_external
        if count is not None:
            # the batch is training state even where autograd saves none of it (an attention mask)
            for t in tensors:
                st = storage_of(t) if t.device == self.device else None
                if st is not None:
                    count(st)
            # counted here with or without the saved-tensor hooks: not what keeps a step's hooks on
            self._light_external = self.meter.external.added
        steady = self._steady
        if steady is not None and not steady.off:
            why = steady.program.bind_inputs(tensors)
            if why and steady.k == 0:
                self._restart_step(steady, tensors)  # no op has run: follow their program, or record one
            elif why:
                steady.leave(why)
            elif steady.k == 0:
                self._maybe_hookless(steady)
        if self._program_rec is not None:
            self._program_rec.step_inputs(tensors)

    def _rng_now(self) -> Any:
        return rng_state(self.device)

    def _random_recorded(self, rec: Any, explicit: bool) -> None:
        """The recorder recorded a random op: note after which module call it was the first one."""
        first = not explicit and self._last_random_call != self._calls
        self._last_random_call = self._calls
        if self._program_rec is not None:
            self._program_rec.random_at(rec, self._calls if first else 0, self._module)

    def _pack_plain(self, t: torch.Tensor, st: torch.UntypedStorage) -> Any:
        return self.store.pack_slot(t, st, self.produced.add(st), False)

    def _pack_hook(self, t: torch.Tensor) -> Any:
        if capturing():  # CUDA graph capture: kept as it is (no eviction, pinned allocation, event or RNG read)
            return self.store.keep(t)
        return self._packfn(t)

    def _unpack_hook(self, h: Any) -> torch.Tensor:
        steady = self._steady
        if type(h) is Kept and steady is not None and steady.light and self.steps.in_backward:
            return h.read()  # a light steady step: nothing was rebuilt, and nothing needs room far from the budget
        if capturing():  # kept during capture: no steady-state bookkeeping, no eviction for room
            return self.store.unpack(h)
        if steady is not None:
            if not self.steps.in_backward:
                self.steps.backward_seen()  # no op is observed in the steady state: the first read says it
            if self.store.pending:
                # backward makes no saves: what the forward left pending, and entries rebuilt since, are
                # registered here, as the dispatch mode does before an op that nears the budget (mode._cap)
                self._steady_after()
            if type(h) is not Saved or not self._soft_on:
                steady.unpacked(h)
                t = self.store.unpack(h)
            else:  # a rebuild or prefetch allocates: refused, the runtime's own work retries after evicting
                self._soften(False)
                try:
                    steady.unpacked(h)
                    t = self.store.unpack(h)
                finally:
                    self._soften(True)
            self._steady_after()  # what this read rebuilt may be freed for the op reading it; room for that op
            return t
        if self._program_rec is not None and type(h) is Saved:
            self._program_rec.read(h.entry)
            t = self.store.unpack(h)
            rises = self._measuring()
            if rises is not None:
                rises.mark(True, h.entry.uid)
            return t
        return self.store.unpack(h)

    def _working_budget(self, budget: int) -> None:
        """The budget the dispatch mode makes room under (a surveyed step raises it: runtime.survey)."""
        if self.mode is not None:
            self.mode.budget = budget

    def _prefetch_one(self, e: Any) -> bool:
        return bool(self.residency.prefetch_one(e))

    def _step_started(self) -> None:
        self._calls, self._last_random_call, self._module = 0, -1, None
        self._pass_started, self._pass_size = time.perf_counter(), 0
        self.store.epoch += 1
        self.stats.step_started()
        self.estimator.new_step()
        self.residency.forget_offers()
        if self.follower is not None:
            self.follower.step_started()
        if self._program_rec is not None:
            self._count_from_here(self._program_rec)
        else:
            self.residency.on_evicted = None

    def _step_ended(self, stages: int) -> None:
        self._module = None
        hookless = self.hookless.active
        self.hookless.step_ended()
        self.fixed.calls.resume()  # the next step's first module call is seen again, whatever module it is
        if self._soft_on:
            self._soften(False)
            self._recover()  # a refusal in the step's last ops, after its last read
        self._pass_cost()
        survey = self.residency.survey
        if survey is not None:
            survey.steps_ended += 1  # a step over the budget, measured: raised from backward() below
            if self._shapes:
                survey.inputs.append(", ".join(str(list(s)) for s in self._shapes))
        steady = self._steady
        if steady is not None:
            self._steady = None
            self._packfn = self._pack
            stages = steady.program.stages
            self.stats.steady_steps += 1
            if self._retired is not None:
                self._retired, retired = None, self._retired
                self.programs.drop(retired)
                retired.unbind()
            elif hookless:
                # it saved as its program's light steps did (runtime.hookless): what they counted
                self.stats.saved_bytes_step, self.stats.saved_tensors_step = steady.program.light_saved
                steady.program.unbound = True  # no save bound a node: its next start forgets less
                self.programs.followed()
            elif steady.complete:
                if steady.light and not steady.scaled:
                    self._light_step_ended(steady.program)
                self.programs.followed()
            elif not steady.off:
                self._steady = steady  # _diverged reads the program the step left
                self._diverged(f"the step saved {steady.k} tensors where the recorded step saved "
                               f"{len(steady.saves)}")
                self._steady = None
        elif self._program_rec is not None:
            self._finish_program(stages)
        self.store.drain()
        for hook in self._policy_step_ends:
            hook()
        self.stats.step_done(stages)
        self.fsdp_sync.refresh()
        if self.recorder is not None:
            self.recorder.end_step()
        if self.prefetcher is not None:
            self.prefetcher.step_ended()
        if self.follower is not None and steady is None:  # a steady step ran no op the follower sees
            self.follower.step_ended(stages)
        if self.buckets is not None:
            self.buckets.step_ended()
        if survey is not None:  # the step ran on uncapped to measure what it needs (runtime.survey)
            with self.residency.mode.quiet():  # sizing an optimizer's state runs ops on meta copies
                to_come = self._state_to_come()
            if to_come and survey.steps_ended == 1:
                # the optimizers' first step is to come, and every later step holds their state: measure the
                # next step too, evicting from its start as a run at what this one needed with that state would
                survey.carry(to_come)
                self.residency.evict_as_needed()
                return
            if steady is not None and survey.steps_ended == 1:
                # a steady step runs no op the survey can measure (only replays): the next step runs under the
                # dispatch mode, still uncapped, and measures every op before the budget is named
                survey.note(self.meter.peak_bytes, "the peak of a steady-state step (held uncapped)", True)
                survey.carry(0)
                for prog in self.programs.clear():
                    prog.unbind()
                self.residency.evict_as_needed()
                return
            raise self.residency.end_survey()

    def _state_to_come(self) -> int:
        """Bytes of state on this device that the optimizers stepping the model will hold and hold none of yet
        (their first step makes it), sized without stepping them."""
        total = 0
        for opt in self.fixed.optimizers():
            if any(opt.state.get(p) for g in opt.param_groups for p in g["params"]):
                continue
            try:
                states, _ = optimizer_state(opt)
            except (CaptureError, RuntimeError, TypeError):  # an optimizer that cannot be sized without a step
                continue
            total += sum(t.nbytes for t in states if t.on_device and t.param.device == self.device)
        return total

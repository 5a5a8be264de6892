"""The runtime's dispatch mode: the meter's mode plus what the runtime does around each op.

Per op, in order: the meter registers inputs; the step tracker assigns the stage index; a plan's
regenerations for this stage run; the cap makes room for the op's estimated new bytes. After it:
new output storages join the produced table (they are activations; anything else is fixed); the
meter registers them and samples the peak; lineage is recorded (recompute enabled, forward pass);
a plan's evictions for this stage run; the estimator learns the op's bytes.

Far below the budget (or without one) this is a few dictionary lookups and attribute reads per op on
top of the meter; per-op facts are cached by ``id(func)`` (hashing an ``OpOverload`` runs Python).
On the simulated device an op's new output storage gets one weak reference shared by the meter and
the produced table (:meth:`~.activations.ProducedTable.new`), and with nothing to manage (no budget,
plan or lineage) every op takes ``_monitor_op``: the meter's and the runtime's work in one function.
Work the runtime does itself is either *quiet* (not metered, not counted: policies) or *internal*
(metered and capped, but no stage, no lineage: recompute's replayed ops).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..graph.ops import uses_rng
from ..graph.outputs import storage_of as _storage, walk_outputs
from .meter import Meter, MeterMode, _register, _register_inputs, _reread_written
from .opfacts import FACTS, OpFacts, facts
from .parts import ModeRuntime
from .rng import RngBefore, host_state, rng_state
from .saved import REGISTER_BELOW

Tensor = torch.Tensor


class RuntimeMode(MeterMode):
    """``MeterMode`` subclass driving the runtime (see the module docstring)."""

    def __init__(self, meter: Meter, rt: ModeRuntime):
        super().__init__(meter)
        self.rt = rt
        self.depth = 0          # > 0 while inside this mode's handler (the mode is off for nested ops)
        self.quiet_depth = 0    # > 0: ops pass through unseen (policy work)
        self.internal = 0       # > 0: ops are the runtime's own work (metered, capped, not stages)
        self.budget = rt.budget
        self.recorder = rt.recorder
        self.prefetcher = rt.prefetcher
        self.steps = rt.steps
        self.estimator = rt.estimator
        self.produced = rt.produced
        self.slots = rt.produced.slots
        self.residency = rt.residency
        self.store = rt.store
        self.stats = rt.stats
        self.clock = rt.clock
        self._stage = -1
        self.most_new = 0       # the most new bytes an op was estimated to need (since the runtime reset it)
        # below this headroom, new saved activations are registered with the native allocator device
        self._register_below = (self.budget or 0) // REGISTER_BELOW
        self._facts: OpFacts | None = None
        self._recording = False
        self._rng: Any = None
        # Monitor-only on the simulated device (no budget, plan, lineage or prefetch): every op takes
        # _monitor_op, the meter's and the runtime's per-op work in one function.
        self._fast = (self._sim and self.budget is None and self.recorder is None and rt.follower is None
                      and self.prefetcher is None and rt.buckets is None and not meter.raise_on_exceed
                      and meter.on_pressure is None)

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]  # torch declares a classmethod
        """True once the runtime let go of this mode (``disable()`` on another thread leaves it on the
        enabling thread's stack, passing every op through, see runtime.threads): Dynamo then compiles
        beside it instead of skipping every frame while a mode is on the stack."""
        return self.rt.mode is not self

    # ---- contexts for the runtime's own work -----------------------------------------------------
    @contextmanager
    def quiet(self) -> Iterator[None]:
        self.quiet_depth += 1
        try:
            yield
        finally:
            self.quiet_depth -= 1

    @contextmanager
    def metered(self) -> Iterator[None]:
        self.internal += 1
        saved = (self._stage, self._facts, self._recording, self._rng)  # the op in flight
        try:
            # Inside the handler PyTorch popped this mode: regenerating runs under it, so its ops are capped
            # one by one. In a steady-state step (runtime.program) it is not entered at all, and regenerating
            # runs without it: the native allocator device caps each allocation (freeing registered entries)
            # and the replay reruns an op it refused after the runtime evicts (Replayer.retry).
            if self.depth or (not self.rt.mode_on and self.rt.native is None):
                with self:
                    yield
            else:
                yield
        finally:
            self.internal -= 1
            self._stage, self._facts, self._recording, self._rng = saved

    # ---- dispatch --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.quiet_depth:
            return func(*args, **(kwargs or {}))
        if kwargs is None:
            kwargs = {}
        if self._fast and not self.internal:
            return self._monitor_op(func, args, kwargs)
        self.depth += 1
        try:
            return self.run_op(func, args, kwargs)
        finally:
            self.depth -= 1

    def _monitor_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``before_op``, the op and ``after_op`` when there is nothing to manage (see ``_fast``)."""
        m = self.meter
        live = self._live
        _register_inputs(m, live, args, kwargs)
        self.clock.now += 1
        f = self._facts = FACTS.get(id(func)) or facts(func)
        steps = self.steps
        self._stage = steps.observe(f.stage, args)
        self.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= 1
        fresh, _ = self._outputs(f, out)
        if fresh:  # as in capture: what a non-stage op allocates belongs to the last stage
            stage = steps.stage
            for _, slot, _ in fresh:
                slot.stage = stage
        if f.may_resize:
            _reread_written(m, func, args, kwargs)
        if m._current > m._peak:
            m._peak = m._current
        # what no budget could evict here: all but the saved activations alive (a lower bound: min_budget_bytes)
        floor = m._current - self.produced.saved_live
        if floor > self.stats.min_budget_bytes:
            self.stats.min_budget_bytes = floor
        self.store.last_op = f.name
        if f.collective:
            self.rt.fsdp_sync.after_op(func, args, kwargs)
        return out

    def before_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self._sim:
            _register_inputs(self.meter, self._live, args, kwargs)
        self.clock.now += 1
        f = self._facts = FACTS.get(id(func)) or facts(func)
        if self.internal:
            self._stage = -1
            if self.budget is not None:
                self._cap(func, args, kwargs, -1, f)
            return
        stage = self._stage = self.steps.observe(f.stage, args)
        if stage >= 0:
            follower = self.rt.follower   # read from the runtime: a plan book switches it per step
            if follower is not None:
                follower.before(stage, func)
            if self.prefetcher is not None and self.steps.in_backward:
                ahead = self.prefetcher.at(stage)
                if ahead:
                    self.residency.prefetch(ahead)
        if self.budget is not None:
            self._cap(func, args, kwargs, stage, f)
        if self.recorder is not None:
            rec = self._recording = self.steps.recording
            if rec:
                # reading a generator's state allocates a few KB through the capped allocator: as an op's
                # allocation, one that would cross the budget makes room first
                self._rng = (RngBefore(self.meter.retry_oom(rng_state, _device(args, kwargs)),
                                       self.meter.retry_oom(_generator_states, args, kwargs))
                             if f.maybe_rng and uses_rng(func, args, kwargs) else None)

    def after_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        f = self._facts or facts(func)
        m = self.meter
        if self._sim:
            # One pass over the outputs: new storages join the meter, and those at fresh return
            # positions the produced table too, sharing one weak reference (ProducedTable.new).
            fresh, nbytes = self._outputs(f, out)
            if f.may_resize:
                _reread_written(m, func, args, kwargs)
            if m.raise_on_exceed and m.budget_bytes is not None and m._current > m.budget_bytes:
                m._after_op_over(nbytes, func)
            if m._current > m._peak:
                m._peak = m._current
        else:
            fresh, nbytes = self._fresh(f, out) if f.any_fresh else (_NONE, 0)
            MeterMode.after_op(self, func, args, kwargs, out)
        budget = self.budget
        if self.internal:
            if budget is not None and m.current_bytes > budget:
                self._overrun(f)
            return
        follower = self.rt.follower
        if budget is None and follower is None:  # measuring per op: what no budget could evict here
            floor = m.current_bytes - self.produced.saved_live
            if floor > self.stats.min_budget_bytes:
                self.stats.min_budget_bytes = floor
        self.store.last_op = f.name
        if fresh:  # as in capture: what a non-stage op allocates belongs to the last stage
            st = self.steps.stage
            for _, slot, _ in fresh:
                slot.stage = st
        stage = self._stage
        rec = self.recorder
        if rec is not None:
            if self._recording:
                rec.record(func, args, kwargs, self._rng, fresh, out, nbytes)
                self._rng = None
            elif f.writes:
                rec.unrecorded_write(func, args, kwargs)
        if f.collective:
            self.rt.fsdp_sync.after_op(func, args, kwargs)
        if budget is not None:
            self.estimator.learn(stage, func, nbytes, args)
            if m.current_bytes > budget:
                self._overrun(f)
        if follower is not None:
            if stage >= 0:
                follower.after(stage, func, fresh)
            elif fresh:
                follower.after_other(fresh)

    # ---- helpers -----------------------------------------------------------------------------------
    def _outputs(self, f: OpFacts, out: Any) -> tuple[list[tuple[int, Any, Tensor]], int]:
        """Simulated device: register the op's outputs with the meter; those at fresh return positions
        (not aliases of inputs) that neither the meter nor the produced table knows are activations.
        Returns (output position, slot, tensor) of those and their bytes."""
        if type(out) is Tensor:  # the common case (hybridmem.graph.outputs, "Fast path")
            try:
                st = out.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return _NONE, 0
            k = id(st)
            if k in self._live:  # a view, an in-place result, or an input returned
                return _NONE, 0
            nb = st.nbytes()
            if f.any_fresh and k not in self.slots:
                return [(0, self.produced.new(st, k, nb), out)], nb
            self.meter._add(st)
            return _NONE, 0
        res: list[tuple[int, Any, Tensor]] = []
        nbytes = 0
        live, slots, flags = self._live, self.slots, f.fresh
        nflags = len(flags)
        for i, pos, t in walk_outputs(out):
            if not isinstance(t, Tensor):
                continue
            new = i < nflags and flags[i]
            if type(t) is not Tensor:  # a subclass (DTensor): produced by its own storage, metered by its inner ones
                st = _storage(t)
                if new and st is not None and id(st) not in slots and id(st) not in live:
                    res.append((pos, self.produced.add(st), t))
                    nbytes += st.nbytes()
                _register(self.meter, live, t)
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            k = id(st)
            if k in live:
                continue
            if new and k not in slots:
                nb = st.nbytes()
                res.append((pos, self.produced.new(st, k, nb), t))
                nbytes += nb
            else:
                self.meter._add(st)
        return res, nbytes

    def _fresh(self, f: OpFacts, out: Any) -> tuple[list[tuple[int, Any, Tensor]], int]:
        """CUDA: new output storages (not aliases of inputs), registered as produced, with positions."""
        slots = self.slots
        if isinstance(out, Tensor):
            try:
                st = out.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return _NONE, 0
            if id(st) in slots:
                return _NONE, 0
            return [(0, self.produced.add(st), out)], st.nbytes()
        res: list[tuple[int, Any, Tensor]] = []
        nbytes = 0
        flags = f.fresh
        nflags = len(flags)
        for i, pos, t in walk_outputs(out):
            if i < nflags and flags[i] and isinstance(t, Tensor):
                st = _storage(t)
                if st is not None and id(st) not in slots:
                    res.append((pos, self.produced.add(st), t))
                    nbytes += st.nbytes()
        return res, nbytes

    def _cap(self, func: Any, args: tuple, kwargs: dict, stage: int, f: OpFacts) -> None:
        if not f.any_fresh:  # views and in-place ops allocate nothing, but storages first seen as their
            if self.meter.current_bytes > self.budget:  # inputs (DDP's buckets) may have just been counted
                self.residency.make_room(0, f"op {f.name} (storages it reads, counted from now on)")
            return
        headroom = self.budget - self.meter.current_bytes
        if headroom < self._register_below and self.store.pending:
            self.store.register_pending()  # near the budget: let the allocator free what recompute rebuilds
        est = self.estimator.estimate(stage, func, args, kwargs, headroom, self.budget)
        if est > self.most_new:
            self.most_new = est
        if est + self.residency.reserve > headroom:
            self.residency.make_room(est, f"op {f.name}")

    def _overrun(self, f: OpFacts) -> None:
        """Live bytes exceeded the budget after an op (its estimate was too low): evict now."""
        self.stats.cap_overruns += 1
        self.residency.relieve(self.meter.current_bytes - self.budget)
        if self.meter.current_bytes > self.budget and self.residency.survey is None:
            self.residency.refuse(0, f"the output of op {f.name}")

    def run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        residency = self.residency
        if residency.survey is None:
            return MeterMode.run_op(self, func, args, kwargs)
        # a step the budget could not hold, going on uncapped (runtime.survey): what each op needed, the ops
        # that rebuild a tensor included (a recompute's replay runs its ops under this mode)
        start, read = self.rt.op_peak
        mark = start()
        out = MeterMode.run_op(self, func, args, kwargs)
        if residency.survey is not None:
            inputs = {id(st) for t in _tensor_args(args, kwargs) if (st := _storage(t)) is not None}
            residency.survey_op(read(mark), inputs, f"op {(self._facts or facts(func)).name}")
        return out


_NONE: list = []


def _tensor_args(args: tuple, kwargs: dict) -> list[Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            out.append(a)
        elif type(a) is list or type(a) is tuple:
            out.extend(b for b in a if isinstance(b, Tensor))
    return out


def _generator_states(args: tuple, kwargs: dict) -> dict[int, Any]:
    """States of explicit ``generator=`` arguments before the op draws from them."""
    return {id(g): host_state(g.get_state()) for g in (*args, *kwargs.values()) if isinstance(g, torch.Generator)}


def _device(args: tuple, kwargs: dict) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            return a.device
    d = kwargs.get("device")
    return torch.device(d) if d is not None else torch.device("cpu")

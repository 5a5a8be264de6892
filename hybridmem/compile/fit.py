"""The plan → compile → run → plan-again loop of one compiled region (:func:`compile_fitted`).

A plan is made on a count; Inductor's step can hold more than the count. With ``verify`` the backend runs
each compiled region once (:mod:`hybridmem.compile.trial`) and, where it held more than its share, plans it
again with the excess more left free. Where a plan needs a little more than the budget leaves once the
margin for Inductor's buffers is taken, it is planned with less margin and the run checks it; where the
earlier regions keep too much beside it, it is planned above the budget while they make room
(:mod:`hybridmem.compile.regions`). :class:`FitState` is where the loop stands.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import fx

from ..errors import BudgetInfeasibleError
from ..graph.units import fmt_bytes
from ..native import cpumeter
from . import codec_ops
from . import trial as trial_mod
from . import tuning
from .planner import Planner
from .regions import Key, RegionState, Regions
from .sizes import PlannedSizes
from .stats import RegionStats, sizes_line
from .variants import Planned

__all__ = ["FitState", "compile_fitted"]

# warnings name the frame that compiles the region (the backend's _build): this module's frames, and the
# backend's _compile_checked, stand between
_STACK = 5


class Fitting(Protocol):
    """What the loop reads and sets on the backend (:class:`~hybridmem.compile.backend.CompileBackend`)."""

    verify: bool
    hold_outputs: bool
    _dev: torch.device | None
    _revision: int                       # bumped at each plan made again: the partition's cache key
    planner: Planner                     # what its last plan left: margin_now, slack_now, planned_now
    regions: Regions

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any: ...

    def _budget_bytes(self, dev: torch.device) -> int: ...


@dataclass
class FitState:
    """Where the loop over one region's plans stands."""

    key: Key
    region: RegionState
    dev: torch.device
    measured_on: list[Any] | None        # the run's inputs, at the planned sizes; None: ``why_not`` says why
    why_not: str
    level: int | None                    # the CPU meter's bytes before compiling (None: not installed)
    runs: list[trial_mod.Trial] = field(default_factory=list)   # the plans' runs, with the other runs' bytes
    compiled: Any = None                 # the compiled function of the plan made last
    st: RegionStats | None = None        # its stats
    before: int = 0                      # the extra margin of the plan tried last
    others: int = 0                      # of its run's peak, what the other runs in flight held
    earlier_s: float = 0.0               # the planning seconds of the plans made before this one
    least_tried: bool = False            # the count's least plan tried (more left free than it allows)
    shrunk: int = 0                      # bytes the margin was lowered by to find a plan (the run checks it)
    shrinks: int = 0
    unshrunk: BudgetInfeasibleError | None = None   # the error with the whole margin, raised where unchecked


def compile_fitted(b: Fitting, key: Key, gm: fx.GraphModule, example_inputs: list[Any],
                   sizes: PlannedSizes) -> Any:
    """Compile the region and, with ``verify``, run it once (:mod:`hybridmem.compile.trial`); where its real
    peak exceeds its share, plan and compile it again with the excess (and :data:`tuning.REPLAN_SLACK` of its
    keep-all peak) more left free, up to :data:`tuning.REPLANS` times; where that leaves the count no plan, once
    more with the count's least plan."""
    region = b.regions[key]
    region.extra = 0
    dev = b._dev or torch.device("cpu")
    # the run's inputs, made before the level is read: they are not the compile's
    measured_on, why_not = _at_planned_sizes(sizes, example_inputs) if b.verify else (None, "")
    native = cpumeter.load() if dev.type == "cpu" else None
    level = native.current_bytes if native is not None and native.installed else None   # before compiling
    f = FitState(key, region, dev, measured_on, why_not, level)
    while True:
        b.planner.planned_now = None
        if f.st is not None:
            f.earlier_s = f.st.plan_s           # the last plan's, which holds those before it
        try:
            f.compiled = b._compile(gm, example_inputs)
        except BudgetInfeasibleError as e:
            _plan_again_or_raise(b, f, e, example_inputs)
            continue
        if _stands(b, f, len(example_inputs)):
            return f.compiled


def _plan_again_or_raise(b: Fitting, f: FitState, e: BudgetInfeasibleError, example_inputs: list[Any]) -> None:
    """The compile had no plan (``e``): set up the next plan (less margin, a lifted budget, the count's least
    plan), or raise."""
    key = f.key
    short = (e.minimum_bytes or 0) - b.regions.budget_for(key, f.dev)
    if not f.runs and b.verify and f.shrinks < tuning.SHRINKS and e.minimum_bytes is not None \
            and 0 < short <= b.planner.margin_now + b.planner.slack_now:
        # a plan may fit with less left free for Inductor's buffers than the margin (a guess): plan with what
        # the budget leaves (the least named is a bound: again with what the next error names, a few times);
        # the run measures the step and plans again where it holds more
        f.shrinks += 1
        f.shrunk, f.unshrunk = f.shrunk + short, f.unshrunk or e
        f.region.extra -= short
        b._revision += 1
        return
    if not f.runs or f.st is None:
        err = f.unshrunk or e
        if b.regions.may_lift(key, err, b._budget_bytes(f.dev)):
            # the earlier regions keep too much beside it: planned at the least budget it has a plan for, with
            # the whole margin, while they make room (Regions.ask_room)
            f.region.lift = int(err.minimum_bytes)          # type: ignore[arg-type]
            f.region.extra, f.shrunk, f.shrinks, f.unshrunk = 0, 0, tuning.SHRINKS, None
            b._revision += 1
            return
        if f.unshrunk is not None:
            raise f.unshrunk from None
        raise e
    room = b.regions.budget_for(key, f.dev) - f.st.min_budget_bytes   # above the least, with the last margin
    if not f.least_tried and room > 0:
        # more left free than the count allows: its least plan, the one that recomputes most
        f.least_tried = True
        f.region.extra = f.before + room
        b._revision += 1
        return
    raise _no_fit(b, f, f.measured_on or example_inputs) from None


def _stands(b: Fitting, f: FitState, n_inputs: int) -> bool:
    """Whether the plan just compiled stands: it was not run, or its run fits its share, or it is the last one
    tried (a warning says by how much it does not fit); else the next plan leaves the excess more free."""
    st, planned = f.region.stats, b.planner.planned_now
    f.st = st
    if st is not None and f.earlier_s:
        st.plan_s += f.earlier_s          # every plan made for this compile counts as its planning
    if st is not None and f.shrunk and not f.runs:
        st.add_note(f"planned with {fmt_bytes(f.shrunk)} less left for Inductor's buffers than the margin "
                    f"(the budget leaves no more), checked by its run when compiled")
    if planned is None or st is None or not b.verify:
        return True          # no joint graph was planned (an inference region), or not asked
    got = _trial(b, f, st, planned, n_inputs)
    if got is None:
        return True
    f.runs.append(got)
    st.replans = len(f.runs) - 1
    st.trial_peak_bytes, st.trial_s = got.peak_bytes, sum(r.seconds for r in f.runs)
    if got.peak_bytes <= st.budget_bytes:
        return True
    if len(f.runs) > tuning.REPLANS:
        _warn_over(f, st)
        return True
    f.before = f.region.extra
    stopped = sum(r.refused for r in f.runs[:-1])
    slack = tuning.REPLAN_SLACK * (2 ** stopped if got.refused else 1)
    f.region.extra += got.peak_bytes - st.budget_bytes + int(slack * st.keep_all_peak_bytes)
    b._revision += 1
    return False


def _trial(b: Fitting, f: FitState, st: RegionStats, planned: Planned, n_inputs: int) -> trial_mod.Trial | None:
    """The compiled plan run once, its peak with what the other runs in flight (and, on CUDA, the device's
    other tensors) hold; None where it cannot run here (its plan stands as counted)."""
    mutated = trial_mod.mutated_inputs(n_inputs)
    try:
        if f.measured_on is None:
            raise trial_mod.NotMeasurable(f.why_not)
        got = trial_mod.run(f.compiled, f.measured_on, f.dev, mutated,
                            cap_bytes=st.budget_bytes - planned.others_bytes, level=f.level,
                            hold_outputs=b.hold_outputs)
    except Exception as e:      # a region that cannot run here: its plan stands as counted
        if f.unshrunk is not None:
            raise f.unshrunk from e
        reason = str(e) if isinstance(e, trial_mod.NotMeasurable) else f"{type(e).__name__}: {str(e)[:160]}"
        st.add_note(f"not run at compile time ({reason})")
        warnings.warn(f"hybridmem compile: {st.name}: its compiled step could not be run once to measure its "
                      f"real peak ({reason}); the plan stands as counted, and the step may exceed the "
                      "budget by what Inductor holds beyond the count", RuntimeWarning, stacklevel=_STACK)
        return None
    if st.codec_region:
        codec_ops.reset_stats(st.codec_region)     # a run at compile time is not a step
    f.others = planned.others_bytes
    if got.device_other_bytes and not any(k != f.key for k in b.regions.planned()):
        # CUDA, the first region: the budget caps the allocator's bytes, and what it held besides this
        # region's inputs (library workspaces, other tensors) is in every step's peak. (A later region
        # runs beside the earlier ones' saved tensors, which its share already leaves out.)
        f.others += got.device_other_bytes
        if not f.runs:
            st.add_note(f"the device held {fmt_bytes(got.device_other_bytes)} besides its inputs when it "
                        f"ran (CUDA workspaces, other tensors): counted in its peak")
    return replace(got, peak_bytes=got.peak_bytes + f.others)


def _warn_over(f: FitState, st: RegionStats) -> None:
    """The last plan tried held more than its share when run: it stands, and the stats and a warning say so."""
    got = f.runs[-1]
    over = got.peak_bytes - st.budget_bytes
    more = "more than " if got.refused else ""
    st.add_note(f"its compiled step held {more}{fmt_bytes(got.peak_bytes)}, more "
                f"than its share {fmt_bytes(st.budget_bytes)}, after {len(f.runs)} plans")
    warnings.warn(f"hybridmem compile: {st.name}'s compiled step, run once when it compiled, held "
                  f"{more}{fmt_bytes(got.peak_bytes)}, more than its share of the "
                  f"budget ({fmt_bytes(st.budget_bytes)}), after {len(f.runs)} plans each with more left free for "
                  f"Inductor's buffers: the steps will exceed the budget by {more}"
                  f"{fmt_bytes(over)}; a larger budget fits", RuntimeWarning, stacklevel=_STACK)


def _no_fit(b: Fitting, f: FitState, example_inputs: list[Any]) -> BudgetInfeasibleError:
    """The error for a region whose plans each held more than its share when run, and that has no plan
    with more left free. It names a budget a plan was measured to fit: the least a run held, with what is
    held outside the region; where every run was stopped at the share, the last plan's run to its end
    (at compile time, more than the budget: no step follows) says it."""
    st, runs = f.st, f.runs
    assert st is not None
    budget = b.regions.budget_for(f.key, f.dev)
    outside = budget - st.budget_bytes
    measured = [r.peak_bytes for r in runs if not r.refused]
    if not measured and f.compiled is not None:
        try:
            got = trial_mod.run(f.compiled, example_inputs, f.dev, trial_mod.mutated_inputs(len(example_inputs)),
                                level=f.level, hold_outputs=b.hold_outputs)
            measured.append(got.peak_bytes + f.others)
        except Exception:     # the error then names the least the stopped runs needed
            pass
    lowest = min(r.peak_bytes for r in runs)
    if measured:
        need = min(measured) + outside
        says = f"A budget of {fmt_bytes(need)} ({need} B) fits: the least a plan held, with what is held outside it"
    else:
        need = lowest + outside
        says = (f"Its plans' runs were stopped at the share: a budget of at least {fmt_bytes(need)} ({need} B) "
                "is needed")
    return BudgetInfeasibleError(
        f"hybridmem compile: {st.name} does not fit the budget {fmt_bytes(budget)} ({budget} B) as Inductor "
        f"compiles it: run once when it compiled, its plans' steps held {fmt_bytes(lowest)} at least (the last "
        f"plan counted {fmt_bytes(st.predicted_peak_bytes)} of the region's {fmt_bytes(st.budget_bytes)} share), "
        f"and with {fmt_bytes(f.region.extra)} more left free for Inductor's buffers it has no plan. "
        f"{says}", need)


def _at_planned_sizes(sizes: PlannedSizes, example_inputs: list[Any]) -> tuple[list[Any] | None, str]:
    """The inputs the run at compile time measures the step on: the call's, at the sizes the region is planned
    at (:meth:`PlannedSizes.inputs`); else None and why not."""
    try:
        return sizes.inputs(example_inputs), ""
    except ValueError as e:
        return None, f"no inputs at the planned sizes {sizes_line(sizes.planned)}: {e}"

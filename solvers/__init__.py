"""Planners: Graph + budget + cost model -> Plan.

    from hybridmem.solvers import plan
    p = plan(graph, "60%", device="h100-80gb")                 # STR approximate (LP + source tracing)
    p = plan(graph, 8 << 30, solver="milp", time_limit=60)    # STR exact MILP (CBC; solver_backend="highs")
    p = plan(graph, "50%", solver="checkmate")                # a baseline
    p = plan(graph, "min")                                    # the least budget with a plan, and that plan
    curve = sweep(graph, points=8)                            # plans from the least budget to the peak

Every plan is replayed by :func:`hybridmem.graph.simulate.simulate` before it is returned: it is valid, fits the
budget, and carries the simulator's ``predicted_time_s`` / ``predicted_peak_bytes``. Graphs above
``coarsen.THRESHOLD`` stages are planned on ~100 super-stages (STR's weighted coarsening) by the STR
planners and the MILP baselines, and the plan is written and validated on the full graph.

Solvers (``SOLVERS``):

- ``approx`` (default; :mod:`solvers.approx`): a portfolio on the full graph: heuristic starts (DTR
  replay, Capuchin, Chen, vDNN: never slower than those baselines), the rounding of Checkmate's
  recompute-only LP relaxation, the STR LP relaxation (:mod:`solvers.lp`, solved in a child process
  beside the starts on large problems) + recursive source tracing rounding (:mod:`solvers.relax`) on the
  (coarsened) problem, a gap-by-gap polish of the best of them, and on small uncoarsened problems
  (:func:`solvers.relax.is_large` false) the exact MILP warm-started from the best plan, with the time
  left (without a ``time_limit``, at most ``EXACT_IMPROVE_S`` once a plan is in hand;
  ``info["exact_status"]``, ``info["exact_improved"]``; option ``exact=False`` turns it off): there
  approx finds a plan wherever ``milp`` or a baseline does;
  ``plan.info`` has ``lp_bound_s`` (the LP value: a lower bound *within the STR model*, whose copy
  timing is conservative) and ``gap`` (time / lp_bound - 1; negative when the plan, polished on the full
  graph with the simulator's FIFO link timing, beats the model), and ``lower_bound_s`` (valid for
  every swap/recompute plan of the full graph: :func:`solvers.bound.lower_bound`, ``lower_bound_kind``
  says whether the compute time or the swap/recompute bound gives it) with ``gap_to_lower_bound``.
- ``milp``: the STR MILP (:mod:`solvers.milp`), warm-started from the rounded STR LP schedule or, where
  that breaks the MILP's rows, the first of the best plan, the other plans that fit and the best that
  does not, each made to satisfy them (``plan.info["warm_start"]`` says whether the start satisfies
  the MILP's rows; CBC drops one that does not; one that does is checked before CBC runs and is the
  MILP's solution, ``status`` ``feasible (the warm start)``, when CBC ends with none of its own);
  ``time_limit`` seconds (default 60); on timeout without a solution, or a solution the
  simulator rejects, the approx plan is returned with ``plan.info["fallback"]`` saying why.
- ``greedy``: the source-tracing repair alone, from keep-everything (no LP).
- baselines (:mod:`solvers.baselines`, each registered there with its name and description, which
  ``DESCRIPTIONS`` and the CLI read): ``keep-all``, ``chen`` (sqrt(n) checkpointing), ``checkmate``
  (recompute-only MILP), ``swap-vdnn`` (swap conv/linear inputs, prefetch one layer ahead), ``swap-opt``
  (swap-only MILP), ``capuchin`` (hidden swaps first, then recompute by memory saved per second), ``dtr``
  (replay of a greedy online evictor).

Options (``**options``): ``coarsen`` (True/False/None = automatic), ``target`` (super-stages),
``solver_backend`` (``cbc``/``highs``, MILP solvers), ``min_bytes`` (smaller saved tensors stay resident),
``trace_sources`` (a recompute may rebuild the forward temporaries its producer read, back to what the
plan keeps: :func:`with_chains`; transformers have recompute-only plans far below the peak only so).
"""
from __future__ import annotations

import copy
import dataclasses
import time
from collections import OrderedDict
from typing import Any

from hybridmem.graph.costs import copies_overlap, get_cost_model, without_swaps
from hybridmem.errors import BudgetInfeasibleError, UnknownNameError
from hybridmem.graph.ir import Graph
from hybridmem.graph.plan import Plan
from hybridmem.graph.signature import annotate
from hybridmem.graph.simulate import min_feasible_budget, simulate
from hybridmem.graph.units import fmt_bytes, plan_budget_bytes

from . import approx, baselines, relax
from ._common import memory_floor, planning_problem
from .approx import DEFAULT_MILP_TIME_LIMIT
from .bound import lower_bound

HYBRID = ("approx", "milp", "greedy")
SOLVERS: tuple[str, ...] = HYBRID + baselines.BASELINES
# what `hybridmem plan --list-solvers` prints: the STR planners here, each baseline where it is registered
DESCRIPTIONS: dict[str, str] = {
    "approx": "STR: LP relaxation + recursive source tracing, heuristic starts, polished on the full graph, "
              "and the exact MILP on small graphs (default)",
    "milp": "STR exact MILP (CBC, or HiGHS with --solver-backend highs), warm-started from approx",
    "greedy": "STR source-tracing repair alone, from keep-everything (no LP)",
    **{b.name: b.description for b in baselines.REGISTRY.values()},
}

__all__ = ["plan", "min_budget", "sweep", "memory_floor", "SOLVERS", "HYBRID", "resolve_budget",
           "planning_problem"]



MIN = "min"                # the budget that asks for the least budget with a plan
MIN_PRECISION = 0.005      # budget="min": relative width of the bracket the bisection stops at
MIN_CHECK_BELOW = 0.01     # budget="min" with MILP probes: the last probe, this share below the least found
LEAST_KEPT = 32            # budget="min": searches remembered per process (see min_budget)

_least: "OrderedDict[tuple, Plan]" = OrderedDict()


def resolve_budget(graph: Graph, budget: int | float | str) -> int:
    """Bytes of ``budget``: an int, ``"8GiB"``, or a percentage of the graph's keep-all peak (``"60%"``)."""
    try:
        return plan_budget_bytes(budget, graph.peak_bytes())
    except ValueError as e:
        raise ValueError(f"{e}, or 'min' (the least budget with a plan)") from None


def is_min(budget: Any) -> bool:
    """Whether ``budget`` asks for the least budget with a plan (``"min"``)."""
    return isinstance(budget, str) and budget.strip().lower() == MIN


def plan(graph: Graph, budget: int | float | str, device: Any = "h100-80gb", solver: str = "approx",
         time_limit: float | None = None, verbose: bool = False, **options: Any) -> Plan:
    """A plan for one training step of ``graph`` under ``budget`` bytes on ``device``'s cost model.

    ``budget``: bytes, ``"8GiB"``, ``"60%"`` of the keep-all peak, or ``"min"``: the least budget this
    solver finds a plan for (:func:`min_budget`; option ``precision``). Raises
    :class:`~hybridmem.errors.BudgetInfeasibleError` (with ``minimum_bytes``) when no plan of this solver
    fits, :class:`~hybridmem.errors.UnknownNameError` for an unknown solver or device.
    """
    t0 = time.perf_counter()
    if solver not in SOLVERS:
        raise UnknownNameError("solver", solver, SOLVERS)
    model = get_cost_model(device)
    if options.pop("trace_sources", False):
        graph = with_chains(graph)
    if is_min(budget):
        return min_budget(graph, model, solver, time_limit, verbose, **options)
    budget_b = resolve_budget(graph, budget)
    lower = min_feasible_budget(graph)
    if budget_b < lower:
        raise BudgetInfeasibleError(
            f"budget {fmt_bytes(budget_b)} ({budget_b} B) is below {fmt_bytes(lower)} ({lower} B), what some stage "
            "needs with every evictable tensor off the device (parameters, gradients, the op's own inputs and "
            "outputs): no plan can fit; budget='min' (`hybridmem plan --budget min`) finds the least budget with "
            "a plan", lower)
    peak = graph.peak_bytes()
    if solver in HYBRID:
        if budget_b >= peak:
            out = Plan.keep_all(graph)
            out.solver, out.budget_bytes, out.device = solver, budget_b, model.name
            out.info = {"note": "the budget holds the keep-all peak: nothing to evict", "plan_from": "keep-all"}
        elif copies_overlap(model):
            out, res = approx.solve(graph, budget_b, model, solver, time_limit, verbose, options)
            return _finish(graph, out, model, budget_b, t0, res)
        else:
            out, res = _serial_copies(graph, budget_b, model, solver, time_limit, verbose, options)
            return _finish(graph, out, model, budget_b, t0, res)
    else:
        out = baselines.run(solver, graph, budget_b, model, time_limit=time_limit, verbose=verbose, **options)
    return _finish(graph, out, model, budget_b, t0)


def _serial_copies(graph: Graph, budget: int, model: Any, solver: str, time_limit: float | None, verbose: bool,
                   options: dict[str, Any]) -> tuple[Plan, Any]:
    """Where swaps copy on the compute stream (the CPU): the STR model prices a copy as overlapped, so its
    candidates swap where recomputing is cheaper. Plan both with ``model`` and without swaps (half the time
    each), and keep what the simulator, which charges each copy in full there, finds faster."""
    half = None if time_limit is None else time_limit / 2
    out, res = approx.solve(graph, budget, model, solver, half, verbose, options)
    try:
        other, _ = approx.solve(graph, budget, without_swaps(model), solver, half, verbose, options)
    except BudgetInfeasibleError:
        out.info["copies"] = "swaps copy on the compute stream, charged in full: no plan fits without them"
        return out, res
    ores = simulate(graph, other, device=model, budget=budget, strict=False)
    if ores.feasible and ores.time_s < res.time_s:
        out, res = other, ores
        out.info["copies"] = "swaps copy on the compute stream, charged in full: recomputing is faster here"
    else:
        out.info["copies"] = "swaps copy on the compute stream, charged in full"
    return out, res


def with_chains(graph: Graph) -> Graph:
    """``graph`` as the planners see it with ``trace_sources=True``: a candidate's recompute may rebuild
    the forward temporaries its producer read (a layer norm's output, an attention's scores) from what
    a plan keeps, however many lie between (:meth:`~hybridmem.graph.ir.Graph.replay_stages`). The same
    stages and tensors; the plans it gives are plans of ``graph``."""
    if graph.meta.get("plan_chains"):
        return graph
    return Graph(stages=graph.stages, tensors=graph.tensors, meta={**graph.meta, "plan_chains": True})


def min_budget(graph: Graph, model: Any, solver: str = "approx", time_limit: float | None = None,
               verbose: bool = False, precision: float = MIN_PRECISION, **options: Any) -> Plan:
    """The plan at the least budget ``solver`` finds one for (``plan(graph, "min")``).

    Bisection between the memory floor (:func:`memory_floor`: no plan fits below it) and the keep-all
    peak, one plan per probe (``time_limit`` each); a probe that finds a plan moves the upper end to that
    plan's peak, one that finds none moves the lower end. It stops when the bracket is narrower than
    ``precision`` of the upper end (0: to the byte). The plan's ``budget_bytes`` is its own peak, and
    ``info`` has ``min_budget_bytes``, ``min_no_plan_bytes`` (the largest budget below it found without a
    plan, or the floor less one byte), ``min_probes``, ``memory_floor_bytes`` and ``min_failed_above``
    (probes that found no plan at a budget the least plan fits: the planner is not monotone there).

    With ``approx`` the search is exact on small graphs (its portfolio includes the exact MILP there).
    On the others a budget approx finds no plan for is given to the ``milp`` solver too, for
    ``milp_probe_s`` seconds (option; default ``DEFAULT_MILP_TIME_LIMIT``, 0: never), so that the least
    budget named is one the MILP finds nothing below within that time (to ``precision``); and once the
    bracket is closed, the MILP gets one more probe ``MIN_CHECK_BELOW`` (1 %) under the least budget
    found: where it finds a plan there the search goes on below it, else ``info["min_checked_bytes"]``
    is that budget.

    A process remembers its last ``LEAST_KEPT`` searches, by the graph's content (costs included), the
    cost model, the solver and these settings: asked again (a compiled region planned once more after a
    budget error), the plan found is returned at once, ``info["min_remembered"]`` True (with ``verbose``,
    searched again)."""
    if not 0 <= precision < 1:
        raise ValueError(f"precision {precision!r}: expected a fraction in [0, 1)")
    key = None if verbose else _least_key(graph, model, solver, time_limit, precision, options)  # verbose: shown
    if key is not None and key in _least:
        _least.move_to_end(key)
        found = copy.deepcopy(_least[key])
        found.info["min_remembered"] = True
        return found
    found = _search_least(graph, model, solver, time_limit, verbose, precision, options)
    if key is not None:
        _least[key] = copy.deepcopy(found)
        while len(_least) > LEAST_KEPT:
            _least.popitem(last=False)
    return found


def _least_key(graph: Graph, model: Any, solver: str, time_limit: float | None, precision: float,
               options: dict[str, Any]) -> tuple | None:
    """What a least-budget search depends on, or None where that cannot be told: a cost model that is
    not a dataclass may not show in its ``repr`` what it prices."""
    if not dataclasses.is_dataclass(model):
        return None
    return (graph.content_hash(), repr(model), solver, time_limit, precision, repr(sorted(options.items())))


def _search_least(graph: Graph, model: Any, solver: str, time_limit: float | None, verbose: bool,
                  precision: float, options: dict[str, Any]) -> Plan:
    t0 = time.perf_counter()
    peak = graph.peak_bytes()
    floor = memory_floor(graph, model, options.get("min_bytes"))
    milp_s = float(options.pop("milp_probe_s", DEFAULT_MILP_TIME_LIMIT))
    if solver != "approx" or milp_s <= 0 or _approx_is_exact(graph, model, options):
        milp_s = 0.0
    lo, hi, best, probes = floor - 1, peak, None, 0
    failed: list[int] = []              # budgets no probe found a plan for
    checked: int | None = None
    budget = floor                      # the floor first: where it has a plan, the search ends there
    while True:
        check = hi - lo <= max(1, int(precision * hi))
        if check:
            # The MILP, time-limited on a coarsened graph, is not monotone in the budget: once the bracket
            # is closed it gets one more probe MIN_CHECK_BELOW under the least budget found, and where it
            # finds a plan there the search goes on.
            budget = int(hi * (1 - MIN_CHECK_BELOW))
            if not milp_s or budget < floor:
                break
        probes += 1
        found = None
        if not check:
            # approx's own MILP fallback would repeat the probe below with less time
            found = _probe(graph, budget, model, solver, time_limit, verbose,
                           {**options, "milp_fallback": False} if milp_s else options)
        if found is None and milp_s:
            found = _probe(graph, budget, model, "milp", milp_s, verbose, options)
        if found is None:
            failed.append(budget)
            if check:
                checked = budget
                break
            lo = budget
        else:
            best, hi = found, min(int(found.predicted_peak_bytes), hi)
            # A plan found at a higher budget can peak below a budget where the probe found none (the
            # planners are not monotone in the budget): that budget has a plan after all, and the search
            # goes on below this one, from the largest failed budget under it.
            lo = max((f for f in failed if f < hi), default=floor - 1)
        budget = (lo + hi) // 2
    if best is None:                    # nothing below the peak: keeping everything is the plan
        best = plan(graph, peak, device=model, solver=solver, time_limit=time_limit, **options)
    best.info.update({"min_budget_bytes": hi, "min_no_plan_bytes": lo, "min_probes": probes,
                      "memory_floor_bytes": floor,
                      "min_failed_above": sum(f >= hi for f in failed)})
    if checked is not None:
        best.info["min_checked_bytes"] = checked
    return _finish(graph, best, model, hi, t0)


def _probe(graph: Graph, budget: int, model: Any, solver: str, time_limit: float | None, verbose: bool,
           options: dict[str, Any]) -> Plan | None:
    try:
        return plan(graph, budget, device=model, solver=solver, time_limit=time_limit, verbose=verbose, **options)
    except BudgetInfeasibleError:
        return None


def _approx_is_exact(graph: Graph, model: Any, options: dict[str, Any]) -> bool:
    """Whether approx's portfolio includes the exact MILP on ``graph`` (see :func:`solvers.approx.solve`)."""
    p = planning_problem(graph, graph.peak_bytes(), model, **options)
    return p.T == graph.num_stages and not relax.is_large(p) and options.get("exact", True)


def sweep(graph: Graph, device: Any = "h100-80gb", solver: str = "approx", points: int = 8,
          time_limit: float | None = None, verbose: bool = False, **options: Any) -> list[Plan]:
    """The pareto curve of predicted step time against budget: the plan at the least budget
    (:func:`min_budget`), then ``points - 1`` budgets evenly spaced above it up to the keep-all peak.
    A plan found for a lower budget fits every higher one: where it is faster than what the solver
    found there, it is the plan there (``info["plan_from"]`` then starts with ``lower-budget:``), so
    the curve never rises."""
    if not isinstance(points, int) or points < 2:
        raise ValueError(f"points {points!r}: expected an int of at least 2 (the least budget and the peak)")
    if solver not in SOLVERS:
        raise UnknownNameError("solver", solver, SOLVERS)
    model = get_cost_model(device)
    first = min_budget(graph, model, solver, time_limit, verbose, **options)
    low, peak = first.budget_bytes, graph.peak_bytes()
    out = [first]
    for i in range(1, points):
        t0 = time.perf_counter()
        budget = low + round(i * (peak - low) / (points - 1))
        p = plan(graph, budget, device=model, solver=solver, time_limit=time_limit, verbose=verbose, **options)
        prev = out[-1]
        if prev.predicted_time_s < p.predicted_time_s * (1 - 1e-12):
            p = copy.deepcopy(prev)
            p.info["plan_from"] = f"lower-budget:{p.info.get('plan_from', p.solver)}"
            p = _finish(graph, p, model, budget, t0)
        out.append(p)
    return out


def _finish(graph: Graph, out: Plan, model: Any, budget_b: int, t0: float, res: Any = None) -> Plan:
    """The plan as returned: its simulation (``res``, the planner's own where it has one: a plan is simulated
    once), the valid lower bound and the gaps, what the runtime needs to follow it."""
    if res is None or res.violations or res.peak_bytes > budget_b:
        res = simulate(graph, out, device=model, budget=budget_b, strict=True)   # raises where it does not fit
    out.graph_hash = graph.structure_hash()
    out.device = model.name
    out.budget_bytes = budget_b
    out.predicted_time_s = float(res.time_s)
    out.predicted_peak_bytes = int(res.peak_bytes)
    out.info["solve_s"] = round(time.perf_counter() - t0, 4)
    out.info.setdefault("compute_s", float(res.compute_s))
    out.info["stall_s"] = float(res.stall_s)
    out.info["overhead"] = float(res.overhead) if res.compute_s > 0 else 0.0
    # A valid lower bound on any swap/recompute plan's step time (solvers.bound: the compute time, raised
    # by what the host link and the cheapest replays must cost at the tightest stage). The LP value is a
    # bound within the STR model only, whose timing is conservative: plans found outside it can beat it.
    lb = lower_bound(graph, budget_b, model)
    if lb.feasible:
        out.info["lower_bound_s"] = float(lb.time_s)
        out.info["lower_bound_kind"] = lb.kind
        out.info["gap_to_lower_bound"] = float(res.time_s / lb.time_s - 1.0) if lb.time_s > 0 else 0.0
    lb = out.info.get("lp_bound_s")
    if lb:
        out.info["gap"] = float(res.time_s / lb - 1.0)
    out.info = {k: _plain(v) for k, v in out.info.items()}
    return annotate(out, graph)  # what the runtime needs to map the plan's stages and tensors to live ops


def _plain(v: Any) -> Any:
    """numpy scalars -> Python numbers, so that plans save as YAML/JSON."""
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        return v.item()
    return v

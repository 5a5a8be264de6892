"""Planners: Graph + budget + cost model -> Plan.

    from hybridmem.solvers import plan
    p = plan(graph, "60%", device="h100-80gb")                 # STR approximate (LP + source tracing)
    p = plan(graph, 8 << 30, solver="milp", time_limit=60)    # STR exact MILP (CBC; solver_backend="highs")
    p = plan(graph, "50%", solver="checkmate")                # a baseline

Every plan is replayed by :func:`hybridmem.simulate.simulate` before it is returned: it is valid, fits the
budget, and carries the simulator's ``predicted_time_s`` / ``predicted_peak_bytes``. Graphs above
``coarsen.THRESHOLD`` stages are planned on ~100 super-stages (STR's weighted coarsening) by the STR
planners and the MILP baselines, and the plan is written and validated on the full graph.

Solvers (``SOLVERS``):

- ``approx`` (default): LP relaxation + recursive source tracing rounding (:mod:`solvers.relax`);
  ``plan.info`` has ``lp_bound_s`` (the LP value: a lower bound *within the STR model*, whose copy
  timing is conservative) and ``gap`` (time / lp_bound - 1; negative when the plan, polished on the full
  graph with the simulator's FIFO link timing, beats the model), and ``lower_bound_s`` (the compute
  time: valid for every plan) with ``gap_to_lower_bound``.
- ``milp``: the STR MILP (:mod:`solvers.milp`), warm-started from ``approx``; ``time_limit`` seconds
  (default 60); on timeout without a solution, or a solution the simulator rejects, the approx plan
  is returned with ``plan.info["fallback"]`` saying why.
- ``greedy``: the source-tracing repair alone, from keep-everything (no LP).
- baselines (:mod:`solvers.baselines`): ``keep-all``, ``chen`` (sqrt(n) checkpointing), ``checkmate``
  (recompute-only MILP), ``swap-vdnn`` (swap conv/linear inputs, prefetch one layer ahead), ``swap-opt``
  (swap-only MILP), ``capuchin`` (hidden swaps first, then recompute by memory saved per second), ``dtr``
  (replay of a greedy online evictor).

Options (``**options``): ``coarsen`` (True/False/None = automatic), ``target`` (super-stages),
``solver_backend`` (``cbc``/``highs``, MILP solvers), ``min_bytes`` (smaller saved tensors stay resident).
"""
from __future__ import annotations

import time
from typing import Any

from hybridmem.errors import BudgetInfeasibleError, UnknownNameError
from hybridmem.graph import Graph
from hybridmem.plan import Plan
from hybridmem.units import fmt_bytes, parse_bytes

from . import baselines, coarsen, milp, relax
from ._common import (Problem, build_problem, make_plan, schedule_to_actions)

HYBRID = ("approx", "milp", "greedy")
SOLVERS: tuple[str, ...] = HYBRID + baselines.BASELINES

__all__ = ["plan", "SOLVERS", "HYBRID", "resolve_budget", "planning_problem"]

DEFAULT_MILP_TIME_LIMIT = 60.0
SHRINK_ATTEMPTS = 4


def resolve_budget(graph: Graph, budget: int | float | str) -> int:
    """Bytes of ``budget``: an int, ``"8GiB"``, or a percentage of the graph's keep-all peak (``"60%"``)."""
    return parse_bytes(budget, what="budget", total=graph.peak_bytes())


def planning_problem(graph: Graph, budget: int, model: Any, **options: Any) -> Problem:
    """The (possibly coarsened) problem the STR planners and the MILP baselines solve."""
    use = options.get("coarsen")
    if use is None:
        use = graph.num_stages > options.get("threshold", coarsen.THRESHOLD)
    groups = coarsen.coarsen_groups(graph, options.get("target", coarsen.TARGET)) if use else None
    return build_problem(graph, budget, model, groups=groups, bundle=groups is not None,
                         min_bytes=options.get("min_bytes"))


def plan(graph: Graph, budget: int | float | str, device: Any = "h100-80gb", solver: str = "approx",
         time_limit: float | None = None, verbose: bool = False, **options: Any) -> Plan:
    """A plan for one training step of ``graph`` under ``budget`` bytes on ``device``'s cost model.

    ``budget``: bytes, ``"8GiB"`` or ``"60%"`` of the keep-all peak. Raises
    :class:`~hybridmem.errors.BudgetInfeasibleError` (with ``minimum_bytes``) when no plan of this solver
    fits, :class:`~hybridmem.errors.UnknownNameError` for an unknown solver or device.
    """
    from hybridmem.costs import get_cost_model
    from hybridmem.simulate import min_feasible_budget

    t0 = time.perf_counter()
    if solver not in SOLVERS:
        raise UnknownNameError("solver", solver, SOLVERS)
    model = get_cost_model(device)
    budget_b = resolve_budget(graph, budget)
    lower = min_feasible_budget(graph)
    if budget_b < lower:
        raise BudgetInfeasibleError(
            f"budget {fmt_bytes(budget_b)} ({budget_b} B) is below {fmt_bytes(lower)} ({lower} B), what some stage "
            "needs with every evictable tensor off the device (parameters, gradients, the op's own inputs and "
            "outputs): no plan can fit", lower)
    peak = graph.peak_bytes()
    if solver in HYBRID:
        if budget_b >= peak:
            out = Plan.keep_all(graph)
            out.solver, out.budget_bytes, out.device = solver, budget_b, model.name
            out.info = {"note": "the budget holds the keep-all peak: nothing to evict"}
        else:
            out = _hybrid(graph, budget_b, model, solver, time_limit, verbose, options)
    else:
        out = baselines.run(solver, graph, budget_b, model, time_limit=time_limit, verbose=verbose, **options)
    return _finish(graph, out, model, budget_b, t0)


def _finish(graph: Graph, out: Plan, model: Any, budget_b: int, t0: float) -> Plan:
    from hybridmem.simulate import simulate

    res = simulate(graph, out, device=model, budget=budget_b, strict=True)
    out.graph_hash = graph.structure_hash()
    out.device = model.name
    out.budget_bytes = budget_b
    out.predicted_time_s = float(res.time_s)
    out.predicted_peak_bytes = int(res.peak_bytes)
    out.info["solve_s"] = round(time.perf_counter() - t0, 4)
    out.info.setdefault("compute_s", float(res.compute_s))
    out.info["overhead"] = float(res.time_s / res.compute_s - 1.0) if res.compute_s > 0 else 0.0
    # a valid lower bound on any plan's step time: the compute alone (the LP value is a bound within the
    # STR model, whose timing is conservative: plans found outside it by the repair can beat it)
    out.info["lower_bound_s"] = float(res.compute_s)
    out.info["gap_to_lower_bound"] = out.info["overhead"]
    lb = out.info.get("lp_bound_s")
    if lb:
        out.info["gap"] = float(res.time_s / lb - 1.0)
    out.info = {k: _plain(v) for k, v in out.info.items()}
    from hybridmem.runtime.follow import annotate

    return annotate(out, graph)  # what the runtime needs to map the plan's stages and tensors to live ops


def _plain(v: Any) -> Any:
    """numpy scalars -> Python numbers, so that plans save as YAML/JSON."""
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        return v.item()
    return v


# ---- the STR planners ----------------------------------------------------------------------------
DEFAULT_TIME = {"approx": 24.0, "greedy": 16.0}


def _hybrid(graph: Graph, budget: int, model: Any, solver: str, time_limit: float | None, verbose: bool,
            options: dict[str, Any]) -> Plan:
    """STR on the planning problem (coarsened above the threshold), then a polish on the full graph.

    1. Solve on the problem. If the full-graph simulation finds the plan over budget (the coarse model is
       conservative but not exact), plan again for a budget smaller by the excess.
    2. Polish on the full graph (approx/greedy, and milp on coarsened graphs): the plan of step 1 written
       on the full graph's gaps, and two heuristic starts (Capuchin's construction, the DTR replay), each
       repaired where it does not fit and improved gap by gap; the fastest under the simulator wins.
    """
    from hybridmem.simulate import simulate

    t0 = time.perf_counter()
    total = time_limit if time_limit is not None else DEFAULT_TIME.get(solver)
    deadline = None if total is None else t0 + total
    inner = budget
    notes: list[str] = []
    last_err: Exception | None = None
    p = planning_problem(graph, inner, model, **options)
    coarse = p.T != graph.num_stages
    minimum = int(p.min_bytes().max())
    best: tuple[float, Plan | None, Any, str] = (float("inf"), None, None, "")
    str_share = 0.45 if solver != "milp" else 1.0
    for attempt in range(SHRINK_ATTEMPTS):
        if inner < int(p.min_bytes().max()):
            break
        left = None if deadline is None else max((deadline - time.perf_counter()) * str_share, 0.5)
        if solver == "milp" and time_limit is None:
            left = None
        out = _solve_problem(p, solver, left, verbose, options)
        if out is None:
            notes.append(f"{solver} found no plan on the {'coarse ' if coarse else ''}problem at {inner} B")
            break
        res = simulate(graph, out, device=model, budget=None, strict=False)
        if not res.violations and res.peak_bytes <= budget:
            if attempt:
                out.info["planning_budget_bytes"] = inner
                notes.append(f"planned for {inner} B so that the full graph fits {budget} B")
            best = (res.time_s, out, res, "str")
            break
        last_err = res.violations[0] if res.violations else None
        notes.append(f"attempt {attempt + 1}: " + (str(last_err) if last_err else f"peak {res.peak_bytes} B"))
        if res.violations and not any("exceeds the budget" in v.reason for v in res.violations):
            break
        inner -= max(int(res.peak_bytes) - budget, budget // 200) + 1
        p = planning_problem(graph, inner, model, **options)
    polish = options.get("polish", solver != "milp" or coarse)
    if best[2] is not None and best[0] <= float(best[2].compute_s) * (1 + 1e-12):
        polish = False                     # nothing to gain: the step already runs at compute speed
    if polish:
        # the MILP's time limit is its own: the polish after it gets its usual share
        best = _polish(graph, budget, model, best, solver, None if solver == "milp" else deadline, options, notes)
    _, out, res, source = best
    if out is None:
        raise BudgetInfeasibleError(
            f"solver {solver!r} found no plan within {fmt_bytes(budget)} ({budget} B)"
            + (f": at least {fmt_bytes(minimum)} ({minimum} B) is needed with every saved activation evicted "
               "where it is not read" if budget < minimum else
               f" (a lower bound for its plans is {fmt_bytes(minimum)} ({minimum} B); a larger budget, or "
               "solver='milp' with a longer time_limit, may find one)")
            + (f"; {'; '.join(notes)}" if notes else ""), minimum)
    out.solver = solver
    if notes:
        out.info["notes"] = "; ".join(notes)
    out.info["plan_from"] = source
    out.info["coarse_stages"] = p.T if coarse else None
    out.info["candidates"] = len(p.candidates)
    return out


def _polish(graph: Graph, budget: int, model: Any, best: tuple, solver: str, deadline: float | None,
            options: dict[str, Any], notes: list[str]) -> tuple:
    """Full-graph polish: starts (the STR plan, Capuchin's construction, the DTR replay) repaired and
    improved gap by gap (:func:`solvers.relax.refine`); the fastest plan under the simulator wins."""
    from hybridmem.simulate import simulate

    from .baselines import dtr_plan, numpy_victims

    fine = build_problem(graph, budget, model, min_bytes=options.get("min_bytes"))
    left = options.get("polish_s", 12.0)
    if deadline is not None:
        left = min(left, max(deadline - time.perf_counter(), 0.0))
    if left <= 0.2:
        return best
    starts: list[tuple[str, Any]] = []
    if best[1] is not None:
        starts.append(("str", best[1].actions))
    starts.append(("capuchin", None))
    try:
        starts.append(("dtr", dtr_plan(fine, budget, numpy_victims).actions))
    except BudgetInfeasibleError:
        pass
    info = dict(best[1].info) if best[1] is not None else {}
    for name, sched, _ in relax.refine(fine, starts, time_budget=left):
        cand = make_plan(fine, schedule_to_actions(fine, sched), solver, dict(info))
        r2 = simulate(graph, cand, device=model, budget=None, strict=False)
        if not r2.violations and r2.peak_bytes <= budget and r2.time_s < best[0] - 1e-12:
            best = (r2.time_s, cand, r2, f"polish:{name}")
    return best


def _solve_problem(p: Problem, solver: str, time_limit: float | None, verbose: bool,
                   options: dict[str, Any]) -> Plan | None:
    if solver == "greedy":
        sched, info = relax.round_schedule(p, None, time_budget=time_limit or 10.0)
        return None if sched is None else make_plan(p, schedule_to_actions(p, sched), "greedy", info)
    sched, info = relax.solve_relaxed(p, time_limit=time_limit, verbose=verbose)
    approx = None if sched is None else make_plan(p, schedule_to_actions(p, sched), "approx", info)
    if solver == "approx":
        return approx
    return _solve_milp(p, approx, sched, time_limit, verbose, options)


def _solve_milp(p: Problem, approx: Plan | None, start: Any, time_limit: float | None, verbose: bool,
                options: dict[str, Any]) -> Plan | None:
    from hybridmem.simulate import simulate

    limit = DEFAULT_MILP_TIME_LIMIT if time_limit is None else time_limit
    t0 = time.perf_counter()
    res = milp.solve_problem(p, time_limit=limit, start=start, isolate=options.get("isolate", True),
                             solver=options.get("solver_backend", "cbc"), verbose=verbose,
                             compact=options.get("compact", relax.is_large(p)))
    info = {"status": res.status, "milp_vars": res.num_vars, "milp_constraints": res.num_constraints,
            "milp_s": round(time.perf_counter() - t0, 4), "compact": relax.is_large(p)}
    if res.objective is not None:
        info["objective_s"] = p.compute_s + res.objective
    if res.bound is not None:
        info["bound_s"] = p.compute_s + res.bound
        info["mip_gap"] = (res.objective - res.bound) / (p.compute_s + res.objective) if res.objective is not None else None
    if approx is not None:
        for k in ("lp_bound_s",):
            if k in approx.info:
                info[k] = approx.info[k]
    if res.schedule is None:
        if approx is None:
            return None
        approx.solver = "milp"
        approx.info.update(info)
        why = (f"the MILP solver crashed or hung (status {res.status})" if res.status.startswith(("crashed", "error"))
               else f"the MILP found no solution within {limit:g} s (status {res.status})")
        approx.info["fallback"] = f"{why}: this is the approx plan"
        return approx
    try:
        out = make_plan(p, schedule_to_actions(p, res.schedule), "milp", info)
    except ValueError as e:
        out = None
        info["fallback"] = f"the MILP solution could not be written as a plan ({e}): this is the approx plan"
    if out is not None and approx is not None:
        a = simulate(p.graph, approx, device=p.model, budget=None, strict=False)
        b = simulate(p.graph, out, device=p.model, budget=None, strict=False)
        ok_a = not a.violations and a.peak_bytes <= p.budget
        ok_b = not b.violations and b.peak_bytes <= p.budget
        if ok_a and (not ok_b or a.time_s < b.time_s - 1e-12):
            why = "the simulator rejects the MILP plan" if not ok_b else \
                "the simulator times the approx plan faster (the MILP's link model is stricter)"
            approx.solver = "milp"
            approx.info.update(info)
            approx.info["fallback"] = f"{why}: this is the approx plan"
            return approx
    if out is None:
        if approx is None:
            return None
        approx.solver = "milp"
        approx.info.update(info)
        return approx
    return out

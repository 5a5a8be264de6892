"""Plans under a share, by the solver a backend was given (``solve(graph, budget, model)``, the planner's): the
least budget a count has a plan for, a plan judged by its peak as PyTorch's partition runs it, and a plan with
other runs of the region in flight beside it."""
from __future__ import annotations

import time
from typing import Any, Callable

from ..errors import BudgetInfeasibleError
from . import tuning
from .partition import decisions
from .variants import Variant

__all__ = ["Solve", "kept_bytes", "least_planned", "plan_realized", "plan_runs"]

Solve = Callable[[Any, "int | str", Any], Any]


def least_planned(solve: Solve, variants: list[Variant], model: Any) -> int | None:
    """The least budget the solver has a plan for on any count of ``variants`` (the region's bytes: no
    margin, nothing held outside it); None where it finds none."""
    found = []
    for v in variants:
        for j in (v.jg, v.part):
            if j is None:
                continue
            try:
                found.append(int(solve(j.graph, "min", model).budget_bytes))
            except BudgetInfeasibleError:
                continue
    return min(found) if found else None


def plan_realized(solve: Solve, g: Any, share: int, model: Any, judge: Any) -> tuple[Any, int]:
    """A plan that fits ``share`` by its count or by its peak as PyTorch's partition runs it (``judge``:
    :func:`~hybridmem.compile.partition_peak.realized_peak`). The partition recomputes some of what a plan
    keeps, so a plan for a budget above ``share`` may fit it as partitioned, and recomputes less. The
    plan at ``share`` (or, where the count has none, at the least budget it has one for) is taken
    where it fits; where that leaves :data:`tuning.REALIZED_HEADROOM` of ``share`` free, a bisection above it
    (:data:`tuning.REALIZED_PROBES` plans, for :data:`tuning.REALIZED_TIME_SHARE` times the first one's time at most)
    keeps the highest budget whose plan fits as partitioned. Returns the plan and the peak it was
    taken by; on failure the error names the least peak found."""
    def judged(b: int | str) -> tuple[Any, int, int] | None:
        try:
            p = solve(g, b, model)
        except BudgetInfeasibleError:
            return None
        count = int(p.predicted_peak_bytes)
        real = judge(p)
        return p, count, count if real is None else real

    t0 = time.perf_counter()
    first = judged(share)
    if first is None:
        first = judged("min")          # the count has no plan at the share: its least plan may fit
        if first is None:
            raise BudgetInfeasibleError("no plan", None)
        if first[2] > share:
            raise BudgetInfeasibleError("no plan fits as the partition runs it", min(first[1], first[2]))
    p, count, real = first
    best = (p, min(count, real))       # at the share the count fits, whatever the partition does
    if share - best[1] < tuning.REALIZED_HEADROOM * share:
        return best                    # nothing to gain above it
    lo, hi = int(p.budget_bytes) + 1, g.peak_bytes()
    stop = time.perf_counter() + tuning.REALIZED_TIME_SHARE * (time.perf_counter() - t0)
    for _ in range(tuning.REALIZED_PROBES):
        if lo > hi or time.perf_counter() > stop:
            break
        b = (lo + hi) // 2
        got = judged(b)
        if got is not None and got[2] <= share:
            best, lo = (got[0], got[2]), b + 1
        else:
            hi = b - 1
    return best


def plan_runs(solve: Solve, g: Any, share: int, others: int, grads: int, model: Any) -> tuple[Any, int]:
    """A plan, and its peak with ``others`` more runs in flight beside it, that fits ``share``: each other
    run holds what the plan keeps for the backward beyond the ``grads`` bytes already set aside for it.

    The planners see one run. To make them weigh what the other runs hold, they plan a copy of the
    graph whose saved tensors are ``others + 1`` times their size (keeping one costs that much); each
    plan is then judged on the real graph with the other runs added, and a bisection over the copy's
    budget finds the highest one whose plan fits (6 plans at most). On failure the error names the
    least total any of those plans needs."""
    import copy

    from .. import solvers
    from ..graph.simulate import simulate

    if not others:
        p = solve(g, share, model)
        return p, int(p.predicted_peak_bytes)
    heavy = copy.deepcopy(g)
    for t in heavy.tensors:
        if t.saved and t.evictable:
            t.nbytes *= others + 1
    best: tuple[Any, int] | None = None
    least: int | None = None
    lo, hi = solvers.memory_floor(heavy, model), heavy.peak_bytes()
    for _ in range(6):
        if lo > hi:
            break
        b = (lo + hi) // 2
        try:
            p = solve(heavy, b, model)
        except BudgetInfeasibleError:
            lo = b + 1
            continue
        peak = simulate(g, p, model, budget=None, check_hash=False).peak_bytes
        need = int(peak) + others * max(kept_bytes(g, p) - grads, 0)
        least = need if least is None else min(least, need)
        if need <= share:
            best, lo = (p, need), b + 1
        else:
            hi = b - 1
    if best is None:
        raise BudgetInfeasibleError("no plan of one run fits beside the other runs in flight", least)
    return best



def kept_bytes(g: Any, p: Any) -> int:
    """Bytes of saved activations plan ``p`` keeps for the backward (neither recomputed nor swapped)."""
    d = decisions(p)
    evicted = set(d.recompute) | set(d.swap)
    return sum(t.nbytes for t in g.tensors if t.saved and t.evictable and t.id not in evicted)

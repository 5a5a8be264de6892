"""solvers.bound.lower_bound: a valid lower bound on any swap/recompute plan's step time.

Validity is checked against exhaustive search: on small random graphs every plan the simulator accepts
is enumerated (tests/helpers/plans.py), and at each budget the bound must not exceed the fastest plan
that fits. It must also be worth having: above the compute time where memory is tight.
"""
from __future__ import annotations

from functools import lru_cache

import pytest

from hybridmem.errors import BudgetInfeasibleError
from hybridmem.graph.simulate import simulate
from hybridmem.solvers import plan
from hybridmem.solvers._synth import random_graph
from hybridmem.solvers.bound import lower_bound
from tests.helpers.plans import best_within, enumerate_plans

CASES = [("v100-16gb", 4, 10), ("v100-16gb", 4, 16), ("v100-16gb", 3, 2), ("h100-80gb", 4, 1),
         ("h100-80gb", 4, 12), ("h100-80gb", 3, 12)]


@lru_cache(maxsize=None)
def budgets_above_compute(device: str, n_forward: int, seed: int) -> int:
    """Check the bound against exhaustive search at budgets from the least plan's peak to the keep-all peak;
    return at how many of them it rises above the compute time. Cached: two tests read it, and each runs
    it itself when run alone."""
    g = random_graph(8, seed=seed, n_forward=n_forward, device=device, mb=(2, 32))
    peaks, times = enumerate_plans(g, device)
    keep = simulate(g, None, device=device)
    low, peak = int(peaks.min()), g.peak_bytes()
    above = 0
    for b in sorted({int(low + f * (peak - low)) for f in (0.0, 0.1, 0.25, 0.5, 0.75, 0.95)} | {low - 1, peak}):
        truth = best_within(peaks, times, b)
        lb = lower_bound(g, b, device)
        assert lb.compute_s == pytest.approx(keep.compute_s)
        assert lb.time_s >= lb.compute_s
        if not lb.feasible:
            assert truth == float("inf"), f"budget {b}: the bound says nothing fits, a plan of {truth} s does"
            continue
        assert lb.time_s <= truth * (1 + 1e-12), f"budget {b}: bound {lb.time_s} > best plan {truth}"
        above += lb.time_s > lb.compute_s * (1 + 1e-9)
    return above


@pytest.mark.parametrize("device,n_forward,seed", CASES)
def test_bound_never_exceeds_the_best_plan_found_by_exhaustive_search(device: str, n_forward: int,
                                                                       seed: int) -> None:
    budgets_above_compute(device, n_forward, seed)


def test_bound_beats_the_compute_time_somewhere() -> None:
    """Not the trivial bound: on the cases above it rises above the compute time at some budgets."""
    assert sum(budgets_above_compute(*case) for case in CASES) > 0


def test_bound_holds_for_every_solver_on_a_deeper_graph() -> None:
    g = random_graph(40, seed=3, n_forward=20, device="v100-16gb")
    peak = g.peak_bytes()
    raised = False
    for frac in (0.5, 0.7, 0.9):
        b = int(frac * peak)
        lb = lower_bound(g, b, "v100-16gb")
        raised |= lb.time_s > lb.compute_s * (1 + 1e-9)
        for solver in ("approx", "chen", "capuchin", "dtr", "swap-vdnn"):
            try:
                p = plan(g, b, device="v100-16gb", solver=solver)
            except BudgetInfeasibleError:
                continue  # a baseline that cannot meet this budget
            res = simulate(g, p, device="v100-16gb", budget=b, strict=True)
            assert res.time_s >= lb.time_s * (1 - 1e-12), (solver, frac)
            if solver == "approx":
                assert p.info["lower_bound_s"] == pytest.approx(lb.time_s)
    assert raised


def test_infeasible_budget_is_flagged() -> None:
    g = random_graph(12, seed=0, device="h100-80gb")
    lb = lower_bound(g, 1, "h100-80gb")
    assert not lb.feasible and lb.time_s == float("inf") and lb.stage >= 0

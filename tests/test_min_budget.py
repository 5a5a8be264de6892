"""``plan(graph, "min")``: the least budget with a plan, against exhaustive search on small graphs, and
the errors that name it."""
from __future__ import annotations

import pytest

from hybridmem.graph.costs import get_cost_model
from hybridmem.errors import BudgetInfeasibleError
from hybridmem.graph.simulate import simulate
from hybridmem.solvers import memory_floor, plan
from hybridmem.solvers._synth import random_graph
from hybridmem.graph.units import fmt_bytes

from tests.helpers.plans import enumerate_plans

# (device, n_forward, seed) from test_solvers_exact: h100-80gb/3/12 needs a bisection (its least plan is
# above the memory floor, reached because a stall lets a swap-out end in time), the others end at the floor
CASES = [("h100-80gb", 3, 12), ("v100-16gb", 4, 10), ("h100-80gb", 4, 1)]


@pytest.mark.parametrize("device,n_forward,seed", CASES)
def test_min_budget_equals_exhaustive_search(device: str, n_forward: int, seed: int) -> None:
    g = random_graph(8, seed=seed, n_forward=n_forward, device=device, mb=(2, 32))
    peaks, _ = enumerate_plans(g, device)
    least = int(peaks.min())
    p = plan(g, "min", device=device, precision=0)
    assert p.budget_bytes == least == p.info["min_budget_bytes"]
    assert simulate(g, p, device=device, budget=least, strict=True).peak_bytes <= least
    assert p.info["min_no_plan_bytes"] == least - 1
    with pytest.raises(BudgetInfeasibleError):
        plan(g, least - 1, device=device)


def test_min_budget_brackets_the_least_budget_within_its_precision() -> None:
    g = random_graph(24, seed=1, readers=(1, 3))
    p = plan(g, "min", time_limit=5)
    b, below = p.budget_bytes, p.info["min_no_plan_bytes"]
    assert simulate(g, p, budget=b, strict=True).peak_bytes <= b < g.peak_bytes()
    assert below < b and b - below <= 0.005 * b
    assert below >= memory_floor(g, get_cost_model("h100-80gb")) - 1
    with pytest.raises(BudgetInfeasibleError):
        plan(g, below, time_limit=5)


def test_a_plan_found_below_a_failed_budget_sends_the_search_below_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planner is not monotone in the budget: a probe can miss at a budget that a plan found at a higher
    one fits. The search then goes on below that plan (from the largest failed budget under it) and does
    not report the missed budget as one without a plan."""
    import hybridmem.solvers as solvers

    device, n_forward, seed = CASES[0]
    g = random_graph(8, seed=seed, n_forward=n_forward, device=device, mb=(2, 32))
    least_plan = plan(g, "min", device=device, precision=0)
    least = least_plan.budget_bytes
    assert memory_floor(g, get_cost_model(device)) < least
    asked: list[int] = []

    def flaky(graph, budget, *args, **kwargs):  # the first probe at or above the least budget misses
        asked.append(budget)
        if budget < least or sum(b >= least for b in asked) == 1:
            return None
        return least_plan

    monkeypatch.setattr(solvers, "_probe", flaky)
    solvers._least.clear()                  # search again, through the flaky probes
    p = plan(g, "min", device=device, precision=0)
    missed = next(b for b in asked if b >= least)
    assert missed > least                   # a budget the least plan fits, where the probe found none
    assert p.info["min_budget_bytes"] == least
    assert p.info["min_no_plan_bytes"] == least - 1 < missed
    assert p.info["min_failed_above"] == 1


def test_a_milp_plan_one_percent_below_the_least_budget_sends_the_search_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """On graphs approx does not solve exactly, the MILP gets one more probe 1 % below the least budget
    found once the bracket is closed. A time-limited MILP is not monotone in the budget: here it misses
    every probe of the first bisection, then finds the least plan at that last probe, and the search goes
    on below it until the probe 1 % under the least budget finds nothing."""
    import hybridmem.solvers as solvers

    device = "h100-80gb"   # its least plan is 4.5 % above the memory floor, 14 % below the peak
    g = random_graph(8, seed=26, n_forward=4, device=device, mb=(2, 32))
    least_plan = plan(g, "min", device=device, precision=0)
    least = least_plan.budget_bytes
    assert memory_floor(g, get_cost_model(device)) < 0.99 * least and least < 0.99 * g.peak_bytes()
    milp_calls: list[int] = []

    def probe(graph, budget, model, solver, *args, **kwargs):
        if solver != "milp":
            return None                     # approx misses everything
        milp_calls.append(budget)
        honest = any(b < a for a, b in zip(milp_calls, milp_calls[1:]))   # from the first lower budget on
        return least_plan if honest and budget >= least else None

    monkeypatch.setattr(solvers, "_approx_is_exact", lambda *a, **k: False)
    monkeypatch.setattr(solvers, "_probe", probe)
    p = plan(g, "min", device=device)
    assert int(g.peak_bytes() * 0.99) in milp_calls   # the check below the first bracket (at the peak)
    assert p.info["min_budget_bytes"] == least
    assert p.info["min_checked_bytes"] == int(least * 0.99) == milp_calls[-1]
    assert least - p.info["min_no_plan_bytes"] <= 0.005 * least


def test_min_budget_refuses_a_bad_precision_and_unknown_budgets_name_min() -> None:
    g = random_graph(8, seed=1)
    with pytest.raises(ValueError, match=r"precision 1\.5: expected a fraction in \[0, 1\)"):
        plan(g, "min", precision=1.5)
    with pytest.raises(ValueError, match="or 'min'"):
        plan(g, "minimum")


def test_infeasible_budget_names_the_floor_and_the_least_plan_found() -> None:
    """Between the memory floor and the least budget with a plan, the error names both, labelled."""
    g = random_graph(8, seed=12, n_forward=3, device="h100-80gb", mb=(2, 32))
    floor = memory_floor(g, get_cost_model("h100-80gb"))
    least = plan(g, "min", precision=0).budget_bytes
    assert floor < least
    with pytest.raises(BudgetInfeasibleError) as e:
        plan(g, floor, solver="dtr")
    assert e.value.minimum_bytes >= floor
    with pytest.raises(BudgetInfeasibleError) as e:
        plan(g, (floor + least) // 2)
    text = str(e.value)
    assert f"lies between {fmt_bytes(floor)} ({floor} B, the memory floor" in text and "--budget min" in text
    assert e.value.minimum_bytes == floor


def test_a_search_asked_again_is_remembered_until_the_graph_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same graph (costs included), cost model, solver and settings give the plan found before with no
    probe; a verbose search, or a graph that holds a byte more anywhere, is searched again."""
    import hybridmem.solvers as solvers

    device, n_forward, seed = CASES[0]
    g = random_graph(8, seed=seed, n_forward=n_forward, device=device, mb=(2, 32))
    first = plan(g, "min", device=device, precision=0)
    probes: list[int] = []
    real = solvers._probe
    monkeypatch.setattr(solvers, "_probe", lambda graph, budget, *a, **k: probes.append(budget) or real(graph, budget, *a, **k))
    again = plan(g, "min", device=device, precision=0)
    assert probes == [] and again.info["min_remembered"] and "min_remembered" not in first.info
    assert again.budget_bytes == first.budget_bytes and again.actions == first.actions and again is not first
    assert plan(g, "min", device=device, precision=0.01).info.get("min_remembered") is None and probes
    probes.clear()
    assert plan(g, "min", device=device, precision=0, verbose=True).info.get("min_remembered") is None and probes
    probes.clear()
    g.stages[-1].workspace += 1
    changed = plan(g, "min", device=device, precision=0)
    assert probes and not changed.info.get("min_remembered")

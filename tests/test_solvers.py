"""Planners: every solver's plan is valid under the simulator and within budget; the API's errors;
coarsening; the hybrid plan against the baselines."""
from __future__ import annotations

import sys
from typing import Any

import pytest

from hybridmem.errors import BudgetInfeasibleError, UnknownNameError
from hybridmem.graph.ir import Graph
from hybridmem.graph.plan import Plan
from hybridmem.graph.simulate import min_feasible_budget, simulate
from hybridmem.solvers import SOLVERS, plan, planning_problem
from hybridmem.solvers import coarsen, milp, relax
from hybridmem.solvers._common import build_problem, make_plan, schedule_to_actions
from hybridmem.solvers._synth import chain_graph, random_graph

DEVICE = "h100-80gb"


@pytest.fixture(scope="module")
def graph24() -> Graph:
    return random_graph(24, seed=1, readers=(1, 3))


def check_plan(g: Graph, p: Plan, budget: int, device: str = DEVICE) -> None:
    res = simulate(g, p, device=device, budget=budget, strict=True)
    assert res.peak_bytes <= budget
    assert p.graph_hash == g.structure_hash()
    assert p.budget_bytes == budget
    assert p.predicted_time_s == pytest.approx(res.time_s)
    assert p.predicted_peak_bytes == res.peak_bytes
    assert p.device == device


@pytest.mark.parametrize("solver", SOLVERS)
def test_every_solver_gives_a_valid_plan_or_says_why(graph24: Graph, solver: str) -> None:
    peak = graph24.peak_bytes()
    fitted = 0
    for frac in (0.9, 0.7, 0.5):
        budget = int(frac * peak)
        try:
            p = plan(graph24, budget, device=DEVICE, solver=solver, time_limit=10)
        except BudgetInfeasibleError as e:
            assert "budget" in str(e) or "fit" in str(e)
            continue
        fitted += 1
        assert p.solver == solver
        check_plan(graph24, p, budget)
    if solver in ("approx", "milp", "greedy", "swap-opt", "capuchin"):
        assert fitted >= 2, f"{solver} fitted only {fitted} of 3 budgets"


def test_keep_all_plan_when_the_budget_holds_the_peak(graph24: Graph) -> None:
    p = plan(graph24, graph24.peak_bytes(), solver="approx")
    assert p.actions == [] and p.predicted_time_s == pytest.approx(simulate(graph24).time_s)
    with pytest.raises(BudgetInfeasibleError) as e:
        plan(graph24, graph24.peak_bytes() - 1, solver="keep-all")
    assert e.value.minimum_bytes == graph24.peak_bytes()


def test_budget_as_percentage_of_the_keep_all_peak(graph24: Graph) -> None:
    p = plan(graph24, "70%", solver="greedy")
    assert p.budget_bytes == int(0.7 * graph24.peak_bytes())
    check_plan(graph24, p, p.budget_bytes)


def test_infeasible_budget_names_the_minimum(graph24: Graph) -> None:
    lower = min_feasible_budget(graph24)
    with pytest.raises(BudgetInfeasibleError) as e:
        plan(graph24, lower - 1)
    assert e.value.minimum_bytes == lower
    assert str(lower) in str(e.value)
    # above the simulator's bound but below what any plan of the planner's candidates can reach
    need = int(build_problem(graph24, lower, DEVICE).min_bytes().max())
    if need > lower:
        with pytest.raises(BudgetInfeasibleError) as e:
            plan(graph24, need - 1)
        assert e.value.minimum_bytes == need


def test_unknown_solver_and_device_list_the_known_names(graph24: Graph) -> None:
    with pytest.raises(UnknownNameError) as e:
        plan(graph24, "50%", solver="gurobi")
    for name in SOLVERS:
        assert name in str(e.value)
    with pytest.raises(UnknownNameError):
        plan(graph24, "50%", device="tpu-v9")


def test_milp_timeout_falls_back_to_the_approx_plan(monkeypatch: pytest.MonkeyPatch, graph24: Graph) -> None:
    real = milp.solve

    def no_solution(sm, **kw):
        res = real(sm, **{**kw, "start": None, "time_limit": 0.01})
        res.schedule, res.objective, res.status = None, None, "no_solution_found"
        return res

    monkeypatch.setattr(milp, "solve", no_solution)
    budget = int(0.7 * graph24.peak_bytes())
    p = plan(graph24, budget, solver="milp", time_limit=5)
    assert "fallback" in p.info and "approx" in p.info["fallback"]
    check_plan(graph24, p, budget)


def test_a_crashing_milp_solver_costs_only_its_child_process(monkeypatch: pytest.MonkeyPatch, graph24: Graph) -> None:
    import os

    real = milp.solve

    def crash(sm, **kw):          # what CBC's abort inside branch-and-bound amounts to
        if kw.get("relax"):
            return real(sm, **kw)  # the LP relaxation (approx) runs in-process
        os.abort()

    monkeypatch.setattr(milp, "solve", crash)
    budget = int(0.7 * graph24.peak_bytes())
    p = plan(graph24, budget, solver="milp", time_limit=5)
    if p.info.get("warm_start") == milp.START_SATISFIES:
        # the start was checked against the model before the child ran: it is a solution all the same
        assert p.info["status"] == milp.START_STATUS
    else:
        assert "crashed" in p.info["fallback"]
    check_plan(graph24, p, budget)


def test_milp_reports_status_objective_bound_and_gap(graph24: Graph) -> None:
    budget = int(0.7 * graph24.peak_bytes())
    p = plan(graph24, budget, solver="milp", time_limit=20)
    for key in ("status", "milp_vars", "milp_constraints", "objective_s", "bound_s", "mip_gap"):
        assert key in p.info
    # the MILP's own figures: recorded also when the simulator prefers approx's plan (info["fallback"])
    assert p.info["objective_s"] >= p.info["bound_s"] - 1e-9
    assert p.info["mip_gap"] >= 0


def test_approx_reports_the_lp_bound_and_a_valid_lower_bound(graph24: Graph) -> None:
    budget = int(0.7 * graph24.peak_bytes())
    p = plan(graph24, budget, solver="approx")
    # the LP bounds plans of the STR model (conservative copy timing); the polish may beat it, the
    # compute time bounds every plan
    assert p.info["gap"] == pytest.approx(p.predicted_time_s / p.info["lp_bound_s"] - 1)
    assert p.info["lp_bound_s"] >= p.info["compute_s"] - 1e-12
    assert p.info["lower_bound_s"] >= p.info["compute_s"] - 1e-12
    assert p.info["lower_bound_kind"] in ("compute", "swap/recompute")
    assert p.predicted_time_s >= p.info["lower_bound_s"] - 1e-12
    assert p.info["gap_to_lower_bound"] == pytest.approx(p.predicted_time_s / p.info["lower_bound_s"] - 1)


def test_highs_backend_missing_says_how_to_install(graph24: Graph) -> None:
    pytest.importorskip("mip")
    try:
        import highspy  # noqa: F401
        pytest.skip("highspy is installed")
    except ImportError:
        pass
    p = build_problem(graph24, int(0.7 * graph24.peak_bytes()), DEVICE)
    with pytest.raises(milp.SolverUnavailableError, match=r"pip install 'hybridmem\[highs\]'"):
        milp.build_model(p, solver="highs")


def test_highs_backend_solves_when_installed(graph24: Graph) -> None:
    pytest.importorskip("highspy")
    budget = int(0.7 * graph24.peak_bytes())
    p = plan(graph24, budget, solver="milp", time_limit=30, solver_backend="highs")
    check_plan(graph24, p, budget)


def test_model_has_variables_only_on_lifetimes_of_saved_activations() -> None:
    g = random_graph(16, seed=3)
    p = build_problem(g, g.peak_bytes(), DEVICE)
    sm = milp.build_model(p)
    saved = {t.id for t in g.evictable() if t.saved}
    for (t, k) in sm.S:
        c = p.candidates[k]
        assert c.tensor in saved and c.start < t <= c.end
    for (t, k) in sm.R:
        assert p.candidates[k].start < t <= p.candidates[k].end


def test_plan_round_trips_through_yaml(tmp_path, graph24: Graph) -> None:
    budget = int(0.7 * graph24.peak_bytes())
    p = plan(graph24, budget, solver="approx")
    path = p.save(tmp_path / "plan.yaml")
    q = Plan.load(path)
    assert q.actions == p.actions and q.info == p.info and q.solver == "approx"
    q.check_graph(graph24)
    assert simulate(graph24, q, device=DEVICE, budget=budget).time_s == pytest.approx(p.predicted_time_s)


# ---- coarsening ------------------------------------------------------------------------------------
def test_coarsen_groups_keep_phases_apart_and_the_loss_alone() -> None:
    g = random_graph(220, seed=2)
    groups = coarsen.coarsen_groups(g, 100)
    assert len(groups) == 100
    assert [i for grp in groups for i in grp] == list(range(g.num_stages))
    loss = g.num_forward - 1
    for grp in groups:
        assert len({g.stages[i].phase for i in grp}) == 1
        assert loss not in grp or grp == [loss]
    assert coarsen.coarse_graph(g, groups).num_stages == 100


def test_large_graphs_are_planned_coarse_and_validated_on_the_full_graph() -> None:
    g = random_graph(240, seed=4, readers=(1, 2))
    budget = int(0.75 * g.peak_bytes())
    p = plan(g, budget, solver="approx", time_limit=30)
    assert p.info["coarse_stages"] == coarsen.TARGET
    check_plan(g, p, budget)


def test_schedule_of_a_coarse_problem_maps_to_fine_stages() -> None:
    from hybridmem.graph.costs import get_cost_model

    g = random_graph(200, seed=5, readers=(1, 2))
    budget = int(0.8 * g.peak_bytes())
    pb = planning_problem(g, budget, get_cost_model(DEVICE))
    sched, _ = relax.round_schedule(pb, None)
    assert sched is not None
    actions = schedule_to_actions(pb, sched)
    firsts, lasts = set(pb.first), set(pb.last)
    for a in actions:
        if a in pb.early_free:
            continue
        if a.kind in ("recompute", "swap_in"):
            assert a.stage in firsts
        elif a.kind == "swap_out":
            assert a.stage in lasts


# ---- hybrid vs baselines -----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2])
def test_hybrid_plan_is_no_slower_than_any_baseline(seed: int) -> None:
    g = random_graph(30, seed=seed, readers=(1, 3))
    peak = g.peak_bytes()
    compared = 0
    for frac in (0.8, 0.6):
        budget = int(frac * peak)
        try:
            mine = plan(g, budget, solver="approx", time_limit=20).predicted_time_s
        except BudgetInfeasibleError:
            continue
        for b in ("chen", "checkmate", "swap-vdnn", "swap-opt", "capuchin", "dtr"):
            try:
                other = plan(g, budget, solver=b, time_limit=10).predicted_time_s
            except BudgetInfeasibleError:
                continue
            compared += 1
            assert mine <= other * (1 + 1e-9), f"{b} at {frac}: {other} < approx {mine}"
    assert compared >= 3


def test_zoo_vgg16_tiny_hybrid_beats_baselines() -> None:
    pytest.importorskip("torch")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    zoo = pytest.importorskip("hybridmem.zoo")
    from hybridmem.graph.capture import capture

    e = zoo.build("vgg16", "tiny", device="meta")
    g = capture(e.model, e.inputs, e.loss_fn, device="meta", cost_model=DEVICE)
    peak, lower = g.peak_bytes(), min_feasible_budget(g)
    for frac in (0.8, 0.5):
        budget = int(lower + frac * (peak - lower))
        try:
            mine = plan(g, budget, solver="approx", time_limit=20)
        except BudgetInfeasibleError:
            continue
        check_plan(g, mine, budget)
        for b in ("chen", "checkmate", "capuchin", "dtr"):
            try:
                other = plan(g, budget, solver=b, time_limit=10)
            except BudgetInfeasibleError:
                continue
            check_plan(g, other, budget)
            assert mine.predicted_time_s <= other.predicted_time_s * (1 + 1e-9), b


def test_chain_graph_from_helpers_plans() -> None:
    g = chain_graph(6, seed=3)
    budget = int(0.9 * g.peak_bytes())
    try:
        p = plan(g, budget)
    except BudgetInfeasibleError:
        return
    check_plan(g, p, budget)


# ---- the hybrid portfolio ----------------------------------------------------------------------------
def _zoo_graph(name: str, size: str = "tiny") -> Graph:
    pytest.importorskip("torch")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    zoo = pytest.importorskip("hybridmem.zoo")
    from hybridmem.graph.capture import capture

    e = zoo.build(name, size, device="meta")
    return capture(e.model, e.inputs, e.loss_fn, device="meta", cost_model=DEVICE)


@pytest.fixture(scope="module")
def vgg16_tiny() -> Graph:
    return _zoo_graph("vgg16")


COARSE = {"coarsen": True, "target": 30}     # plan a small zoo graph the way large ones are planned


def test_approx_is_no_slower_than_the_heuristic_baselines_at_low_budgets(vgg16_tiny: Graph) -> None:
    """A coarsened zoo graph near its least budget: the portfolio's starts (DTR, Chen, vDNN, Capuchin)
    are evaluated on the full graph, so approx never loses to them, whatever the LP rounding does."""
    g = vgg16_tiny
    peak, lower = g.peak_bytes(), min_feasible_budget(g)
    fitted = 0
    for frac in (0.15, 0.35):
        budget = int(lower + frac * (peak - lower))
        others = {}
        for b in ("chen", "swap-vdnn", "capuchin", "dtr"):
            try:
                others[b] = plan(g, budget, solver=b)
            except BudgetInfeasibleError:
                continue
            check_plan(g, others[b], budget)
        try:
            mine = plan(g, budget, solver="approx", time_limit=15, **COARSE)
        except BudgetInfeasibleError:
            assert not others, f"approx found no plan at {frac} where {sorted(others)} did"
            continue
        fitted += 1
        check_plan(g, mine, budget)
        assert mine.info["plan_from"] and mine.info["coarse_stages"] <= 30
        for b, other in others.items():
            assert mine.predicted_time_s <= other.predicted_time_s * (1 + 1e-9), \
                f"{b} at {frac}: {other.predicted_time_s} < approx {mine.predicted_time_s} ({mine.info['plan_from']})"
    assert fitted >= 1


def test_approx_keeps_a_seeded_plan_when_the_str_solve_fails(monkeypatch: pytest.MonkeyPatch,
                                                               vgg16_tiny: Graph) -> None:
    """With the LP rounding finding nothing, the plan comes from a heuristic start (polished), and the
    run says so."""
    monkeypatch.setattr(relax, "solve_relaxed", lambda p, **kw: (None, {"rounding": "disabled by the test"}))
    g = vgg16_tiny
    budget = int(0.5 * (g.peak_bytes() + min_feasible_budget(g)))
    p = plan(g, budget, solver="approx", time_limit=10, **COARSE)
    check_plan(g, p, budget)
    assert p.info["plan_from"] != "str"
    assert "found no plan on the coarse problem" in p.info["notes"]
    dtr = plan(g, budget, solver="dtr")
    assert p.predicted_time_s <= dtr.predicted_time_s * (1 + 1e-9)


def test_refine_improves_a_start_and_keeps_it_valid(graph24: Graph) -> None:
    """refine on the full problem: a GapPlanner start (Capuchin's construction) and an actions start
    (the DTR replay) both come back fitting the budget, the improved ones no costlier in the model."""
    from hybridmem.solvers.baselines import dtr_plan

    budget = int(0.7 * graph24.peak_bytes())
    p = build_problem(graph24, budget, DEVICE)
    gp = relax.GapPlanner(p)
    gp.capuchin_fill()
    starts = [("capuchin", gp)]
    try:
        starts.append(("dtr", dtr_plan(p, budget).actions))
    except BudgetInfeasibleError:
        pass
    out = relax.refine(p, starts, time_budget=5.0)
    assert out
    costs: dict[str, float] = {}
    for name, sched, cost in out:
        res = simulate(graph24, Plan(actions=schedule_to_actions(p, sched)), device=DEVICE, budget=budget, strict=True)
        assert res.peak_bytes <= budget
        costs[name] = cost
    refined = {name: cost for name, cost in costs.items() if "+" in name}  # "start+refinement" vs "start"
    assert refined
    for name, cost in refined.items():
        assert cost <= costs[name.split("+")[0]] + 1e-12


def test_infeasible_approx_reports_the_lower_bound_and_what_starts_reached(graph24: Graph) -> None:
    need = int(build_problem(graph24, 1, DEVICE).min_bytes().max())
    lower = min_feasible_budget(graph24)
    budget = max(need, lower) - 1
    with pytest.raises(BudgetInfeasibleError) as e:
        plan(graph24, budget)
    assert e.value.minimum_bytes > budget
    # below the memory floor no start runs, so none reached a peak (the message names the floor alone)
    assert getattr(e.value, "reached_bytes", None) is None and "memory floor" not in str(e.value)


# ---- the recompute-only LP start -------------------------------------------------------------------
def test_recompute_only_lp_rounded_by_dropped_mass_gives_a_recompute_plan(vgg16_tiny: Graph) -> None:
    """Checkmate's LP relaxation rounded by dropped mass: a valid plan with recomputes only (the
    repair without swaps), no faster than its LP bound says a recompute-only plan can be."""
    from hybridmem.graph.costs import get_cost_model
    from hybridmem.solvers._common import make_plan

    g = vgg16_tiny
    budget = int(0.5 * (g.peak_bytes() + min_feasible_budget(g)))
    pb = planning_problem(g, budget, get_cost_model(DEVICE), **COARSE)
    sched, info = relax.solve_relaxed(pb, swap=False, rules=("lp-drop",), variants=({"allow_swap": False},))
    assert sched is not None and info["rounding"].startswith("lp-drop:")
    p = make_plan(pb, schedule_to_actions(pb, sched), "test")
    assert p.actions and not any(a.kind in ("swap_out", "swap_in") for a in p.actions)
    res = simulate(g, p, device=DEVICE, budget=budget, strict=True)
    assert res.peak_bytes <= budget
    assert res.time_s >= info["lp_bound_s"] * (1 - 1e-9)
    with pytest.raises(ValueError, match="expected 'mass' or 'drop'"):
        relax.GapPlanner(pb).load_lp(relax.LPValues({}, {}, {}, {}), "round")


def test_approx_offers_the_recompute_only_lp_start(vgg16_tiny: Graph) -> None:
    """The start runs in the portfolio (off with ``recompute_lp=False``), and approx is never slower than it."""
    from hybridmem.graph.costs import get_cost_model
    from hybridmem.solvers._common import make_plan

    g = vgg16_tiny
    budget = int(min_feasible_budget(g) + 0.3 * (g.peak_bytes() - min_feasible_budget(g)))
    mine = plan(g, budget, solver="approx", time_limit=10, **COARSE)
    check_plan(g, mine, budget)
    assert "recompute-lp" in mine.info["phases_s"]
    pb = planning_problem(g, budget, get_cost_model(DEVICE), **COARSE)
    sched, _ = relax.solve_relaxed(pb, swap=False, rules=("lp-drop",), variants=({"allow_swap": False}, {}))
    assert sched is not None
    res = simulate(g, make_plan(pb, schedule_to_actions(pb, sched), "test"), device=DEVICE, budget=None,
                   strict=False)
    assert not res.violations and res.peak_bytes <= budget
    assert mine.predicted_time_s <= res.time_s * (1 + 1e-9)
    off = plan(g, budget, solver="approx", time_limit=10, recompute_lp=False, **COARSE)
    assert "recompute-lp" not in off.info["phases_s"]


def test_the_recompute_only_lp_start_needs_a_second(monkeypatch: pytest.MonkeyPatch, vgg16_tiny: Graph) -> None:
    """Its share of what is left after the starts under RECOMPUTE_LP_MIN_S: not started (building its
    model alone would overrun the limit on a large graph)."""
    from hybridmem.solvers import approx

    g = vgg16_tiny
    budget = int(min_feasible_budget(g) + 0.3 * (g.peak_bytes() - min_feasible_budget(g)))
    monkeypatch.setattr(approx, "RECOMPUTE_LP_MIN_S", 1e6)
    assert "recompute-lp" not in plan(g, budget, solver="approx", time_limit=10, **COARSE).info["phases_s"]
    monkeypatch.setattr(approx, "RECOMPUTE_LP_MIN_S", 0.0)
    assert "recompute-lp" in plan(g, budget, solver="approx", time_limit=10, **COARSE).info["phases_s"]


def test_read_closure_follows_chains_of_bundles_made_in_one_coarse_stage() -> None:
    """A replay of C reads B, whose replay reads A: A may be needed wherever C is recomputed, even when
    all three were made in the same (coarse) stage, where no order of one pass sees it."""
    from types import SimpleNamespace

    def cand(tensor: int, uses: tuple[int, ...], src: tuple[int, ...]) -> SimpleNamespace:
        return SimpleNamespace(tensor=tensor, start=0, end=10, uses=uses, src=src, can_recompute=True)

    p = SimpleNamespace(candidates=[cand(100, (2,), ()), cand(101, (3,), (100,)), cand(102, (9,), (101,))],
                        index={100: 0, 101: 1, 102: 2})
    out = milp.read_closure(p)
    assert out == [{2, 3, 9}, {3, 9}, {9}]


# ---- the MILP's warm start on coarse problems --------------------------------------------------------
@pytest.fixture(scope="module")
def resnet50_tiny() -> Graph:
    return _zoo_graph("resnet50")


def test_stage_link_start_satisfies_the_rows_the_rounding_breaks(resnet50_tiny: Graph) -> None:
    """The rounded STR schedule queues copies FIFO, which the coarse model's one-copy-per-stage link
    rows refuse (CBC then drops the start); the start made from it satisfies every row."""
    from hybridmem.graph.costs import get_cost_model

    g = resnet50_tiny
    budget = int(0.5 * (g.peak_bytes() + min_feasible_budget(g)))
    pb = planning_problem(g, budget, get_cost_model(DEVICE), **COARSE)
    compact = relax.is_large(pb)
    sched, _ = relax.solve_relaxed(pb)
    assert sched is not None
    assert "breaks" in milp.check_start(milp.build_model(pb, compact=compact), sched)
    legal = relax.stage_link_start(pb, schedule_to_actions(pb, sched), compact)
    assert legal is not None
    sm = milp.build_model(pb, compact=compact)
    assert sm.link == "stage"
    assert milp.check_start(sm, legal) == "the warm start satisfies the MILP"
    res = simulate(g, make_plan(pb, schedule_to_actions(pb, legal), "test"), device=DEVICE, budget=budget,
                   strict=True)
    assert res.peak_bytes <= budget


def test_a_tensor_whose_source_is_gone_at_its_read_is_recomputed_before_it() -> None:
    """On a coarse problem a tensor's producer input may be last read in the stage before the tensor's
    own read: no recompute at the read, but one at an earlier stage, kept until the read (as Chen's plans
    do). The compact MILP offers that recompute, the gap planner makes it, and the start it gives
    satisfies the model's rows (without it, MobileNet's lowest budgets had no start and no MILP solution). A
    random 40-stage graph planned on 20 super-stages has such tensors (the zoo's MobileNet had them until a
    clone's recompute was charged the BatchNorm that rebuilds its input)."""
    from hybridmem.graph.costs import get_cost_model
    from hybridmem.solvers._common import early_recompute_stage, source_available

    g = random_graph(40, seed=0, readers=(1, 3))
    budget = g.peak_bytes()
    pb = planning_problem(g, budget, get_cost_model(DEVICE), coarsen=True, target=20)
    early = [(k, u, e) for k, c in enumerate(pb.candidates) for u in c.uses
             if (e := early_recompute_stage(pb, k, u)) is not None]
    assert early, "no tensor of the coarse graph needs an early recompute"
    gp = relax.GapPlanner(pb)
    k, u, e, gap = next((k, u, e, gp.gaps[i]) for k, u, e in early for i in gp.gaps_of[k]
                        if gp.gaps[i].hi == u and gp.early_rec(gp.gaps[i]) == e)
    src = pb.candidates[k].src
    assert any(source_available(pb, j, u) is False for j in src)
    assert all(source_available(pb, j, e) is not False for j in src)
    sm = milp.build_model(pb, compact=True)
    assert (e, k) in sm.R and (u, k) not in sm.R
    assert not gp.can_rec(k, u) and gp.early_rec(gap) == e
    gp._set(gap, "rec", e)
    r = gp.realize()
    assert gp.feasible(r) and e in r.recs and k in r.recs[e]
    sched = gp.schedule(r)
    assert milp.check_start(sm, sched) == milp.START_SATISFIES
    res = simulate(g, make_plan(pb, schedule_to_actions(pb, sched), "test"), device=DEVICE, budget=budget,
                   strict=True)
    assert res.peak_bytes <= budget


def test_the_milp_returns_its_start_at_a_low_budget_when_cbc_has_none(monkeypatch: pytest.MonkeyPatch,
                                                                         resnet50_tiny: Graph) -> None:
    """Near the least budget of a coarsened graph, with CBC ending with nothing of its own: the start
    made to satisfy the rows is the MILP's solution, and the plan returned fits the budget."""
    import mip

    g = resnet50_tiny
    lo = min_feasible_budget(g)
    budget = int(lo + 0.3 * (g.peak_bytes() - lo))
    real = mip.Model.optimize

    def nothing(self, **kw):           # the LP relaxations still solve
        return real(self, **kw) if kw.get("relax") else mip.OptimizationStatus.NO_SOLUTION_FOUND

    monkeypatch.setattr(mip.Model, "optimize", nothing)
    p = plan(g, budget, solver="milp", time_limit=6, **COARSE)
    check_plan(g, p, budget)
    assert p.info["warm_start"] == milp.START_SATISFIES, p.info
    assert p.info["status"] == milp.START_STATUS, p.info


def test_milp_on_a_coarse_problem_starts_from_a_solution(resnet50_tiny: Graph) -> None:
    g = resnet50_tiny
    budget = int(0.5 * (g.peak_bytes() + min_feasible_budget(g)))
    p = plan(g, budget, solver="milp", time_limit=6, **COARSE)
    check_plan(g, p, budget)
    assert p.info["warm_start"] == "the warm start satisfies the MILP", p.info
    assert p.info["status"] in ("optimal", "feasible")


def test_approx_falls_back_to_the_coarse_milp_when_no_start_fits(monkeypatch: pytest.MonkeyPatch,
                                                                  vgg16_tiny: Graph) -> None:
    """A coarsened graph where nothing else gives a plan (no heuristic starts, no LP rounding): approx
    asks the MILP on the planning problem and returns its plan; with ``milp_fallback=False`` it fails."""
    monkeypatch.setattr(relax, "solve_relaxed", lambda p, **kw: (None, {"rounding": "disabled by the test"}))
    g = vgg16_tiny
    budget = int(0.5 * (g.peak_bytes() + min_feasible_budget(g)))
    off = {"seed": False, "recompute_lp": False, **COARSE}
    with pytest.raises(BudgetInfeasibleError):
        plan(g, budget, solver="approx", milp_fallback=False, **off)
    p = plan(g, budget, solver="approx", **off)
    check_plan(g, p, budget)
    assert p.solver == "approx" and p.info["plan_from"] == "milp-fallback"


def test_a_swap_in_issued_while_resident_starts_once_the_tensor_is_dropped(graph24: Graph) -> None:
    """A time-limited MILP solution may keep a tensor on the device after its swap-in was issued: the
    plan issues the copy after the tensor is dropped instead, and the simulator accepts it."""
    import numpy as np

    from hybridmem.solvers._common import Schedule, TensorSchedule

    p = build_problem(graph24, graph24.peak_bytes(), DEVICE)
    c = next(c for c in p.candidates if c.uses == (c.start + 1, c.end) and c.end - c.start >= 6)
    pres = np.ones(c.end - c.start + 1, dtype=bool)
    pres[4:-1] = False                          # kept through start + 3, back for the last read
    sched = Schedule({c.tensor: TensorSchedule(c.tensor, c.start, pres, [], c.start, [(c.start + 2, c.end)])})
    actions = schedule_to_actions(p, sched)
    ins = [a.stage for a in actions if a.kind == "swap_in" and a.tensor == c.tensor]
    assert ins == [c.start + 4]                 # the stage after the last one it was kept for
    simulate(graph24, Plan(actions=make_plan(p, actions, "test").actions), device=DEVICE, strict=True)


def test_the_background_lp_is_the_lp_solved_in_process() -> None:
    """solvers.lp.Background (the STR LP in a forked child, beside the portfolio's starts) returns what
    the in-process solve returns; a job no longer wanted is stopped."""
    from hybridmem.solvers import lp

    g = random_graph(60, seed=3)
    p = planning_problem(g, int(0.5 * g.peak_bytes()), "h100-80gb")
    here = lp.solve(p, time_limit=30, compact=True)
    there = lp.Background(p, 30, compact=True).result()
    assert here.result.status == there.result.status == "optimal"
    assert there.result.objective == pytest.approx(here.result.objective, rel=1e-9, abs=1e-12)
    assert there.values is not None and there.values.S.keys() == here.values.S.keys()
    job = lp.Background(p, 30, compact=True)
    job.close()
    assert job.result().values is None and job.result().result.status == "stopped"


def test_the_milp_without_a_plan_in_hand_starts_from_the_best_start_that_does_not_fit() -> None:
    """Where no start fits, the MILP's warm start is made from the best one that does not (Capuchin's
    construction, over budget): the stage link start repairs its memory where it can."""
    from hybridmem.solvers import approx

    g = random_graph(30, seed=5)
    fine = build_problem(g, int(0.4 * g.peak_bytes()), "h100-80gb")
    gp = relax.GapPlanner(fine)
    gp.capuchin_fill()
    actions = approx._unfit_start(fine, [(float("inf"), "capuchin", gp)])
    assert actions == schedule_to_actions(fine, gp.schedule(gp.realize()))
    assert approx._unfit_start(fine, []) is None


def test_swap_issue_stages_span_the_earliest_to_the_latest_hidden() -> None:
    from hybridmem.solvers.gaps import SWAP_ISSUE_POINTS
    g = random_graph(40, seed=18)
    p = build_problem(g, int(0.5 * g.peak_bytes()), "h100-80gb")
    gp = relax.GapPlanner(p)
    wide = [x for x in gp.gaps if gp.latest_hidden_q(x) - x.lo > SWAP_ISSUE_POINTS + 2]
    assert wide
    for x in wide:
        qs = gp.swap_issue_stages(x)
        assert qs == sorted(set(qs)) and qs[0] == x.lo + 1 and qs[-1] == gp.latest_hidden_q(x)
        assert len(qs) == SWAP_ISSUE_POINTS + 2 and all(x.lo < q <= x.hi for q in qs)
        assert gp.swap_issue_stages(x, 0) == [x.lo + 1, gp.latest_hidden_q(x)]


@pytest.mark.parametrize("seed,share", [(18, 0.5), (18, 0.6), (12, 0.6)])
def test_improve_finds_swaps_issued_between_the_earliest_and_latest_hidden_stage(seed: int, share: float) -> None:
    """From the DTR plan, the improvement with swap-ins issued between the earliest and the latest hidden
    stage ends cheaper than with those two alone (where another copy holds the link, the latest hidden
    stage stalls and the earliest holds the bytes too long)."""
    import time

    from hybridmem.solvers.baselines import dtr_plan

    g = random_graph(40, seed=seed)
    budget = int(share * g.peak_bytes())
    p = build_problem(g, budget, "h100-80gb")
    start = dtr_plan(p, budget).actions
    costs = []
    for full in (False, True):
        gp = relax.GapPlanner(p)
        gp.load_actions(start)
        r = gp.realize()
        r = gp.improve(r, time.perf_counter() + 30) if full else gp._improve(r, time.perf_counter() + 30, 0)
        assert gp.feasible(r)
        costs.append(r.cost)
    assert costs[1] < costs[0] - 1e-9


def test_large_graphs_polish_their_best_start_before_the_lp(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a large graph the best fitting start (Capuchin's construction where none fits) is polished right
    after the starts (a short time limit then ends with a polished plan), before the STR LP; the final
    polish goes on from where that polish left it (its planner, not the raw start)."""
    from hybridmem.solvers import approx

    events: list[tuple[str, list[tuple[str, Any]]]] = []
    real_refine = relax.refine

    def refine(p, starts, **kwargs):
        events.append(("polish", list(starts)))
        return real_refine(p, starts, **kwargs)

    def no_str_plan(*args, **kwargs):
        events.append(("str", []))
        return None               # the STR step finds nothing: the final polish has the starts alone

    monkeypatch.setattr(relax, "refine", refine)
    monkeypatch.setattr(approx, "_solve_problem", no_str_plan)
    g = random_graph(80, seed=3, device="v100-16gb")
    out = plan(g, int(0.6 * g.peak_bytes()), device="v100-16gb", time_limit=20, recompute_lp=False)
    assert [e[0] for e in events] == ["polish", "str", "polish"]
    early, final = dict(events[0][1]), dict(events[2][1])
    assert list(early) == ["capuchin"]          # the best fitting start here
    for name in early:
        assert isinstance(final[name], relax.GapPlanner)    # went on from where the first polish left it
    assert simulate(g, out, device="v100-16gb").peak_bytes <= out.budget_bytes


def test_refine_hands_back_its_planners_as_it_left_them() -> None:
    """``refine(planners=...)``: each start's planner in the state its polish ended in (the ``approx``
    portfolio's final polish goes on from there)."""
    import time

    from hybridmem.solvers.baselines import dtr_plan

    g = random_graph(40, seed=18)
    budget = int(0.5 * g.peak_bytes())
    p = build_problem(g, budget, "h100-80gb")
    planners: dict[str, Any] = {}
    out = relax.refine(p, [("dtr", dtr_plan(p, budget).actions)], time_budget=30, planners=planners)
    assert isinstance(planners["dtr"], relax.GapPlanner)
    r = planners["dtr"].realize()
    assert planners["dtr"].feasible(r) and r.cost == pytest.approx(out[-1][2])
    # going on from there: nothing is lost, and a converged planner stays where it is
    r2 = planners["dtr"].improve(r, time.perf_counter() + 30)
    assert r2.cost <= r.cost + 1e-12


def test_the_early_polish_leaves_an_unfit_capuchin_to_the_final_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_polish(repair=False)`` (the early polish) takes the best fitting start alone; Capuchin's
    construction that does not fit is repaired by the final polish (``repair=True``), or by the early
    one where no start fits."""
    from hybridmem.solvers import approx
    from hybridmem.solvers.baselines import dtr_plan

    g = random_graph(40, seed=18)
    budget = int(0.5 * g.peak_bytes())
    p = build_problem(g, budget, "h100-80gb")
    taken: list[list[str]] = []
    monkeypatch.setattr(relax, "refine", lambda p, starts, **kw: taken.append([n for n, _ in starts]) or [])
    pool = approx._Pool(g, budget, p.model)
    seeds = [(1.0, "dtr", dtr_plan(p, budget).actions), (float("inf"), "capuchin", relax.GapPlanner(p))]
    approx._polish(pool, p, None, seeds, "approx", None, {}, best_of=1, repair=False)
    approx._polish(pool, p, None, seeds, "approx", None, {}, best_of=1)
    approx._polish(pool, p, None, seeds[1:], "approx", None, {}, best_of=1, repair=False)
    assert taken == [["dtr"], ["dtr", "capuchin"], ["capuchin"]]

"""The STR MILP against exhaustive search over plans, under the simulator, on random small graphs.

The enumerator below knows nothing of the MILP. For every saved activation it lists every *timeline*:
at each stage between its producer and its last reader it is on the device or not (readers force it on),
each return to the device is a recompute or a swap-in issued at that stage, and a swap-in needs one
swap-out, issued at any earlier stage where the tensor is on the device. Every combination of the
tensors' timelines is replayed by the simulator; the fastest that fits the budget is the optimum the
MILP must reach.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from hybridmem.errors import BudgetInfeasibleError, InfeasiblePlanError
from hybridmem.plan import Action, Plan
from hybridmem.simulate import simulate
from hybridmem.solvers import plan
from hybridmem.solvers._common import Candidate, build_problem
from hybridmem.solvers._synth import random_graph

# (device, n_forward, seed) of 8-stage graphs whose plans span a real range of peaks (the least is
# 0.6-0.86 of the keep-all peak) and whose plan space is small enough to enumerate in about a second.
# On the v100 model the host link is slow (swaps cost), on the h100 one it is fast.
CASES = [("v100-16gb", 4, 10), ("v100-16gb", 4, 12), ("v100-16gb", 4, 16), ("v100-16gb", 4, 19),
         ("v100-16gb", 4, 22), ("v100-16gb", 4, 25), ("v100-16gb", 3, 2), ("h100-80gb", 4, 1),
         ("h100-80gb", 4, 10), ("h100-80gb", 4, 12), ("h100-80gb", 3, 3),
         pytest.param("h100-80gb", 3, 12, marks=pytest.mark.xfail(strict=True, reason=(
             "known: at the tightest budget the best plan relies on a swap-in stall delaying op 3's memory "
             "check past a swap-out's deferred release; the MILP times copies on the clock without stalls "
             "(conservative), so it finds that budget infeasible; modelling it needs stall variables equal to the simulator's "
             "stall, not only bounded below, or the MILP could buy memory with a stall that never happens")))]
FRACTIONS = (0.0, 0.15, 0.35, 0.6, 0.85)


def timelines(graph, c: Candidate, n: int) -> list[list[Action]]:
    """Every timeline of candidate ``c`` as a list of actions (keeping it throughout is the empty list)."""
    p, e = c.start, c.end
    natural_end = graph.tensors[c.tensor].last_stage(n)
    uses = set(c.uses)
    optional = [t for t in range(p + 1, e + 1) if t not in uses]
    out = []
    for bits in itertools.product((False, True), repeat=len(optional)):
        on = {t: True for t in range(p, e + 1)}
        on.update(zip(optional, bits))
        returns = [t for t in range(p + 1, e + 1) if on[t] and not on[t - 1]]
        drops = [t for t in range(p, e + 1) if on[t] and (t < e and not on[t + 1] or t == e and t < natural_end)]
        for modes in itertools.product(("recompute", "swap_in"), repeat=len(returns)):
            first_in = min((t for t, m in zip(returns, modes) if m == "swap_in"), default=None)
            outs = [None] if first_in is None else [t for t in range(p, first_in) if on[t]]
            for o in outs:
                acts = [Action("swap_out", c.tensor, o)] if o is not None else []
                acts += [Action(m, c.tensor, t) for t, m in zip(returns, modes)]
                acts += [Action("free", c.tensor, t) for t in drops]
                out.append(acts)
    return out


def enumerate_plans(graph, device: str) -> tuple[np.ndarray, np.ndarray]:
    """(peak bytes, step seconds) of every enumerated plan the simulator accepts."""
    p = build_problem(graph, graph.peak_bytes(), device)
    per = [timelines(graph, c, graph.num_stages) for c in p.candidates]
    peaks, times = [], []
    for combo in itertools.product(*per):
        actions = list(p.early_free) + [a for acts in combo for a in acts]
        # recomputes of sources first: list order is what the simulator follows within a stage
        actions.sort(key=lambda a: (a.stage, 0 if a.kind in ("recompute", "swap_in") else 1,
                                    graph.tensors[a.tensor].producer))
        try:
            res = simulate(graph, Plan(actions=actions), device=device, budget=None, strict=True)
        except InfeasiblePlanError:
            continue
        peaks.append(res.peak_bytes)
        times.append(res.time_s)
    return np.array(peaks, dtype=np.int64), np.array(times)


def best_within(peaks: np.ndarray, times: np.ndarray, budget: int) -> float:
    ok = peaks <= budget
    return float(times[ok].min()) if ok.any() else float("inf")


@pytest.mark.parametrize("device,n_forward,seed", CASES)
def test_milp_optimum_equals_exhaustive_search(device: str, n_forward: int, seed: int) -> None:
    g = random_graph(8, seed=seed, n_forward=n_forward, device=device, mb=(2, 32))
    peaks, times = enumerate_plans(g, device)
    low, peak = int(peaks.min()), g.peak_bytes()
    assert low < peak
    # budgets from the least any plan needs up to just under the keep-all peak, plus one that fits nothing
    budgets = sorted({int(low + f * (peak - low)) for f in FRACTIONS} | {low - 1})
    for b in budgets:
        truth = best_within(peaks, times, b)
        try:
            pl = plan(g, b, device=device, solver="milp", time_limit=30)
        except BudgetInfeasibleError:
            assert truth == float("inf"), f"budget {b}: the MILP found no plan, exhaustive search found {truth}"
            continue
        assert "fallback" not in pl.info, pl.info
        assert pl.info["status"] == "optimal"
        res = simulate(g, pl, device=device, budget=b, strict=True)
        assert res.peak_bytes <= b
        assert res.time_s == pytest.approx(truth, rel=1e-9, abs=1e-12), f"budget {b}"
        # the MILP's own objective is the simulated time: its timing model is exact on these graphs
        assert pl.info["objective_s"] == pytest.approx(res.time_s, rel=1e-6, abs=1e-9)

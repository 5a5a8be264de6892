"""Exhaustive search over small graphs: every plan of every candidate timeline the simulator accepts (the
ground truth the exact MILP, the lower bound and the least-budget search are checked against)."""
from __future__ import annotations

import itertools

import numpy as np

from hybridmem.errors import InfeasiblePlanError
from hybridmem.graph.plan import Action, Plan
from hybridmem.graph.simulate import simulate
from hybridmem.solvers._common import Candidate, build_problem


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

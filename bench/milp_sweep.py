"""Does the MILP return a solution at every budget of a sweep? ``plan(g, b, solver="milp", time_limit=...)``
at fixed budgets, with what the MILP returned at each.

    python -m bench.milp_sweep                                  # the 73 budgets below, time_limit=10
    python -m bench.milp_sweep --units unet:h100-80gb --time-limit 30 -o out.jsonl
    python -m bench.milp_sweep --solver-backend highs           # HiGHS instead of CBC

The budgets are those of a simulated bench sweep (``python -m bench.runner --no-measured --methods
hybridmem-milp``: from the lowest budget a probe planner meets to the keep-all peak, the peak itself left
out) for the seven paper models (VGG16, ResNet-50/101/152, MobileNet, UNet, the Transformer; paper size) on
h100-80gb and v100-16gb, 73 budgets; MobileNet, VGG16 and the Transformer on v100 stop at the device's 16 GiB. Each budget's line (JSON) says the MILP's
``status`` (``optimal`` / ``feasible``: CBC's solution; ``feasible (the warm start)``: the start it was
given, which satisfies every row, CBC having ended with nothing of its own; anything else: no MILP
solution), whether the start satisfied the model, the plan returned (the MILP's, or the approx plan where
the simulator times that faster: ``fallback``), and that the plan was checked by the simulator at the
budget. A table per model and device closes the run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

# (model, device) -> (keep-all peak, budgets in bytes): the sweep of 2026-12-01 (bench.runner, paper size)
BUDGETS: dict[tuple[str, str], tuple[int, list[int]]] = {
    ("unet", "h100-80gb"): (12195452584, [4457027733, 6004712703, 7552397673, 9100082643, 10647767613]),
    ("unet", "v100-16gb"): (12195452584, [4530031741, 6063115909, 7596200078, 9129284246, 10662368415]),
    ("mobilenet", "h100-80gb"): (40314361576, [14352842887, 19545146624, 24737450362, 29929754100, 35122057838]),
    ("mobilenet", "v100-16gb"): (40314361576, [14352842887, 14918248146, 15483653405, 16049058665, 16614463924,
                                               17179869184]),
    ("resnet50", "h100-80gb"): (5659914224, [1732439417, 2517934378, 3303429339, 4088924301, 4874419262]),
    ("resnet50", "v100-16gb"): (5659914224, [1915966277, 2664755866, 3413545455, 4162335045, 4911124634]),
    ("resnet101", "h100-80gb"): (12441420424, [3545586981, 5324753669, 7103920358, 8883087046, 10662253735]),
}
# the same sweep's other budgets, as its tables give them (GiB, 2 decimals)
_GIB = {
    ("vgg16", "h100-80gb"): (19932863560, [10.49, 12.10, 13.72, 15.33, 16.95]),
    ("vgg16", "v100-16gb"): (19932863560, [10.49, 11.59, 12.69, 13.80, 14.90, 16.00]),
    ("resnet101", "v100-16gb"): (12441420424, [3.70, 5.28, 6.86, 8.43, 10.01]),
    ("transformer", "h100-80gb"): (30051342360, [13.13, 16.10, 19.07, 22.04, 25.02]),
    ("transformer", "v100-16gb"): (30051342360, [13.13, 13.70, 14.28, 14.85, 15.43, 16.00]),
    ("resnet152", "h100-80gb"): (11656590112, [3.50, 4.97, 6.44, 7.92, 9.39]),
    ("resnet152", "v100-16gb"): (11656590112, [3.58, 5.03, 6.49, 7.95, 9.40]),
}
BUDGETS.update({k: (peak, [round(g * 2**30) for g in gib]) for k, (peak, gib) in _GIB.items()})
MILP_SOLUTION = ("optimal", "feasible")      # statuses of a MILP solution (the warm start's starts with "feasible")


def has_solution(status: str | None) -> bool:
    return bool(status) and status.startswith(MILP_SOLUTION)


def run_budget(graph: Any, device: str, budget: int, time_limit: float, backend: str = "cbc") -> dict[str, Any]:
    """One ``plan(..., solver="milp")`` call and what it says; the plan is simulated at ``budget``."""
    from hybridmem.errors import BudgetInfeasibleError
    from hybridmem.graph.simulate import simulate
    from hybridmem.solvers import plan

    t0 = time.perf_counter()
    row: dict[str, Any] = {"budget_bytes": budget, "of_peak": round(budget / graph.peak_bytes(), 4)}
    try:
        p = plan(graph, budget, device=device, solver="milp", time_limit=time_limit, solver_backend=backend)
    except BudgetInfeasibleError as e:
        row.update(status=None, plan=None, note=str(e)[:300])
    else:
        res = simulate(graph, p, device=device, budget=budget, strict=False)
        row.update(status=p.info.get("status"), warm_start=p.info.get("warm_start"),
                   plan_from=p.info.get("plan_from"), fallback=p.info.get("fallback"),
                   notes=p.info.get("notes"), milp_s=p.info.get("milp_s"),
                   milp_stages=p.info.get("milp_stages"), milp_refined=p.info.get("milp_refined"),
                   overhead=round(float(p.info.get("overhead", 0.0)), 4),
                   valid=not res.violations and res.peak_bytes <= budget)
    row["has_milp_solution"] = has_solution(row.get("status"))
    row["warm_start_returned"] = row.get("status") == "feasible (the warm start)"
    row["backend"] = backend
    row["s"] = round(time.perf_counter() - t0, 1)
    row["load"] = round(os.getloadavg()[0], 1)
    return row


def emit(row: dict[str, Any], sink: Any = None) -> None:
    """Print ``row`` as one JSON line, and write it to ``sink`` (an open file) too where given."""
    line = json.dumps(row)
    print(line, flush=True)
    if sink:
        sink.write(line + "\n")
        sink.flush()


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: per model and device, the budgets, MILP solutions, warm starts among them, statuses."""
    out = ["| model | device | budgets (of peak) | MILP solution | of which the warm start | statuses | load |",
           "|---|---|---|---:|---:|---|---|"]
    units: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        units.setdefault((r["model"], r["device"]), []).append(r)
    tot = sol = ws = 0
    for (model, device), rs in units.items():
        counts: dict[str, int] = {}
        for r in rs:
            counts[str(r.get("status"))] = counts.get(str(r.get("status")), 0) + 1
        n_sol = sum(r["has_milp_solution"] for r in rs)
        n_ws = sum(r["warm_start_returned"] for r in rs)
        loads = [r["load"] for r in rs]
        fracs = ", ".join(f"{100 * r['of_peak']:.1f}" for r in rs)
        out.append(f"| {model} | {device} | {fracs} % | {n_sol} of "
                   f"{len(rs)} | {n_ws} | {', '.join(f'{k} {v}' for k, v in counts.items())} | "
                   f"{min(loads):.1f}-{max(loads):.1f} |")
        tot, sol, ws = tot + len(rs), sol + n_sol, ws + n_ws
    out.append(f"| all | | {tot} budgets | {sol} of {tot} | {ws} | | |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.milp_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="the MILP's time limit per budget (s)")
    ap.add_argument("--units", help="comma-separated model:device pairs (default: all fourteen)")
    ap.add_argument("--solver-backend", default="cbc", choices=("cbc", "highs"),
                    help="the MILP solver: CBC (python-mip's own) or HiGHS (pip install 'hybridmem[highs]')")
    ap.add_argument("-o", "--output", help="also write each budget's JSON line to this file")
    args = ap.parse_args(argv)
    from hybridmem.graph.costs import apply_costs, get_cost_model

    from .runner import capture_graph

    units = list(BUDGETS)
    if args.units:
        want = [tuple(u.split(":")) for u in args.units.split(",")]
        unknown = [u for u in want if u not in BUDGETS]
        if unknown:
            ap.error(f"unknown units {unknown}: one of {', '.join(':'.join(u) for u in BUDGETS)}")
        units = [u for u in units if u in want]
    graphs: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    sink = open(args.output, "w") if args.output else None
    try:
        for model, device in units:
            if model not in graphs:
                graphs[model] = capture_graph(model, "paper")
            g = apply_costs(graphs[model], get_cost_model(device))
            peak, budgets = BUDGETS[model, device]
            if g.peak_bytes() != peak:
                print(f"note: {model}'s keep-all peak is {g.peak_bytes()} B, the sweep's was {peak} B",
                      file=sys.stderr)
            for b in budgets:
                row = {"model": model, "device": device, **run_budget(g, device, b, args.time_limit,
                                                                      args.solver_backend)}
                rows.append(row)
                emit(row, sink)
    finally:
        if sink:
            sink.close()
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

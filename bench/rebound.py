"""Raise the bounds of a saved bench run to the valid swap/recompute bound: ``python -m bench.rebound IN -o OUT``.

Runs of ``hybridmem bench`` made before :mod:`solvers.bound` existed compare every plan with the LP
relaxation's bound, or with the pure compute time where no LP solved. This recomputes, for each simulated
run of a results.json, :func:`solvers.bound.lower_bound` at each of its budgets on the run's own graph
(captured again on ``meta`` exactly as :func:`bench.runner._sim_unit` does, costs from the run's device
model) and, where that bound is higher than the recorded one, makes it the budget's bound: ``bounds[i]``
gets its ``lower_bound_s``, ``lower_bound_overhead`` and ``source: "swap/recompute bound"``, and every
plan at that budget its ``gap_to_bound`` again (as the runner computes it). Every bounds entry also gets
``valid_bound_s`` and ``valid_bound_kind`` (the bound itself, kept even where the LP value stays the
larger), ``valid_bound_feasible`` (False: even evicting everything evictable does not fit, so no
swap/recompute plan exists; ``valid_bound_s`` is then None) and ``valid_bound_stage``. Nothing else in
the file changes but a top-level ``rebound`` record of what was done. A fresh ``hybridmem bench`` run
computes these bounds itself (``bench.runner._best_bound``); this is for results saved before that.

No plan of swaps, recomputes and frees can beat the valid bound, so a plan faster than it is reported
(``below_valid_bound``): it is either a compressing plan (outside the bound's model) or a bug.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .report import SCHEMA
from .runner import _BOUND_SOURCE, _json_default, capture_graph

SOURCE = _BOUND_SOURCE["lower_bound_s"]  # the runner's name for this bound
_REL = 1e-9                        # "higher" means higher by more than rounding (as runner._best_bound)


def rebound_run(run: dict[str, Any], graph: Any) -> dict[str, Any]:
    """Recompute the valid bound at each budget of one simulated ``run`` on its ``graph`` (in place).

    ``graph`` is the run's model as captured (costs not yet applied). Returns a summary: ``budgets``,
    ``raised`` (budgets whose bound went up), ``infeasible`` (budgets where no swap/recompute plan fits)
    and ``below_valid_bound`` (``[{method, budget_bytes, time_s, valid_bound_s}]``: plans faster than the
    valid bound, which should not exist).
    """
    from hybridmem.graph.costs import apply_costs, get_cost_model
    from hybridmem.solvers.bound import lower_bound

    device = run["device"]
    g = apply_costs(graph, get_cost_model(device))  # as simulate_model does before planning
    keep_all_s = run.get("keep_all_time_s")
    bounds = {b["budget_bytes"]: b for b in run.get("bounds", [])}
    summary: dict[str, Any] = {"model": run.get("model"), "device": device, "budgets": 0, "raised": 0,
                               "infeasible": 0, "below_valid_bound": []}
    for budget in run.get("budgets", []):
        entry = bounds.get(budget)
        if entry is None:
            raise ValueError(f"simulated {run.get('model')} on {device}: budget {budget} has no bounds entry; "
                             "expected one per budget (a results.json written by hybridmem bench)")
        summary["budgets"] += 1
        lb = lower_bound(g, int(budget), device)
        entry["valid_bound_kind"] = lb.kind
        entry["valid_bound_stage"] = lb.stage
        entry["valid_bound_feasible"] = lb.feasible
        rows = [r for r in run.get("results", []) if r.get("budget_bytes") == budget]
        if not lb.feasible:
            entry["valid_bound_s"] = None
            summary["infeasible"] += 1
            # no swap/recompute plan fits: any plan found here is compressing, or a bug
            summary["below_valid_bound"] += [_below(r, None) for r in rows if _ok(r)]
            continue
        entry["valid_bound_s"] = float(lb.time_s)
        summary["below_valid_bound"] += [_below(r, lb.time_s) for r in rows
                                         if _ok(r) and r["time_s"] < lb.time_s * (1 - _REL)]
        old = entry.get("lower_bound_s")
        if isinstance(old, (int, float)) and lb.time_s <= old * (1 + _REL):
            continue
        bound_s = float(lb.time_s)
        entry["lower_bound_s"], entry["source"] = bound_s, SOURCE
        entry["lower_bound_overhead"] = bound_s / keep_all_s - 1 if keep_all_s else None
        for r in rows:  # as bench.runner.simulate_model sets it
            if _ok(r):
                r["gap_to_bound"] = r["time_s"] / bound_s - 1 if bound_s else None
        summary["raised"] += 1
    return summary


def _ok(r: dict[str, Any]) -> bool:
    return r.get("status") == "ok" and bool(r.get("time_s"))


def _below(r: dict[str, Any], bound_s: float | None) -> dict[str, Any]:
    return {"method": r.get("method"), "budget_bytes": r.get("budget_bytes"), "time_s": r.get("time_s"),
            "valid_bound_s": bound_s}


def rebound(results: dict[str, Any], *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Recompute the valid bounds of every simulated run of ``results`` (in place); returns the record.

    Each model is captured once (on ``meta``, the runner's way) and shared by its devices. A captured
    graph that differs from the recorded one (stage or tensor count, batch) is an error: the bounds would
    belong to another graph.
    """
    if results.get("schema") != SCHEMA:
        raise ValueError(f"not a bench results file: schema {results.get('schema')!r}, expected {SCHEMA!r}")
    import torch

    torch.set_num_threads(1)
    graphs: dict[tuple[str, str], Any] = {}
    runs, t0 = [], time.perf_counter()
    for run in results.get("simulated", []):
        name, size = run.get("model"), run.get("size", "paper")
        if not name or "device" not in run:
            raise ValueError(f"simulated run without a model or device: {sorted(run)}")
        key = (name, size)
        t1 = time.perf_counter()
        if key not in graphs:
            graphs[key] = capture_graph(name, size, "meta")  # as bench.runner._sim_unit captures it
        g = graphs[key]
        got = {"stages": g.num_stages, "tensors": len(g.tensors), "batch": g.meta.get("batch")}
        for k, v in got.items():
            if run.get(k) is not None and run[k] != v:
                raise ValueError(f"simulated {name} ({size}) on {run['device']}: the graph captured now has "
                                 f"{k}={v}, the saved run {run[k]}; its bounds cannot be recomputed on this "
                                 "graph (was the model zoo or capture changed since the run?)")
        s = rebound_run(run, g)
        s["seconds"] = round(time.perf_counter() - t1, 2)
        runs.append(s)
        if log is not None:
            log(f"{name} {run['device']}: {s['raised']}/{s['budgets']} bounds raised, "
                f"{len(s['below_valid_bound'])} plans below the valid bound ({s['seconds']:.1f} s)")
    record = {"created": _dt.datetime.now().isoformat(timespec="seconds"), "tool": "python -m bench.rebound",
              "seconds": round(time.perf_counter() - t0, 2), "runs": runs,
              "raised": sum(s["raised"] for s in runs), "budgets": sum(s["budgets"] for s in runs),
              "below_valid_bound": sum(len(s["below_valid_bound"]) for s in runs)}
    results["rebound"] = record
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rebound", description=__doc__.splitlines()[0])
    ap.add_argument("input", type=Path, help="a results.json written by hybridmem bench")
    ap.add_argument("-o", "--output", type=Path, required=True, help="where to write the updated results.json")
    args = ap.parse_args(argv)
    try:
        results = json.loads(args.input.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"python -m bench.rebound: error: cannot read {args.input}: {e}", file=sys.stderr)
        return 2
    try:
        rec = rebound(results, log=lambda line: print(line, flush=True))
    except ValueError as e:
        print(f"python -m bench.rebound: error: {e}", file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1, default=_json_default))
    print(f"wrote {args.output}: {rec['raised']}/{rec['budgets']} bounds raised to the swap/recompute bound, "
          f"{rec['below_valid_bound']} plans below the valid bound, in {rec['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

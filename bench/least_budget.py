"""The least budget each zoo model trains in, and a check 1 % below it.

    python -m bench.least_budget -o least.jsonl                 # the eight zoo models, paper size, h100-80gb
    python -m bench.least_budget --models unet,gpt --check-s 60

Per model: ``plan(graph, "min")`` with its defaults (approx probes, and where approx finds no plan on a
graph it does not solve exactly, the MILP for ``milp_probe_s`` seconds), the returned plan checked by the
simulator at the least budget found, then ``plan(..., solver="milp", time_limit=CHECK_S)`` 1 % below that
budget. Below the memory floor no plan can exist, and the line says so instead of asking the MILP. Each
model's line is JSON; a markdown table closes the run.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any

from .milp_sweep import emit

MODELS = ("vgg16", "unet", "mobilenet", "resnet50", "transformer", "gpt", "resnet101", "resnet152")
GIB = 2**30


def run_model(name: str, device: str, check_s: float, below: float = 0.01) -> dict[str, Any]:
    """The least-budget search on one zoo model and the MILP check ``below`` under what it found."""
    from hybridmem.errors import BudgetInfeasibleError
    from hybridmem.graph.costs import apply_costs, get_cost_model
    from hybridmem.graph.simulate import simulate
    from hybridmem.solvers import plan

    from .runner import capture_graph

    g = apply_costs(capture_graph(name, "paper"), get_cost_model(device))
    peak = g.peak_bytes()
    t0 = time.perf_counter()
    p = plan(g, "min", device=device)
    search_s = time.perf_counter() - t0
    least = int(p.info["min_budget_bytes"])
    res = simulate(g, p, device=device, budget=least, strict=False)
    row: dict[str, Any] = {
        "model": name, "device": device, "stages": g.num_stages, "peak_bytes": peak,
        "floor_bytes": int(p.info["memory_floor_bytes"]), "least_bytes": least,
        "no_plan_bytes": int(p.info["min_no_plan_bytes"]), "probes": int(p.info["min_probes"]),
        "overhead": round(float(p.info.get("overhead", 0.0)), 4), "plan_from": p.info.get("plan_from"),
        "valid": not res.violations and res.peak_bytes <= least, "search_s": round(search_s, 1),
        "search_load": round(os.getloadavg()[0], 1)}
    check = int(least * (1 - below))
    row["check_bytes"] = check
    t0 = time.perf_counter()
    if check < row["floor_bytes"]:
        row["check"] = "under the memory floor: none exists"
    else:
        try:
            q = plan(g, check, device=device, solver="milp", time_limit=check_s)
        except BudgetInfeasibleError:
            row["check"] = "none"
        else:
            got = simulate(g, q, device=device, budget=check, strict=False)
            ok = not got.violations and got.peak_bytes <= check
            row["check"] = "found one" if ok else "none (its plan does not fit)"
            row["check_peak_bytes"] = int(got.peak_bytes)
    row["check_s"] = round(time.perf_counter() - t0, 1)
    row["check_load"] = round(os.getloadavg()[0], 1)
    return row


def table(rows: list[dict[str, Any]], check_s: float) -> list[str]:
    out = ["| model | stages | keep-all peak | memory floor | least budget found (of peak) | no plan found at | "
           f"probes | overhead there | plan from | valid | search | 1 % below: `milp`, {check_s:g} s | load |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---:|"]
    for r in rows:
        check = r["check"]
        if check == "found one":
            check = f"**found one** ({r['check_peak_bytes'] / GIB:.3f} GiB)"
        if not check.startswith("under"):
            check += f" ({r['check_s']:.0f} s)"
        out.append(
            f"| {r['model']} | {r['stages']} | {r['peak_bytes'] / GIB:.2f} GiB | {r['floor_bytes'] / GIB:.2f} GiB | "
            f"{r['least_bytes'] / GIB:.3f} GiB ({100 * r['least_bytes'] / r['peak_bytes']:.1f} %) | "
            f"{r['no_plan_bytes'] / GIB:.3f} GiB | {r['probes']} | {100 * r['overhead']:+.1f} % | {r['plan_from']} | "
            f"{'yes' if r['valid'] else '**no**'} | {r['search_s']:.0f} s | {check} | "
            f"{r['search_load']:.1f}-{r['check_load']:.1f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.least_budget", description=__doc__.split("\n")[0])
    ap.add_argument("--models", help=f"comma-separated zoo models (default: {','.join(MODELS)})")
    ap.add_argument("--device", default="h100-80gb", help="cost model (default: h100-80gb)")
    ap.add_argument("--check-s", type=float, default=60.0, help="the MILP's time limit 1 %% below (s)")
    ap.add_argument("-o", "--output", help="also write each model's JSON line to this file")
    args = ap.parse_args(argv)
    models = args.models.split(",") if args.models else list(MODELS)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}: one of {', '.join(MODELS)}")
    if args.check_s <= 0:
        ap.error(f"--check-s {args.check_s}: expected a positive number of seconds")
    rows = []
    sink = open(args.output, "a") if args.output else None
    try:
        for m in models:
            row = run_model(m, args.device, args.check_s)
            rows.append(row)
            emit(row, sink)
    finally:
        if sink:
            sink.close()
    print("\n".join(table(rows, args.check_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

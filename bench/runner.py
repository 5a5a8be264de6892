"""``hybridmem bench``: models x budgets x methods -> results.json, results.md and PNG plots.

Two kinds of truth, never mixed (each table says which it shows):

**simulated**: every paper model captured on ``meta`` at paper size, its costs set by a device model
(V100, A100, H100, H200), planned at budgets spread from the minimum feasible to the keep-all peak by
hybridmem (``milp``, ``approx``) and by the planner baselines (Chen sqrt(n), Checkmate, swap-only as
vDNN-like and as an optimal MILP, Capuchin-like, DTR-like). The one simulator judges every plan.
Reported: overhead against keep-all, the
gap to the best lower bound known at that budget (the LP relaxation's, the full graph's swap/recompute
bound of solvers.bound, else the compute time), and the
solver's wall time.

**measured**: small zoo models trained for a few steps on this CPU by every method of
:mod:`bench.measure`, interleaved, one torch thread: overhead as ratios measured side by side, peak from
one meter, and whether losses and gradients are bit-identical to the unmanaged run.

``--quick`` (the README's demo, about a minute on 2 cores): two small models measured, one paper model
planned on ``h100-80gb`` at three budgets.

Results schema (``results.json``, ``schema: "hybridmem-bench/1"``)::

    {schema, created, command, quick, wall_s, env: {hybridmem, torch, python, cpu, cores},
     missing: [str],                         # components or methods that could not run, and why
     measured: [{model, size, batch, steps, rounds, threads, peak_source, monitor_peak_bytes,
                 saved_bytes, budget_bytes, plan_solver, notes: [str],
                 results: [{method, status: ok|skipped|error, reason, step_s, overhead, peak_bytes,
                            budget_ok, losses, losses_identical, grads_identical, buffers_identical,
                            evicted_bytes: {policy: bytes}, regenerated_bytes, stall_s, times_s}]}],
     simulated: [{model, size, batch, device, stages, tensors, capture_s, keep_all_peak_bytes,
                  keep_all_time_s, min_feasible_bytes,   # the simulator's lower bound: nothing fits below
                  solver_minimum_bytes,                  # the lowest budget a probe planner met (sweep start)
                  minimum_search: {minimum_bytes, lower_bound_bytes, found_by, solvers, tolerance_bytes,
                                   search_s, probes: [{budget_bytes, solver, status, solve_s}]},
                  budget_capped_at_device_memory, no_plan_within_device_memory, device_memory_bytes,
                  budgets: [bytes],
                  bounds: [{budget_bytes, lower_bound_s, lower_bound_overhead, source}],
                  results: [{method, solver, budget_bytes, status: ok|infeasible|invalid|error|unavailable,
                             reason, note, time_s, overhead, stall_s, recompute_s, peak_bytes,
                             host_peak_bytes, bytes_h2d, bytes_d2h, solve_s, gap_to_bound, info}],
                  timeline: {method, budget_bytes, num_forward, memory, host_memory, keep_all_memory}}]}

Sizes in bytes, times in seconds, overheads and gaps as fractions (0.05 = 5 %).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .progress import Progress
from .report import SCHEMA, render_markdown, write_report

from .methods import SIM_METHODS, SOLVER_OF, methods_help  # noqa: F401  (re-exported)
DEVICES_ALL = ("v100-16gb", "a100-80gb", "h100-80gb", "h200")
FULL_DEVICES = ("h100-80gb", "v100-16gb")
MEASURED_SIZE = "small"
TIMELINE_POINTS = 1500          # memory-over-stages arrays are max-pooled to at most this many points


@dataclass
class Settings:
    """Everything a run depends on (from the CLI, with defaults per mode)."""

    quick: bool = False
    output: Path = Path("bench-results")
    models: list[str] = field(default_factory=list)            # simulated (paper size)
    measured_models: list[str] = field(default_factory=list)   # measured (small size)
    devices: list[str] = field(default_factory=list)
    sim_methods: list[str] = field(default_factory=lambda: list(SIM_METHODS))
    measured_methods: list[str] = field(default_factory=list)
    points: int = 6
    time_limit: float = 10.0
    steps: int = 5
    warmup: int = 1
    measured_size: str = MEASURED_SIZE
    sim_size: str = "paper"
    jobs: int = 1
    fractions: list[float] | None = None  # budgets as shares of the keep-all peak instead of a sweep
    probe_minimum: bool = True            # bisect for the lowest budget a probe planner meets (find_minimum)
    command: str = "hybridmem bench"

    @classmethod
    def from_args(cls, args: Any) -> "Settings":
        from .measure import METHODS

        quick = bool(getattr(args, "quick", False))
        zoo = _zoo()
        s = cls(quick=quick, output=Path(getattr(args, "output", None) or "bench-results"))
        if quick:
            # Chosen to finish in about a minute on 2 cores: ResNet-50 plans in a few seconds per budget
            # (coarsened to ~100 stages); the MILPs (milp, swap-opt) are left to the full sweep.
            s.models, s.measured_models, s.devices = ["resnet50"], ["resnet50", "transformer"], ["h100-80gb"]
            s.points, s.time_limit, s.steps, s.warmup = 3, 3.0, 3, 1
            s.fractions, s.probe_minimum = [0.4, 0.6, 0.8], False
            s.sim_methods = ["hybridmem-approx", "chen", "checkmate", "swap-vdnn", "capuchin", "dtr"]
            s.measured_methods = ["hybridmem-online", "hybridmem-plan", "ckpt-block", "save-on-cpu"]
        else:
            s.models, s.measured_models = list(zoo.PAPER_MODELS), list(zoo.PAPER_MODELS)
            s.devices, s.measured_methods = list(FULL_DEVICES), list(METHODS[1:])
        if getattr(args, "models", None):
            names = _split(args.models)
            unknown = [m for m in names if m not in zoo.MODELS]
            if unknown:
                raise ValueError(f"unknown model(s) {unknown}; known: {', '.join(zoo.MODELS)}")
            s.models = s.measured_models = names
        if getattr(args, "devices", None):
            s.devices = _split(args.devices)
            if s.devices == ["all"]:
                s.devices = list(DEVICES_ALL)
            from hybridmem.graph.costs import get_cost_model

            for d in s.devices:
                get_cost_model(d)  # unknown names fail here, with the list of known ones
        for name, attr, conv in (("points", "points", int), ("time_limit", "time_limit", float),
                                 ("steps", "steps", int), ("jobs", "jobs", int)):
            v = getattr(args, attr, None)
            if v is not None:
                setattr(s, name, conv(v))
        if getattr(args, "methods", None):
            ms = _split(args.methods)
            s.sim_methods = [m for m in ms if m in SIM_METHODS]
            s.measured_methods = [m for m in ms if m in METHODS and m != "unmanaged"]
            bad = [m for m in ms if m not in SIM_METHODS and m not in METHODS]
            if bad:
                raise ValueError(f"unknown method(s) {bad}; simulated: {', '.join(SIM_METHODS)}; "
                                 f"measured: {', '.join(METHODS)}")
        if getattr(args, "no_measured", False):
            s.measured_models = []
        if getattr(args, "no_simulated", False):
            s.models = []
        if s.points < 2:
            raise ValueError("--points must be at least 2 (the minimum feasible budget and the keep-all peak)")
        s.command = _command_line(quick)
        return s


def _command_line(quick: bool) -> str:
    """How this run was started, for the report (best effort: main() may be called from Python)."""
    import shlex

    if sys.argv[1:2] == ["bench"]:
        return "hybridmem " + shlex.join(sys.argv[1:])
    if Path(sys.argv[0]).name == "runner.py":
        return "python -m bench.runner " + shlex.join(sys.argv[1:])
    return "hybridmem bench" + (" --quick" if quick else "")


def _split(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def _zoo() -> Any:
    from hybridmem.factory import zoo

    return zoo()


# ---- simulated -------------------------------------------------------------------------------------
def capture_graph(name: str, size: str = "paper", device: str = "meta", batch: int | None = None,
                  warm: bool = False) -> Any:
    """Capture one training step of a zoo model into a Graph (on meta: no memory, paper size is fine).
    ``warm``: run one plain step first, so that the measured op times (``meta["measured_cost_s"]``) are
    the steady state's, not a first call's (on this CPU a first convolution takes about twice as long)."""
    from hybridmem.graph.capture import capture

    e = _zoo().build(name, size, batch=batch, device=device)
    if warm and device != "meta":
        from .measure import _args_kwargs

        args, kwargs = _args_kwargs(e.inputs)
        e.loss_fn(e.model(*args, **kwargs)).backward()
        e.model.zero_grad(set_to_none=True)
    g = capture(e.model, e.inputs, e.loss_fn, device=device)
    g.meta["model"] = name  # the zoo name (capture records the class name), as the tables use it
    g.meta.setdefault("batch", getattr(e.config, "batch", None))
    return g


def budget_points(lo: int, hi: int, n: int) -> list[int]:
    """``n`` budgets from ``lo`` to ``hi`` inclusive, evenly spaced (deduplicated)."""
    if hi <= lo:
        return [int(hi)]
    return sorted({int(lo + (hi - lo) * k / (n - 1)) for k in range(n)})


def _pool_max(xs: Sequence[float], n: int = TIMELINE_POINTS) -> list[int]:
    """Shrink a per-stage series to at most ``n`` points keeping each window's maximum (peaks survive)."""
    xs = [int(x) for x in xs]
    if len(xs) <= n:
        return xs
    w = -(-len(xs) // n)
    return [max(xs[i:i + w]) for i in range(0, len(xs), w)]


def _plan_with_time(graph: Any, budget: int, device: str, solver: str, time_limit: float) -> tuple[Any, float]:
    from hybridmem.solvers import plan as solve

    t0 = time.perf_counter()
    p = solve(graph, budget, device=device, solver=solver, time_limit=time_limit)
    return p, time.perf_counter() - t0


# Lower bounds on step time a plan reports: the valid swap/recompute bound of the full graph
# (solvers.bound), and the LP relaxation's (a bound within the STR model). A MILP's best bound on a
# coarsened problem need not bound the full graph.
_BOUND_KEYS = ("lower_bound_s", "lp_bound_s")
_BOUND_SOURCE = {"lower_bound_s": "swap/recompute bound", "lp_bound_s": "LP relaxation"}


def simulate_model(graph: Any, device: str, methods: Sequence[str], points: int, time_limit: float,
                   bar: Progress | None = None, *, fractions: Sequence[float] | None = None,
                   probe_minimum: bool = True) -> dict[str, Any]:
    """Plan ``graph`` at ``points`` budgets with every method and judge each plan in the simulator.

    Budgets run evenly from the minimum feasible to the keep-all peak or the device's memory, whichever
    is smaller. The minimum is the simulator's lower bound, or with ``probe_minimum`` the lowest budget
    where a planner that reaches low (:data:`MIN_PROBES`) finds a plan (:func:`find_minimum`), so the
    lowest point of the sweep has a plan. ``fractions`` of the keep-all peak replace the sweep (not
    below the lower bound).
    """
    from hybridmem.graph.costs import apply_costs, get_cost_model
    from hybridmem.graph.simulate import min_feasible_budget, simulate

    cm = get_cost_model(device)
    g = apply_costs(graph, cm)
    base = simulate(g, None, device=device)
    peak = int(base.peak_bytes)
    lo = int(min_feasible_budget(g))
    run: dict[str, Any] = {
        "model": g.meta.get("model"), "size": g.meta.get("size", "paper"), "batch": g.meta.get("batch"),
        "device": device, "stages": g.num_stages, "tensors": len(g.tensors), "capture_s": g.meta.get("capture_s"),
        "keep_all_peak_bytes": peak, "keep_all_time_s": base.time_s, "min_feasible_bytes": lo,
        "device_memory_bytes": getattr(cm, "memory_bytes", None), "results": [], "bounds": [],
    }
    if fractions:
        budgets: Sequence[int] = sorted({max(lo, int(f * peak)) for f in fractions})
    else:
        if probe_minimum:
            # The simulator's bound is only a lower bound: below the budget where the planners that
            # reach lowest find a plan, every cell of the table would be `inf.`. Find that budget.
            search = find_minimum(g, device, lo, peak, solvers=MIN_PROBES, time_limit=time_limit, bar=bar)
            run["minimum_search"] = search
            lo = run["solver_minimum_bytes"] = search["minimum_bytes"]
        hi = peak
        mem = getattr(cm, "memory_bytes", None)
        if mem and mem < peak:
            # A budget above the device's memory cannot be had on that device: the sweep stops there.
            hi = int(mem)
            run["budget_capped_at_device_memory"] = True
            if lo > hi:
                # No probe planner fits the step in the device's memory: one budget, the memory, shows it.
                run["no_plan_within_device_memory"] = True
        budgets = budget_points(lo, hi, points)
    run["budgets"] = list(budgets)
    for b in budgets:
        row = []
        for m in methods:
            if bar is not None:
                bar.note(f"{run['model']} {device} {m} {b / 2**30:.1f}GiB")
            row.append(_one_plan(g, device, m, b, base.time_s, time_limit))
            if bar is not None:
                bar.update()
        bound_s, source = _best_bound(row, base.time_s)
        for r in row:
            if r.get("status") == "ok" and r.get("time_s"):
                r["gap_to_bound"] = r["time_s"] / bound_s - 1 if bound_s else None
        run["bounds"].append({"budget_bytes": b, "lower_bound_s": bound_s, "source": source,
                              "lower_bound_overhead": bound_s / base.time_s - 1 if base.time_s else None})
        run["results"].extend(row)
    run["timeline"] = _timeline(g, device, run, budgets, base)
    return run


MIN_PROBES: tuple[str, ...] = ("dtr", "capuchin", "chen", "approx")  # the planners a minimum search asks, in order
MIN_TOLERANCE = 0.01                                  # bisection stops within this share of the peak


def find_minimum(g: Any, device: str, lower: int, peak: int, *, solvers: Sequence[str] = MIN_PROBES,
                 tolerance: float = MIN_TOLERANCE, time_limit: float = 10.0,
                 bar: Progress | None = None) -> dict[str, Any]:
    """The lowest budget (to ``tolerance`` x ``peak``) at which one of ``solvers`` finds a valid plan.

    Bisection between ``lower`` (the simulator's bound: nothing fits below it) and ``peak`` (keep-all
    fits). At each budget the solvers are asked in order until one has a plan; a solver that found
    none at some budget is not asked again below it (plans only get harder as the budget shrinks),
    so a budget below every solver's failure costs nothing. The DTR replay reaches lowest of the
    baselines and is deterministic; Capuchin's construction and Chen's sqrt(n) checkpointing fail fast
    where they cannot fit (Chen's fixed segments sometimes fit where the others do not); hybridmem's
    ``approx`` (with the sweep's ``time_limit``) often reaches lower still, and is asked last.
    Returns ``{minimum_bytes, lower_bound_bytes, found_by, solvers, tolerance_bytes, search_s,
    probes: [{budget_bytes, solver, status, solve_s}]}``; ``found_by`` is None when no solver found a
    plan below the peak (``minimum_bytes`` is then the peak, where keep-all fits).
    """
    from hybridmem.errors import BudgetInfeasibleError

    t0 = time.perf_counter()
    tol = max(int(tolerance * peak), 1)
    lo, hi = int(lower) - 1, int(peak)     # invariant: nothing found at lo (or below), a plan at hi
    found_by: str | None = None
    failed_at = {s: lo for s in solvers}    # the largest budget where each solver found no plan
    probes: list[dict[str, Any]] = []
    while hi - lo > tol:
        mid = (lo + hi + 1) // 2
        ok = None
        for s in solvers:
            if mid <= failed_at[s]:
                continue
            if bar is not None:
                bar.note(f"{g.meta.get('model')} {device} minimum? {s} {mid / 2**30:.2f}GiB")
            t1 = time.perf_counter()
            try:
                _plan_with_time(g, mid, device, s, time_limit)
                status = "ok"
            except BudgetInfeasibleError:
                status = "infeasible"
            except Exception as e:  # a solver error counts as no plan here; the sweep reports it
                status = f"error: {type(e).__name__}"
            probes.append({"budget_bytes": mid, "solver": s, "status": status,
                           "solve_s": round(time.perf_counter() - t1, 3)})
            if status == "ok":
                ok = s
                break
            failed_at[s] = max(failed_at[s], mid)
        if ok is not None:
            hi, found_by = mid, ok
        else:
            lo = mid
    return {"minimum_bytes": hi, "lower_bound_bytes": int(lower), "found_by": found_by, "solvers": list(solvers),
            "tolerance_bytes": tol, "search_s": round(time.perf_counter() - t0, 3), "probes": probes}


def _one_plan(g: Any, device: str, method: str, budget: int, keep_all_s: float, time_limit: float) -> dict[str, Any]:
    from hybridmem.errors import BudgetInfeasibleError, InfeasiblePlanError, UnknownNameError
    from hybridmem.graph.simulate import simulate

    solver = SOLVER_OF.get(method, method)
    r: dict[str, Any] = {"method": method, "solver": solver, "budget_bytes": budget}
    t0 = time.perf_counter()
    try:
        p, r["solve_s"] = _plan_with_time(g, budget, device, solver, time_limit)
    except BudgetInfeasibleError as e:
        r.update(status="infeasible", solve_s=time.perf_counter() - t0, reason=str(e),
                 minimum_bytes=e.minimum_bytes)
        return r
    except UnknownNameError as e:
        r.update(status="unavailable", reason=str(e))
        return r
    except Exception as e:  # one solver failing must not stop the sweep; the table shows it
        r.update(status="error", solve_s=time.perf_counter() - t0, reason=f"{type(e).__name__}: {e}")
        return r
    # The solver's own facts (status, bounds, coarsening, fallback): scalars only, they are small.
    info = {k: v for k, v in (p.info or {}).items() if isinstance(v, (int, float, str, bool)) or v is None}
    r["info"] = info
    if info.get("fallback"):
        r["note"] = f"fell back: {info['fallback']}"
    try:
        res = simulate(g, p, device=device, budget=budget)
    except InfeasiblePlanError as e:
        r.update(status="invalid", reason=f"simulator rejected the plan: {e}")
        return r
    r.update(status="ok", time_s=res.time_s, overhead=res.time_s / keep_all_s - 1 if keep_all_s else None,
             stall_s=res.stall_s, recompute_s=res.recompute_s, peak_bytes=int(res.peak_bytes),
             host_peak_bytes=int(res.host_peak_bytes), bytes_h2d=int(getattr(res, "bytes_h2d", 0)),
             bytes_d2h=int(getattr(res, "bytes_d2h", 0)))
    r["_plan"] = p  # dropped before writing; the timeline replays the chosen plan
    return r


def _best_bound(row: list[dict[str, Any]], keep_all_s: float) -> tuple[float, str]:
    """The best lower bound on step time known at one budget: the largest solver bound, else compute time."""
    best, source = keep_all_s, "compute time"
    for r in row:
        for k in _BOUND_KEYS:
            v = (r.get("info") or {}).get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > best * (1 + 1e-9):
                coarse = (r.get("info") or {}).get("coarse_stages")
                best = float(v)
                source = _BOUND_SOURCE[k] + (f" (on {coarse} coarsened stages)" if coarse and k == "lp_bound_s" else "")
    return best, source


def _timeline(g: Any, device: str, run: dict[str, Any], budgets: Sequence[int], base: Any) -> dict[str, Any] | None:
    """Memory over the stages of one step for hybridmem's plan at the tightest budget it met."""
    from hybridmem.graph.simulate import simulate

    for b in budgets:
        for m in ("hybridmem-milp", "hybridmem-approx"):
            r = next((x for x in run["results"] if x["method"] == m and x["budget_bytes"] == b and "_plan" in x), None)
            if r is None:
                continue
            res = simulate(g, r["_plan"], device=device, budget=b)
            return {"method": m, "budget_bytes": b, "num_forward": g.num_forward, "stages": g.num_stages,
                    "memory": _pool_max(res.memory), "host_memory": _pool_max(res.host_memory),
                    "keep_all_memory": _pool_max(base.memory), "pooled": g.num_stages > TIMELINE_POINTS}
    return None


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    for r in run.get("results", []):
        r.pop("_plan", None)
    return run


def _sim_unit(name: str, device: str, size: str, methods: Sequence[str], points: int, time_limit: float,
              fractions: Sequence[float] | None = None, probe_minimum: bool = True,
              show: bool = True) -> dict[str, Any]:
    """Capture one model and sweep it on one device (one process's share of the work)."""
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    g = capture_graph(name, size, "meta")
    g.meta["capture_s"] = time.perf_counter() - t0
    g.meta["size"] = size
    n = len(fractions) if fractions else points
    with Progress(n * len(methods), f"plans {name} {device}", enabled=None if show else False) as bar:
        return _strip(simulate_model(g, device, methods, points, time_limit, bar, fractions=fractions,
                                     probe_minimum=probe_minimum))


def simulated_sweep(s: Settings, missing: list[str],
                    checkpoint: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Every model on every device, in ``s.jobs`` processes; ``checkpoint(runs)`` after each one."""
    if not s.models:
        return []
    try:
        import hybridmem.graph.capture  # noqa: F401
        import hybridmem.graph.simulate  # noqa: F401
        from hybridmem.solvers import SOLVERS
    except ImportError as e:
        missing.append(f"simulated part: a component is missing ({e})")
        return []
    known = set(SOLVERS)
    methods = []
    for m in s.sim_methods:
        if SOLVER_OF.get(m, m) in known:
            methods.append(m)
        else:
            missing.append(f"simulated method {m}: solver {SOLVER_OF.get(m, m)!r} is not registered "
                           f"(known: {', '.join(sorted(known))})")
    if not methods:
        return []
    # Units of work: one model on one device. Cheap ones first, so a partial results file (written
    # after each unit) has as many models as possible early; the tables keep the requested order.
    units = sorted(((n, d) for n in s.models for d in s.devices), key=lambda u: (_COST_RANK.get(u[0], 9), u))
    done: dict[tuple[str, str], dict[str, Any]] = {}

    def ordered() -> list[dict[str, Any]]:
        return [done[(n, d)] for n in s.models for d in s.devices if (n, d) in done]

    def finished(unit: tuple[str, str], result: Any) -> None:
        try:
            done[unit] = result if isinstance(result, dict) else result()
        except Exception as e:  # one model failing must not lose the others
            missing.append(f"simulated {unit[0]} on {unit[1]}: {type(e).__name__}: {e}")
            traceback.print_exc(file=sys.stderr)
        if checkpoint is not None:
            checkpoint(ordered())

    args = (s.sim_size, methods, s.points, s.time_limit, s.fractions, s.probe_minimum)
    if s.jobs <= 1 or len(units) == 1:
        for u in units:
            finished(u, lambda u=u: _sim_unit(u[0], u[1], *args))
        return ordered()
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawn: a fresh interpreter per worker, no torch state forked mid-flight
    with ProcessPoolExecutor(s.jobs, mp_context=mp.get_context("spawn")) as ex, \
            Progress(len(units), "model x device (parallel)") as bar:
        futs = {ex.submit(_sim_unit, u[0], u[1], *args, False): u for u in units}
        for f in as_completed(futs):
            bar.note(" on ".join(futs[f]))
            finished(futs[f], f.result)
            bar.update()
    return ordered()


# Rough planning cost per model (LP size after coarsening, uncoarsened VGG16's LP is the slowest).
_COST_RANK = {"resnet50": 0, "mobilenet": 1, "unet": 2, "resnet101": 3, "transformer": 4, "resnet152": 5,
              "vgg16": 6, "gpt": 7}


# ---- measured --------------------------------------------------------------------------------------
def measured_sweep(s: Settings, missing: list[str]) -> list[dict[str, Any]]:
    """Each measured model: its budget, then every method side by side (see :mod:`bench.measure`)."""
    import torch

    from .measure import BUDGET_SAVED_SHARE, ModelRun, run_methods

    if not s.measured_models:
        return []
    torch.set_num_threads(1)  # one thread: less noise on shared cores, and the ratio is what we report
    out = []
    per_model = (s.steps + s.warmup) * (1 + len(s.measured_methods))
    with Progress(per_model * len(s.measured_models), "measured steps") as bar:
        for name in s.measured_models:
            bar.note(name)
            e = _zoo().build(name, s.measured_size)
            run = ModelRun(name, s.measured_size, getattr(e.config, "batch", None), s.steps, s.steps + s.warmup,
                           torch.get_num_threads(), "")
            graph = None
            try:
                graph = capture_graph(name, s.measured_size, "cpu", warm=True)
                run.saved_bytes = int(graph.saved_bytes())
            except Exception as ex:
                run.notes.append(f"capture unavailable ({type(ex).__name__}: {ex}); saved bytes counted by "
                                 "saved-tensor hooks instead")
                run.saved_bytes = saved_activation_bytes(e.model, e.inputs, e.loss_fn)
            run.monitor_peak_bytes = monitor_peak(e.model, e.inputs, e.loss_fn, run)
            if run.monitor_peak_bytes is not None and run.saved_bytes:
                run.budget_bytes = int(run.monitor_peak_bytes - BUDGET_SAVED_SHARE * run.saved_bytes)
            plan: Any = "no captured graph or budget to plan for"
            if "hybridmem-plan" in s.measured_methods and graph is not None and run.budget_bytes:
                plan = _cpu_plan(graph, run, s.time_limit)
            results, run.peak_source = run_methods(
                e.model, e.inputs, e.loss_fn, s.measured_methods, budget=run.budget_bytes, plan=plan,
                steps=s.steps, warmup=s.warmup, progress=bar,
                allocator_peak=not s.quick)
            run.results = results
            run.unmanaged_peak_bytes = next((r.peak_bytes for r in results if r.method == "unmanaged"), None)
            for r in results:
                line = f"measured {r.method}: {r.status}: {r.reason}"
                if r.status != "ok" and line not in missing:  # once per method, not per model
                    missing.append(line)
            out.append(run.to_dict())
    return out


def _cpu_plan(graph: Any, run: Any, time_limit: float) -> Any:
    """An offline plan for this CPU's own graph at the measured budget, its ops priced by the times measured
    in the capture (copies by the ``cpu`` model), or why not."""
    try:
        from hybridmem.graph.costs import MeasuredCostModel
        from hybridmem.solvers import plan as solve

        p = solve(graph, run.budget_bytes, device=MeasuredCostModel.from_graph(graph), solver="approx",
                  time_limit=time_limit)
        run.plan_solver = p.solver
        if "runtime" not in (p.info or {}):
            # What the runtime needs to map plan stages onto the ops it sees (if the planner left it out).
            from hybridmem.graph.signature import annotate

            annotate(p, graph)
        return p
    except Exception as e:
        why = f"no CPU plan: {type(e).__name__}: {e}"
        run.notes.append(why)
        return why  # the method is then reported as skipped, with this reason


def monitor_peak(model: Any, inputs: Any, loss_fn: Any, run: Any) -> int | None:
    """The monitor-only peak of one step on a throw-away copy: hybridmem's own count, else the meter's."""
    import copy

    import torch

    from .measure import _args_kwargs

    m = copy.deepcopy(model)
    args, kwargs = _args_kwargs(inputs)
    torch.manual_seed(0)
    try:
        import hybridmem

        with hybridmem.session(budget=None, monitor="ops"):  # in the cap's units: budgets derive from it
            hybridmem.reset_stats()
            loss_fn(m(*args, **kwargs)).backward()
            return int(hybridmem.stats().peak_bytes)
    except Exception as e:
        run.notes.append(f"monitor-only peak from hybridmem.runtime.meter (runtime unavailable: {type(e).__name__})")
    try:
        from hybridmem.runtime.meter import Meter

        with Meter("cpu") as meter:
            meter.track(m, inputs)
            loss_fn(m(*args, **kwargs)).backward()
        return int(meter.peak_bytes)
    except Exception as e:
        run.notes.append(f"no monitor-only peak: {type(e).__name__}: {e}")
        return None


def saved_activation_bytes(model: Any, inputs: Any, loss_fn: Any) -> int:
    """Bytes autograd saves for backward in one step, one count per storage, weights and inputs excluded."""
    import copy

    import torch

    from .measure import _args_kwargs

    m = copy.deepcopy(model)
    fixed = {id(t.untyped_storage()) for t in (*m.parameters(), *m.buffers())}
    args, kwargs = _args_kwargs(inputs)
    fixed |= {id(t.untyped_storage()) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}
    keep: list[Any] = []  # hold the storages so their ids stay unique while counting

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if id(st) not in fixed and id(st) not in seen:
            seen[id(st)] = st.nbytes()
            keep.append(st)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(m(*args, **kwargs))
    loss.backward()
    return sum(seen.values())


# ---- main ------------------------------------------------------------------------------------------
def _env() -> dict[str, Any]:
    import torch

    import hybridmem

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"hybridmem": hybridmem.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "step_clock": os.environ.get("HYBRIDMEM_BENCH_CLOCK", "cpu").strip().lower(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def run(s: Settings) -> dict[str, Any]:
    """Do the work of one bench run and return the results dict (not yet written)."""
    t0 = time.perf_counter()
    missing: list[str] = []
    results: dict[str, Any] = {"schema": SCHEMA, "created": _dt.datetime.now().isoformat(timespec="seconds"),
                               "command": s.command, "quick": s.quick, "env": _env(), "missing": missing}
    results["measured"] = measured_sweep(s, missing)
    t1 = time.perf_counter()

    def checkpoint(runs: list[dict[str, Any]]) -> None:
        # The simulated sweep is the long part: keep what is done so far readable (hybridmem report).
        s.output.mkdir(parents=True, exist_ok=True)
        part = {**results, "simulated": runs, "wall_s": time.perf_counter() - t0, "partial": True}
        (s.output / "results.partial.json").write_text(json.dumps(part, indent=1, default=_json_default))

    if s.models and not s.quick:
        checkpoint([])
    results["simulated"] = simulated_sweep(s, missing, None if s.quick else checkpoint)
    results["wall_s"] = time.perf_counter() - t0
    results["measured_s"], results["simulated_s"] = t1 - t0, results["wall_s"] - (t1 - t0)
    return results


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The demo's bottom line per measured model: memory saved, time paid, and whether results match."""
    out = []
    for run in results.get("measured", []):
        by = {r["method"]: r for r in run.get("results", [])}
        un = by.get("unmanaged", {})
        for m in ("hybridmem-online", "hybridmem-plan"):
            r = by.get(m)
            if not r or r.get("status") != "ok" or not un.get("peak_bytes"):
                continue
            saved = 1 - r["peak_bytes"] / un["peak_bytes"]
            same = r.get("losses_identical") and r.get("grads_identical")
            out.append(f"{run['model']}: {m} peak {r['peak_bytes'] / 2**20:.1f} MiB vs unmanaged "
                       f"{un['peak_bytes'] / 2**20:.1f} MiB ({100 * saved:.0f} % less; budget "
                       f"{(run.get('budget_bytes') or 0) / 2**20:.1f} MiB, within: "
                       f"{'yes' if r.get('budget_ok') else 'NO'}), step time {100 * (r.get('overhead') or 0):+.0f} %, "
                       f"losses and gradients bit-identical: {'yes' if same else 'NO'}")
    return out


def main(args: Any) -> int:
    """Entry of ``hybridmem bench``: run, write results.json + results.md + PNGs, print the tables."""
    try:
        s = Settings.from_args(args)
        ratios = _compiled_ratios(getattr(args, "compiled", None))
    except ValueError as e:
        print(f"hybridmem bench: error: {e}", file=sys.stderr)
        return 2
    s.output.mkdir(parents=True, exist_ok=True)
    what = (f"measured on this CPU: {', '.join(s.measured_models) or 'none'} ({s.measured_size}); "
            f"simulated: {', '.join(s.models) or 'none'} ({s.sim_size}) on {', '.join(s.devices)}")
    print(f"hybridmem bench{' --quick' if s.quick else ''}: {what}", flush=True)
    results = run(s)
    path = s.output / "results.json"
    path.write_text(json.dumps(results, indent=1, default=_json_default))
    (s.output / "results.partial.json").unlink(missing_ok=True)
    md, made = write_report(results, s.output)
    print()
    print(render_markdown(results, images={}))
    for line in summary_lines(results):
        print(line)
    print(f"\nwrote {path}, {md}" + (f" and {len(made)} plots" if made else "") +
          f" in {results['wall_s']:.0f} s (measured {results['measured_s']:.0f} s, simulated {results['simulated_s']:.0f} s)")
    if ratios:
        _compiled(s, ratios)
    return 0


def _compiled_ratios(text: str | None) -> tuple[float, ...]:
    """``--compiled RATIOS`` as numbers (empty: not asked for); a bad value is a ValueError naming it."""
    if not text:
        return ()
    try:
        ratios = tuple(float(r) for r in text.split(","))
    except ValueError:
        ratios = ()
    if not ratios or not all(0 <= r <= 1 for r in ratios):
        raise ValueError(f"--compiled {text!r}: expected comma-separated ratios in [0, 1], e.g. 0.5,0.2")
    return ratios


def _compiled(s: Any, ratios: tuple[float, ...]) -> None:
    """``--compiled``: bench.compiled on the measured models; compiled.json, compiled.md, compiled.png."""
    from bench import compiled

    results = []
    for name in s.measured_models:
        results += compiled.compare(name, s.measured_size, ratios, rounds=max(s.steps, 3))
    (s.output / "compiled.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    md = compiled.table(results)
    (s.output / "compiled.md").write_text(md + "\n")
    compiled.plot(results, str(s.output / "compiled.png"))
    print(md)
    print(f"wrote {s.output / 'compiled.json'}, compiled.md and compiled.png")


def _json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.floating):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return str(o)


def add_options(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options, shared by ``python -m bench.runner`` and ``hybridmem bench``."""
    ap.add_argument("--quick", action="store_true", help="the short demo (about a minute)")
    ap.add_argument("--models", help="comma-separated zoo models (default: the paper's seven)")
    ap.add_argument("--devices", help="comma-separated device models, or 'all' (default: h100-80gb,v100-16gb)")
    ap.add_argument("--methods", help="comma-separated methods to run (simulated and/or measured names)")
    ap.add_argument("--points", type=int, help="budgets per model and device, from the lowest one where a planner "
                                              "finds a plan to the keep-all peak (default 6)")
    ap.add_argument("--time-limit", type=float, help="seconds per plan for the MILP solvers and approx (default 10; --quick 3)")
    ap.add_argument("--steps", type=int, help="timed training steps per measured method (default 5)")
    ap.add_argument("--jobs", type=int, help="processes for the simulated sweep (default 1)")
    ap.add_argument("--no-measured", action="store_true", help="skip the measured CPU part")
    ap.add_argument("--no-simulated", action="store_true", help="skip the simulated part")
    ap.add_argument("--compiled", metavar="RATIOS",
                    help="also compare under torch.compile (Inductor): unmanaged, PyTorch's activation_memory_budget "
                         "at these comma-separated ratios and hybridmem's compile backend at the peaks they reach, "
                         "on the measured models (bench.compiled; several minutes of compiling per model on a CPU)")
    ap.add_argument("-o", "--output", type=Path, default=Path("bench-results"),
                    help="folder for results.json, results.md and the plots (default: bench-results)")
    return ap


def parser() -> argparse.ArgumentParser:
    """Options of ``python -m bench.runner`` (the same as ``hybridmem bench``'s)."""
    return add_options(argparse.ArgumentParser(prog="python -m bench.runner", description=__doc__.splitlines()[0],
                                               epilog=methods_help(),
                                               formatter_class=argparse.RawDescriptionHelpFormatter))

if __name__ == "__main__":
    sys.exit(main(parser().parse_args()))

"""``hybridmem`` command line: capture | plan | simulate | run | bench | report.
One concern, hence one module: the commands' arguments, their checks and their output."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from . import __version__, runtime, solvers  # solvers.plan looked up per call: tests patch it
from ._autoload import run_script
from .errors import HybridMemError, UnknownNameError
from .factory import bench_module, cwd_importable, load_model, make_optimizer, parse_optimizer
from .graph.capture import capture
from .graph.costs import apply_costs, get_cost_model, planning_model
from .graph.ir import Graph
from .planbooks import cli_plan, dim_names_of, parse_dims, zoo_factory
from .graph.plan import Plan
from .graph.simulate import simulate
from .graph.units import fmt_bytes, plan_budget_bytes
from .runfile import graph_file_of, is_run_file, main as run_report
from .config import checks as config_checks

_IMPORTED = time.perf_counter()
DEFAULT_DEVICE = "h100-80gb"
COMMAND_S = 10.0         # `plan` with one budget, approx or greedy, no --time-limit: the whole command's seconds
FINISH_S = 0.6           # ... of which kept for what follows the planner (the bound, the plan's annotation, output)
MIN_PLAN_S = 3.0         # the planner's seconds at least, whatever the capture took
DEVICE_HELP = (f"device cost model: v100-16gb, a100-80gb, h100-80gb, h200, or cpu (this machine) "
               f"(default: {DEFAULT_DEVICE})")


def solver_descriptions() -> dict[str, str]:
    """Each solver's one-line description (:data:`hybridmem.solvers.DESCRIPTIONS`, filled by the registry)."""
    return dict(solvers.DESCRIPTIONS)


def solver_listing() -> str:
    """The solvers ``hybridmem plan --solver`` accepts, one per line with what it is."""
    descriptions = solver_descriptions()
    width = max(len(n) for n in descriptions)
    return "\n".join(f"{n:<{width}}  {d}" for n, d in descriptions.items())


class _ListSolvers(argparse.Action):
    """``--list-solvers``: print the solvers and exit, like ``--version`` (no --model/--budget needed)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        print(solver_listing())
        parser.exit()


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of super-stages (e.g. 100)") from None
    if v < 2:
        raise argparse.ArgumentTypeError(f"{v}: give at least 2 super-stages (STR uses 80-120)")
    return v


def _sweep_points(text: str) -> int:
    """``--sweep N``: an int of at least 2 (the least budget and the keep-all peak)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"invalid point count {text!r}: expected an int of at least 2")
    return n


def _add_model_args(p: argparse.ArgumentParser, *, graph: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="zoo model name (e.g. resnet50) or MODULE:FACTORY returning (model, inputs, "
                                     "loss_fn[, optimizer])")
    if graph:
        src.add_argument("--graph", type=Path, help="a captured graph file (.yaml or .json)")
    p.add_argument("--size", default="small", help="zoo size: tiny, small, bench, paper (default: small)")
    p.add_argument("--batch", type=int, help="override the zoo size's batch")
    p.add_argument("--capture-device", default=None,
                   help="where to run the capture step: meta (shapes only: no memory, no real step) or cpu "
                        "(a real step) (default: cpu for --device cpu, else meta)")
    p.add_argument("--granularity", default="op", help="stage granularity: op or module (default: op)")
    p.add_argument("--optimizer", metavar="NAME[:K=V,...]",
                   help="the training step's optimizer, whose state the graph holds for the whole step: none, sgd, "
                        "adam, adamw, rmsprop, adagrad, with options (e.g. sgd:momentum=0.9, adam:amsgrad=true); "
                        "default: the optimizer FACTORY returns, else none")
    p.add_argument("--grads", choices=("none", "kept"), default=None,
                   help="gradients the step starts with: none (default: the loop calls zero_grad(set_to_none=True)) "
                        "or kept (a loop without zero_grad, gradient accumulation: held for the whole step)")
    p.add_argument("--optimizer-step", action="store_true",
                   help="count the optimizer's step too (its temporaries after backward; needs an optimizer). "
                        "The runtime follows plans of forward and backward only: plan without it")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybridmem", description=(
        "Train PyTorch models under a memory budget: capture a step, plan evictions (STR), simulate, run."))
    ap.add_argument("--version", action="version", version=f"hybridmem {_version()}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("capture", help="record one training step into a graph file")
    _add_model_args(p, graph=False)
    p.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP + "; sets the graph's op times")
    p.add_argument("-o", "--output", type=Path, help="write the graph here (.yaml or .json)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")

    p = sub.add_parser("plan", help="solve an eviction plan for a budget")
    _add_model_args(p)
    p.add_argument("--budget", help="bytes, e.g. 6GiB, a percentage of the step's keep-all peak (evict nothing), "
                                    "e.g. 60%%, or min: the least budget the solver finds a plan for (bisection), "
                                    "with that plan")
    p.add_argument("--sweep", type=_sweep_points, nargs="?", const=8, metavar="N",
                   help="instead of --budget: plans at N budgets (default 8) from the least budget to the keep-all "
                        "peak, printed as predicted step time against budget (--plot PNG draws it)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="with --sweep: draw the curve here (needs matplotlib)")
    p.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)
    p.add_argument("--solver", default="approx", help="approx (default), milp, greedy, or a baseline: keep-all, chen, "
                                                      "checkmate, swap-vdnn, swap-opt, capuchin, dtr (--list-solvers)")
    p.add_argument("--list-solvers", action=_ListSolvers, help="list the solvers with what each does, and exit")
    p.add_argument("--coarsen", action=argparse.BooleanOptionalAction, default=None,
                   help="plan on weighted super-stages (STR coarsening) and write the plan on the full graph; "
                        "default: automatic above 150 stages")
    p.add_argument("--target", type=_positive_int, metavar="N",
                   help="super-stages to coarsen to (default 100; implies --coarsen)")
    p.add_argument("--solver-backend", choices=("cbc", "highs"), default=None,
                   help="MILP backend: cbc (default, bundled) or highs (pip install 'hybridmem[highs]')")
    p.add_argument("--trace-sources", action="store_true",
                   help="a recompute may rebuild the forward temporaries its producer read (a layer norm's output), "
                        "back to what the plan keeps: transformers get recompute-only plans far below the peak")
    p.add_argument("--time-limit", type=float, default=None,
                   help="solver time limit in seconds (default for approx and greedy at one budget: what is left of "
                        f"{COMMAND_S:g} s for the whole command, capture included, at least {MIN_PLAN_S:g} s; "
                        "otherwise the solver's own)")
    p.add_argument("--verbose", action="store_true", help="show solver output")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-o", "--output", type=Path, help="write the plan here (.yaml); with --shapes, the plan book folder")
    p.add_argument("--shapes", nargs="+", metavar="SHAPE",
                   help="plan one bucket per input shape (e.g. 8x128 8x256, or batch=8,seq=128) into the plan "
                        "book -o DIR; the runtime picks each step's plan by its input shapes (--plan DIR)")

    p = sub.add_parser("simulate", help="replay a plan on a graph under a device cost model")
    _add_model_args(p)
    p.add_argument("--plan", type=Path, help="plan file (default: keep everything)")
    p.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)
    p.add_argument("--budget", default=None, help="check the plan against this budget: bytes, or a percentage of the "
                                                  "keep-all peak (default: the plan's budget)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")

    p = sub.add_parser("run", help="run a training script with hybridmem enabled (same as HYBRIDMEM_* variables)")
    p.add_argument("--budget", help="memory budget: what the allocator may hold, e.g. 8GiB (on CUDA also 60%% of "
                                    "device memory); without it: measure only")
    p.add_argument("--policies", help="comma-separated policies (default: swap,recompute,compress)")
    p.add_argument("--plan", help="plan file to follow")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--monitor", choices=("auto", "allocator", "ops"),
                   help="without a budget: how to measure (default auto: the allocator's counters where "
                        "possible, nothing per op; ops: every op, in the units a budget caps)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile calls that name no backend plan each compiled region under the budget "
                        "(HYBRIDMEM_COMPILE=1) instead of managing eager ops")
    p.add_argument("--report", help="save the run's report here at exit (a .json run file for `hybridmem report`)")
    p.add_argument("--quiet", action="store_true", help="no summary at exit")
    p.add_argument("script", help="the Python script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    runner = bench_module("runner")
    p = sub.add_parser("bench", help="benchmark hybridmem against the alternatives",
                       description="Benchmark hybridmem against the alternatives.", epilog=runner.methods_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    runner.add_options(p)

    p = sub.add_parser("report", help="a run's decision report, or tables and plots from a bench results file")
    p.add_argument("results", type=Path, help="a run file (`hybridmem run --report FILE`) or the results.json "
                                              "written by `hybridmem bench`")
    p.add_argument("--json", action="store_true", help="run files: print the report as JSON")
    p.add_argument("-o", "--output", type=Path, help="output folder (default: beside the results)")
    return ap


def _version() -> str:
    return __version__


# ---- commands ----------------------------------------------------------------------------------------
def _graph_from_args(args: argparse.Namespace) -> Any:
    opt_text = getattr(args, "optimizer", None)
    if getattr(args, "graph", None):
        given = [o for o, v in (("--optimizer", opt_text), ("--grads", getattr(args, "grads", None)),
                                ("--optimizer-step", getattr(args, "optimizer_step", False) or None)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --model: a graph "
                             "file already holds what it counts, its optimizer's state too (capture it with "
                             f"{'that option' if len(given) == 1 else 'those options'})")
        return Graph.load(args.graph)

    if opt_text is not None:
        parse_optimizer(opt_text)  # a bad spec fails before the model is built
    device = capture_device(args)
    spec = load_model(args.model, size=args.size, batch=args.batch, device=device)
    optimizer = spec.optimizer if opt_text is None else make_optimizer(opt_text, spec.model)
    step = bool(getattr(args, "optimizer_step", False))
    if step and optimizer is None:
        raise ValueError("--optimizer-step counts the optimizer's step, but there is none: give --optimizer "
                         "(e.g. sgd:momentum=0.9) or return one from the factory")
    # on the CPU, two plain steps first: the op times measured are then a steady step's (a first convolution
    # here takes about twice as long), and the second is timed for what a step spends outside its ops
    g = capture(spec.model, spec.inputs, spec.loss_fn, device=device, granularity=args.granularity,
                optimizer=optimizer, grads=getattr(args, "grads", None) or "none", optimizer_step=step,
                warmup=CPU_WARMUP if device == "cpu" else 0)
    g.meta.setdefault("model", spec.name)
    return g


CPU_WARMUP = 2  # plain steps before a CPU capture (capture(warmup=)): the first's first-call effects, the second timed


def capture_device(args: argparse.Namespace) -> str:
    """Where the capture step runs: ``--capture-device``, else ``cpu`` when planning for this CPU and
    ``meta`` for a device model (a meta step allocates nothing and runs no kernel: shapes are all a device
    model needs, and a real CPU step of a big model costs seconds and gigabytes)."""
    device = args.capture_device or ("cpu" if _canonical_device(args.device) == "cpu" else "meta")
    if device not in ("cpu", "meta"):
        raise ValueError(f"--capture-device {device!r}: accepted: cpu, meta")
    return device


def _canonical_device(name: str) -> str:
    return get_cost_model(name).name


def cmd_capture(args: argparse.Namespace) -> int:
    _canonical_device(args.device)  # an unknown name fails before the capture, with the known ones
    g = apply_costs(_graph_from_args(args), args.device)
    if args.output:
        g.save(args.output)
    if args.json:
        print(json.dumps({"capture_device": g.meta["device"], "cost_model": g.meta["cost_model"],
                          "compute_s": g.compute_time(),
                          "stages": g.num_stages, "forward_stages": g.num_forward, "tensors": len(g.tensors),
                          "peak_bytes": g.peak_bytes(), "saved_bytes": g.saved_bytes(),
                          "fixed_bytes": g.fixed_bytes(), "structure_hash": g.structure_hash(),
                          "optimizer_state_bytes": (g.meta.get("optimizer") or {}).get("state_bytes", 0),
                          "output": str(args.output) if args.output else None}))
    else:
        print(f"captured {g.meta.get('model', '')} on {g.meta['device']}: {g.summary()} "
              f"(op times: the {g.meta['cost_model']} cost model, --device)")
        if args.output:
            print(f"wrote {args.output}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.solver not in solver_descriptions():  # before the capture, which can take a while
        raise ValueError(f"{UnknownNameError('solver', args.solver, tuple(solver_descriptions()))} "
                         "(`hybridmem plan --list-solvers` says what each does)")
    options = _plan_options(args)
    if (args.budget is None) == (args.sweep is None):
        raise ValueError("give --budget (bytes, a percentage such as 60%, or min) or --sweep [N], one of them")
    if args.plot and args.sweep is None:
        raise ValueError("--plot draws the curve of --sweep: add --sweep")
    if args.sweep is not None and (args.output or args.shapes):
        raise ValueError("--sweep makes one plan per budget: -o/--shapes write one plan (book); plan one budget "
                         "with --budget to save it")
    if args.shapes:
        given = [o for o, v in (("--coarsen/--no-coarsen", args.coarsen), ("--target", args.target),
                                ("--solver-backend", args.solver_backend), ("--optimizer", args.optimizer),
                                ("--grads", args.grads), ("--optimizer-step", args.optimizer_step or None),
                                ("--trace-sources", args.trace_sources or None))
                 if v is not None]
        if given:  # the plan book planner takes no solver options yet: refuse rather than ignore them
            raise ValueError(f"{', '.join(given)} cannot be combined with --shapes (the plan book planner does "
                             "not take them yet); plan one shape at a time without --shapes to use them")
        args.capture_device = capture_device(args)
        _check_zoo_shapes(args.model, args.size, args.shapes)
        return cli_plan(args)

    g = _graph_from_args(args)
    model = planning_model(g, args.device)
    g = apply_costs(g, model)
    if args.sweep is not None:
        return _sweep(g, args, options, model)
    p = solvers.plan(g, args.budget, device=model, solver=args.solver, time_limit=_plan_time_limit(args),
                     verbose=args.verbose, **options)
    summary = _plan_summary(g, p)
    if args.output:
        p.save(args.output)
        g.save(graph_file_of(args.output))  # for `hybridmem report` of a run that follows the plan
        summary["output"] = str(args.output)
        summary["graph_output"] = str(graph_file_of(args.output))
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        _print_table(summary)
    return 0


def _plan_time_limit(args: argparse.Namespace) -> float | None:
    """``--time-limit``, else for approx and greedy at one budget what is left of ``COMMAND_S`` seconds
    since the process started (imports and capture count), less ``FINISH_S``, at least ``MIN_PLAN_S``:
    `hybridmem plan` ends in about ten seconds. None (the solver's own default) for the other solvers and
    for ``--budget min``."""
    if args.time_limit is not None:
        return args.time_limit
    if args.solver not in solvers.approx.DEFAULT_TIME or solvers.is_min(args.budget):
        return None
    return max(COMMAND_S - process_age_s() - FINISH_S, MIN_PLAN_S)


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED


def _check_zoo_shapes(model: str | None, size: str, shapes: Sequence[str]) -> None:
    """Build a zoo model at every ``--shapes`` entry on meta (no memory, a fraction of a second each), so a
    shape the model cannot take is refused before the first bucket is written into the plan book."""
    if not model or ":" in model:
        return  # a user's factory builds real tensors: it is called once per bucket, when planned

    make = zoo_factory(model, size, device="meta")
    for shape in shapes:
        try:
            make(parse_dims(shape, dim_names_of(model)))
        except ValueError as e:
            raise ValueError(f"--shapes {shape}: {e}; nothing was planned or written") from None


def _sweep(g: Any, args: argparse.Namespace, options: dict[str, Any], model: Any) -> int:
    """``plan --sweep``: predicted step time against budget, from the least budget to the keep-all peak."""

    plans = solvers.sweep(g, model, args.solver, args.sweep, time_limit=args.time_limit, verbose=args.verbose,
                          **options)
    peak = g.peak_bytes()
    rows = [{"budget_bytes": p.budget_bytes, "budget_share": p.budget_bytes / peak, "time_s": p.predicted_time_s,
             "overhead": p.info.overhead or 0.0, "gap_to_lower_bound": p.info.gap_to_lower_bound,
             "plan_from": p.info.plan_from or p.solver, "solve_s": p.info.solve_s,
             "lower_bound_s": p.info.lower_bound_s, "compute_s": p.info.compute_s,
             "memory_floor_bytes": p.info.memory_floor_bytes} for p in plans]
    if args.plot:
        _plot_sweep(g, args, rows)
    if args.json:
        print(json.dumps({"model": g.meta.get("model", ""), "device": args.device, "solver": args.solver,
                          "keep_all_peak_bytes": peak, "points": rows, "plot": str(args.plot) if args.plot else None}))
        return 0
    name = getattr(args, "model", None) or g.meta.get("model", "") or "graph"
    print(f"{name} on {args.device}, solver {args.solver}: keep-all peak {fmt_bytes(peak)}")
    print(f"  {'budget':>12} {'of peak':>8} {'step time':>12} {'overhead':>9} {'to bound':>9}  plan from")
    for r in rows:
        # + 0.0: a plan at its bound prints 0.00, not -0.00 (float noise below it)
        gap = "" if r["gap_to_lower_bound"] is None else f"{round(100 * r['gap_to_lower_bound'], 2) + 0.0:.2f} %"
        print(f"  {fmt_bytes(r['budget_bytes']):>12} {100 * r['budget_share']:>7.1f}% {1e3 * r['time_s']:>9.3f} ms "
              f"{100 * r['overhead']:>7.2f} % {gap:>9}  {r['plan_from']}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _plot_sweep(g: Any, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    plots = bench_module("plots")
    if not plots.available():
        raise ValueError("--plot needs matplotlib: pip install 'hybridmem[plot]'")
    # the vertical line is the memory floor (no plan fits less), hidden where it is far below the least
    # budget found; the dotted line the valid lower bound on the step time at each budget
    run = {"model": getattr(args, "model", None) or g.meta.get("model", "") or "graph", "batch": args.batch,
           "device": args.device, "keep_all_peak_bytes": g.peak_bytes(),
           "min_feasible_bytes": rows[0]["memory_floor_bytes"], "solver_minimum_bytes": rows[0]["budget_bytes"],
           "results": [{"status": "ok", "method": args.solver, **r} for r in rows],
           "bounds": [{"budget_bytes": r["budget_bytes"],
                       "lower_bound_overhead": r["lower_bound_s"] / r["compute_s"] - 1}
                      for r in rows if r["lower_bound_s"] and r["compute_s"]]}
    plots.overhead_vs_budget([run], args.plot, title="Predicted step time (overhead) from the least budget to the peak")


def _plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """Solver options from the command line (see hybridmem.solvers.plan): backend and coarsening."""
    options: dict[str, Any] = {}
    if args.solver_backend:
        options["solver_backend"] = args.solver_backend
    if getattr(args, "trace_sources", False):
        options["trace_sources"] = True
    if args.target is not None:
        if args.coarsen is False:
            raise ValueError(f"--target {args.target} asks for super-stages but --no-coarsen forbids them: "
                             "give one or the other")
        options["coarsen"], options["target"] = True, args.target
    elif args.coarsen is not None:
        options["coarsen"] = args.coarsen
    return options


def _plan_summary(g: Any, p: Any) -> dict[str, Any]:
    """The plan's figures as the planner simulated them (the plan is not replayed again here)."""
    moved = {"swap": 0, "recompute": 0, "compress": 0}
    seen: set[tuple[str, int]] = set()
    for a in p.actions:
        pol = {"swap_out": "swap", "recompute": "recompute", "compress": "compress"}.get(a.kind)
        if pol and (pol, a.tensor) not in seen:
            seen.add((pol, a.tensor))
            moved[pol] += g.tensors[a.tensor].nbytes
    return {
        "model": g.meta.get("model", ""), "stages": g.num_stages, "solver": p.solver, "device": p.device,
        "budget_bytes": p.budget_bytes, "keep_all_peak_bytes": g.peak_bytes(), "peak_bytes": p.predicted_peak_bytes,
        **({"optimizer_state_bytes": g.meta["optimizer"]["state_bytes"]} if isinstance(g.meta.get("optimizer"), dict) else {}),
        "time_s": p.predicted_time_s, "compute_s": p.info.compute_s, "overhead": p.info.overhead,
        "stall_s": p.info.stall_s, "bytes_swapped": moved["swap"], "bytes_recomputed": moved["recompute"],
        "bytes_compressed": moved["compress"], **{k: v for k, v in p.info.items() if isinstance(v, (int, float, str))},
    }


def _print_table(summary: dict[str, Any]) -> None:
    rows = []
    for k, v in summary.items():
        if (k.endswith("_bytes") or k.startswith("bytes_")) and isinstance(v, (int, float)):
            v = fmt_bytes(v)
        elif (k in ("overhead", "gap") or k.startswith("gap_")) and isinstance(v, float):
            v = f"{v * 100:.2f} %"
        elif k.endswith("_s") and isinstance(v, float):
            v = f"{v * 1e3:.3f} ms"
        rows.append((k, str(v)))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def cmd_simulate(args: argparse.Namespace) -> int:
    g = _graph_from_args(args)
    model = planning_model(g, args.device)
    g = apply_costs(g, model)
    plan = Plan.load(args.plan) if args.plan else None
    if plan is not None:
        plan.check_graph(g)
    budget = None
    if args.budget is not None:
        budget = plan_budget_bytes(args.budget, g.peak_bytes())
    res = simulate(g, plan, device=model, budget=budget)
    if args.json:
        print(json.dumps(res.to_dict(), default=str))
    else:
        _print_table(simulate_summary(res))
        print(counted_text(res.counted))
    return 0


def counted_text(counted: dict[str, Any]) -> str:
    """What the peak counts (``SimResult.counted``), for the terminal."""
    lines = ["  the peak counts:"]
    lines += [f"    {k}: {v}" for k, v in counted.items() if k != "bytes"]
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in (counted.get("bytes") or {}).items())
    if parts:
        lines.append(f"    at the peak: {parts}")
    return "\n".join(lines)


def simulate_summary(res: Any) -> dict[str, Any]:
    """The scalar numbers of a simulation, the same keys and values ``simulate --json`` prints."""
    return {k: v for k, v in res.to_dict().items() if v is None or isinstance(v, (int, float, str))}


def cmd_run(args: argparse.Namespace) -> int:
    _check_run_flags(args)
    settings = {"HYBRIDMEM_BUDGET": args.budget, "HYBRIDMEM_POLICIES": args.policies,
                "HYBRIDMEM_PLAN": args.plan, "HYBRIDMEM_CONFIG": args.config, "HYBRIDMEM_REPORT": args.report,
                "HYBRIDMEM_MONITOR": args.monitor, "HYBRIDMEM_COMPILE": "1" if args.compile else None}
    try:
        code = run_script([args.script, *args.args], {k: v for k, v in settings.items() if v is not None})
    except Exception as e:
        if getattr(e, "min_budget_bytes", None) is None:  # not the runtime's OOM: the script's own error
            raise
        print(budget_too_small(e, args), file=sys.stderr)
        return 1
    if not args.quiet:
        _print_run_summary()
    return code


def _check_run_flags(args: argparse.Namespace) -> None:
    """``--budget``, ``--policies`` and ``--monitor`` checked as the runtime will read them, before the script
    starts, so that an error names the flag rather than the variable it is passed on in."""
    for flag, key in (("--budget", "budget"), ("--policies", "policies")):
        value = getattr(args, key)
        if value is not None:
            try:
                config_checks()[key](value, key)
            except ValueError as e:
                raise ValueError(f"{flag} {value!r}: {e}") from None


def budget_too_small(e: BaseException, args: argparse.Namespace) -> str:
    """One message for a run the budget stopped (the runtime's OOM): the budget it names, and the command that
    trains with it. The runtime measured the step it stopped (runtime.survey): that budget works; where it did
    not (``plugins: {survey: false}``) the number is a lower bound, and the message says how to find one."""
    least = int(getattr(e, "min_budget_bytes"))
    text = str(e)
    first = text.split(". ", 1)[0].removeprefix("hybridmem: ")
    steps = runtime.stats().steps if runtime.enabled() else 0
    when = (f"after {steps} training step(s)" if steps else
            "before its first training step ended (building the model and the data counts too)")
    script = " ".join([args.script, *args.args])
    retry = f"{(least * 1.01) / 2**20:.2f}MiB"
    if "holds every op of it" in text:
        tightest = text.split("(the tightest: ", 1)[1].split(",", 1)[0] if "(the tightest: " in text else "its tightest op"
        return (f"hybridmem run: {args.script} stopped {when}: {first}.\n"
                f"  The step ran on without the cap to measure what it needs: {fmt_bytes(least)} ({least} bytes), "
                f"at {tightest}.\n"
                f"  Train with it (1 % to spare): hybridmem run --budget {retry} {script}")
    return (f"hybridmem run: {args.script} stopped {when}: {first}.\n"
            f"  No budget below {fmt_bytes(least)} ({least} bytes) can work (the bytes nothing could evict at the "
            "tightest point reached; the rest of the step may need more).\n"
            f"  A budget that works: the peak that `hybridmem run {script}` reports (no budget: it only measures, "
            "and prints the range to choose from).")


def _print_run_summary() -> None:
    if runtime.enabled():
        print(run_summary(runtime.stats()), file=sys.stderr)
    else:
        print("hybridmem run: no summary: the script disabled hybridmem before it ended", file=sys.stderr)


def run_summary(st: Any) -> str:
    """One screen about a run (``hybridmem run`` prints it at exit): peak against the budget, bytes each
    policy evicted, the time regeneration and stalls cost, and whether a plan was followed. A compiled run
    (``--compile``) prints its regions' plans."""
    if hasattr(st, "regions"):          # hybridmem.compile.CompileStats
        return str(st) if st.regions else f"{st}\n  no compiled region ran: did the script call torch.compile?"
    if st.budget_bytes is None:
        head = f"peak {fmt_bytes(st.peak_bytes)} (measure only: no budget)"
        if st.steps and st.saved_bytes:
            least = max(st.peak_bytes - st.saved_bytes, 1)
            why = (f"the peak less the {fmt_bytes(st.saved_bytes)} of saved activations a step can evict: no budget "
                   "below works")
            if st.min_budget_bytes > least:  # --monitor ops: measured at each op
                least, why = st.min_budget_bytes, "what no budget could evict at the tightest op: none below works"
            choose = (f"  choose a budget: at most {fmt_bytes(st.peak_bytes)} (the peak: nothing to evict) and more "
                      f"than {fmt_bytes(least)} ({why})")
        else:
            choose = ("  choose a budget: at most the peak (nothing to evict); `--monitor ops` also counts the saved "
                      "activations, which bound it from below")
    else:
        share = st.peak_bytes / st.budget_bytes if st.budget_bytes else float("inf")
        head = (f"peak {fmt_bytes(st.peak_bytes)} of a {fmt_bytes(st.budget_bytes)} budget ({share:.0%}, "
                f"{'within' if st.peak_bytes <= st.budget_bytes else 'OVER'})")
    rank = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE") or 1) > 1 else ""  # torchrun
    lines = [f"hybridmem run{rank} on {st.device}: {head}, {st.steps_text()}"
             + (f", {st.step_seconds * 1e3:.1f} ms per step" if st.step_seconds else ""),
             f"  saved activations per step  {fmt_bytes(st.saved_bytes)}"]
    if st.budget_bytes is None:
        lines.append(choose)
    elif st.min_budget_bytes:
        lines.append(f"  no budget below {fmt_bytes(st.min_budget_bytes)} can work (the bytes nothing could evict at "
                     "the tightest op)")
    for name, p in st.policies.items():
        lines.append(f"  {name:<10} evicted {fmt_bytes(p.evicted_bytes):>11} ({p.evicted} tensors), regenerated "
                     f"{fmt_bytes(p.regenerated_bytes)} in {p.regen_seconds * 1e3:.1f} ms, "
                     f"stalled {p.stall_seconds * 1e3:.1f} ms")
    if not st.policies:
        lines.append("  evicted nothing")
    lines.append(f"  regeneration {st.regen_seconds * 1e3:.1f} ms, stalls {st.stall_seconds * 1e3:.1f} ms in all")
    lines.append(f"  plan: {st.plan}" + (f" ({st.plan_note})" if st.plan_note else ""))
    if st.budget_bytes is not None:
        lines.append(f"  {st.steady_summary()}")
    lines.extend(f"  note: {n}" for n in st.notes)
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    return bench_module("runner").main(args)


def cmd_report(args: argparse.Namespace) -> int:
    if is_run_file(args.results):  # schema hybridmem-run/1; anything else is a bench results file
        return run_report(args)
    return bench_module("report").main(args)


COMMANDS = {"capture": cmd_capture, "plan": cmd_plan, "simulate": cmd_simulate, "run": cmd_run,
            "bench": cmd_bench, "report": cmd_report}


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if not args.command:
        ap.print_help()
        return 0

    try:
        with cwd_importable():
            return COMMANDS[args.command](args) or 0
    except (HybridMemError, ValueError, FileNotFoundError) as e:
        print(f"hybridmem {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Render a bench results file: Markdown tables and PNG plots (``hybridmem report RUN.json``).

The two kinds of truth are kept apart, and every table says which it is:

- **measured**: real step time and peak of real training steps on this CPU (``results["measured"]``);
- **simulated**: plans for paper-size graphs judged by the one simulator under a device cost model
  (``results["simulated"]``).

The results schema is documented in :mod:`bench.runner`; :func:`load_results` checks what this module
reads and names what is wrong.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

SCHEMA = "hybridmem-bench/1"
GIB, MIB = 2**30, 2**20


class ResultsError(ValueError):
    """A results file is missing, unreadable or not a hybridmem bench results file."""


# ---- loading ---------------------------------------------------------------------------------------
def load_results(path: str | Path) -> dict[str, Any]:
    """Read and check a results JSON; raise :class:`ResultsError` saying what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ResultsError(f"{path}: no such results file (write one with `hybridmem bench -o DIR`; "
                           "it is DIR/results.json)")
    if path.is_dir():
        cand = path / "results.json"
        if not cand.exists():
            raise ResultsError(f"{path} is a folder without results.json in it")
        path = cand
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not valid JSON (truncated or corrupted?): {e.msg} at line {e.lineno} "
                           f"column {e.colno}") from None
    return check_results(data, source=str(path))


def check_results(data: Any, source: str = "results") -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ResultsError(f"{source}: expected a JSON object with keys schema, measured, simulated; "
                           f"got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ResultsError(f"{source}: schema {data.get('schema')!r} is not {SCHEMA!r}: not a hybridmem bench "
                           "results file, or one from another version")
    for key in ("measured", "simulated"):
        v = data.setdefault(key, [])
        if not isinstance(v, list) or not all(isinstance(r, dict) for r in v):
            raise ResultsError(f"{source}: {key!r} must be a list of objects")
        for i, r in enumerate(v):
            if not isinstance(r.get("results", []), list):
                raise ResultsError(f"{source}: {key}[{i}].results must be a list")
            for j, m in enumerate(r.get("results", [])):
                if not isinstance(m, dict) or "method" not in m:
                    raise ResultsError(f"{source}: {key}[{i}].results[{j}] must be an object with a 'method'")
    return data


# ---- formatting ------------------------------------------------------------------------------------
def fmt_bytes(n: Any) -> str:
    if not _isnum(n):
        return "—"
    n = float(n)
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.0f} KiB"


def fmt_pct(x: Any, *, sign: bool = True) -> str:
    if not _isnum(x):
        return "—"
    return f"{100 * x:+.1f} %" if sign else f"{100 * x:.0f} %"


def fmt_time(s: Any) -> str:
    if not _isnum(s):
        return "—"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _isnum(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _yes(x: Any) -> str:
    return "—" if x is None else "yes" if x else "**no**"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A Markdown table padded to aligned columns, so it reads well in a terminal too."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    align = align or "l" + "r" * (len(header) - 1)

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line([str(h) for h in header]), sep, *(line(r) for r in rows)])


# ---- measured --------------------------------------------------------------------------------------
MEASURED_LABELS = {
    "unmanaged": "unmanaged (plain PyTorch)",
    "hybridmem-monitor": "hybridmem, monitor only",
    "hybridmem-online": "hybridmem online (budget)",
    "hybridmem-plan": "hybridmem with plan (budget)",
    "ckpt-sqrt": "torch checkpoint_sequential, sqrt(n)",
    "ckpt-block": "torch checkpoint, every block",
    "save-on-cpu": "torch save_on_cpu",
}


def measured_markdown(run: dict[str, Any]) -> str:
    head = (f"### {run.get('model')} ({run.get('size')}, batch {run.get('batch')}): measured on this CPU\n\n"
            f"Real training steps (SGD), torch on {run.get('threads', 1)} thread, {run.get('steps')} timed steps per "
            f"method interleaved round-robin after {run.get('rounds', 0) - run.get('steps', 0)} warm-up; overhead = "
            "median over rounds of (step time / unmanaged step time in the same round) - 1; step time is the "
            "process's CPU time (single-threaded, no device: equal to wall time on an idle machine) unless "
            "`HYBRIDMEM_BENCH_CLOCK=wall`. "
            f"Peaks from the {run.get('peak_source', '?')}.")
    if run.get("budget_bytes"):
        head += (f" Budget {fmt_bytes(run['budget_bytes'])} = monitor-only peak {fmt_bytes(run.get('monitor_peak_bytes'))}"
                 f" - 40 % of {fmt_bytes(run.get('saved_bytes'))} saved activations.")
    alloc = any(r.get("alloc_peak_bytes") is not None for r in run.get("results", []))
    rows = []
    for r in run.get("results", []):
        name = MEASURED_LABELS.get(r["method"], r["method"])
        if r.get("status") != "ok":
            rows.append([name, f"{r.get('status', '?')} (see the notes)", *["—"] * (8 + alloc)])
            continue
        ev = r.get("evicted_bytes") or {}
        evs = " / ".join(fmt_bytes(ev.get(k, 0)) if ev.get(k) else "0" for k in ("swap", "recompute", "compress")) if ev else "—"
        within = "—" if r.get("budget_ok") is None else ("yes" if r["budget_ok"] else "**no**")
        rows.append([name, fmt_time(r.get("step_s")), fmt_pct(r.get("overhead")), fmt_bytes(r.get("peak_bytes")),
                     *([fmt_bytes(r.get("alloc_peak_bytes"))] if alloc else []),
                     within, evs, _yes(r.get("losses_identical") if r["method"] != "unmanaged" else None),
                     _yes(r.get("grads_identical")), _yes(r.get("buffers_identical"))])
    body = table(["method", "step", "overhead", "peak", *(["allocator peak"] if alloc else []), "<= budget",
                  "evicted swap / recompute / compress", "losses =", "grads =", "BN stats ="], rows,
                 "lrrr" + "r" * alloc + "rrccc")
    bad = [f"{MEASURED_LABELS.get(r['method'], r['method'])}: {r.get('status')}: {r.get('reason')}"
           for r in run.get("results", []) if r.get("status") != "ok"]
    bad += [f"{MEASURED_LABELS.get(r['method'], r['method'])}: {r.get('reason')}"
            for r in run.get("results", []) if r.get("status") == "ok" and r.get("reason")]
    for r in run.get("results", []):
        if r.get("method") == "hybridmem-plan" and r.get("status") == "ok" and r.get("plan_state"):
            bad.append(f"hybridmem with plan: the runtime reports the plan as {r['plan_state']!r} "
                       f"(solver {run.get('plan_solver') or '?'}, made for this CPU's captured graph)")
    if alloc:
        bad.append("allocator peak: what the CPU allocator itself held above the pre-step level (torch.profiler); "
                   "swap on a CPU-only machine copies within the same RAM, so only recompute lowers it")
    if any(r["method"] == "save-on-cpu" for r in run.get("results", [])):
        bad.append("save_on_cpu: the device is the host here, so it keeps every saved tensor where it is")
    run = {**run, "notes": [*run.get("notes", []), *bad]}
    notes = "".join(f"\n- {n}" for n in run.get("notes", []))
    return f"{head}\n\n{body}\n{notes}\n"


# ---- simulated -------------------------------------------------------------------------------------
SIM_ORDER = ("hybridmem-milp", "hybridmem-approx", "chen", "checkmate", "swap-vdnn", "swap-opt", "capuchin", "dtr")


def _methods(run: dict[str, Any]) -> list[str]:
    seen = list(dict.fromkeys(r["method"] for r in run.get("results", [])))
    return [m for m in SIM_ORDER if m in seen] + [m for m in seen if m not in SIM_ORDER]


def _minimum_note(run: dict[str, Any]) -> str:
    """Where the sweep starts when a minimum search raised it above the simulator's lower bound."""
    ms = run.get("minimum_search") or {}
    if not run.get("solver_minimum_bytes") or not ms:
        return ""
    if not ms.get("found_by"):
        return (f"; no plan below the keep-all peak by {', '.join(ms.get('solvers', []))} "
                f"(bisection to {fmt_bytes(ms.get('tolerance_bytes'))})")
    return (f"; lowest budget found with a plan {fmt_bytes(run['solver_minimum_bytes'])} (by {ms['found_by']}, "
            f"bisection over {', '.join(ms.get('solvers', []))} to {fmt_bytes(ms.get('tolerance_bytes'))}, "
            f"{len(ms.get('probes', []))} plans, {fmt_time(ms.get('search_s'))}): the sweep starts there")


def simulated_markdown(run: dict[str, Any]) -> str:
    peak = run.get("keep_all_peak_bytes") or 0
    head = (f"### {run.get('model')} (batch {run.get('batch')}) on {run.get('device')}: simulated\n\n"
            f"Graph captured on meta at {run.get('size', 'paper')} size: {run.get('stages')} stages, keep-all peak "
            f"{fmt_bytes(peak)}, keep-all step {fmt_time(run.get('keep_all_time_s'))}, min-feasible lower bound "
            f"{fmt_bytes(run.get('min_feasible_bytes'))}{_minimum_note(run)}. Cells: simulated overhead against keep-all "
            "(lowest in bold; `inf.`: the method found no plan within the budget; `—`: not run). Bound: the best "
            "lower bound on the step time known at that budget, as an overhead: the LP relaxation's (`LP`, a bound "
            "within the STR model) or the swap/recompute bound of the full graph (`s`, valid for every "
            "swap/recompute plan; `c`: it is the pure compute time there); gaps below are measured against it.")
    if run.get("budget_capped_at_device_memory"):
        head += (f" The keep-all peak exceeds the device's {fmt_bytes(run.get('device_memory_bytes'))}: budgets stop "
                 "there, so without a plan this step does not fit at all.")
    if run.get("no_plan_within_device_memory"):
        head += " No probe planner found a plan within the device's memory: the one budget shown is the memory."
    methods = _methods(run)
    by = {(r["method"], r.get("budget_bytes")): r for r in run.get("results", [])}
    bounds = {b.get("budget_bytes"): b for b in run.get("bounds", [])}
    rows = []
    for b in run.get("budgets", []):
        cells, vals = [], []
        for m in methods:
            r = by.get((m, b))
            if r is None:
                cells.append("—")
            elif r.get("status") == "ok":
                cells.append(fmt_pct(r.get("overhead")))
                vals.append(r.get("overhead"))
            else:
                cells.append({"infeasible": "inf.", "unavailable": "—"}.get(r.get("status"), r.get("status", "?")))
        best = min((v for v in vals if _isnum(v)), default=None)
        cells = [f"**{c}**" if best is not None and c == fmt_pct(best) else c for c in cells]
        lb = bounds.get(b, {})
        bound = fmt_pct(lb.get("lower_bound_overhead"))
        src = str(lb.get("source", ""))
        if lb:
            bound += " LP" if src.startswith("LP") else " s" if src.startswith("swap") else " c"
        rows.append([fmt_bytes(b), fmt_pct(b / peak, sign=False) if peak else "—", bound, *cells])
    body = table(["budget", "of peak", "bound", *methods], rows)
    gap_rows, footnotes = [], Footnotes()
    for m in methods:
        rs = [r for r in run.get("results", []) if r["method"] == m]
        ok = [r for r in rs if r.get("status") == "ok"]
        gaps = [r["gap_to_bound"] for r in ok if _isnum(r.get("gap_to_bound"))]
        solve = [r["solve_s"] for r in rs if _isnum(r.get("solve_s"))]
        notes = sorted({r.get("note", "") for r in rs if r.get("note")})
        gap_rows.append([m, f"{len(ok)}/{len(rs)}", fmt_pct(_median(gaps)), fmt_pct(max(gaps) if gaps else None),
                         fmt_time(_median(solve)), fmt_time(max(solve) if solve else None), footnotes.mark(notes)])
    gaps = table(["method", "feasible", "gap to bound (median)", "gap (max)", "solve (median)", "solve (max)", "notes"],
                 gap_rows, "lrrrrrl")
    return f"{head}\n\n{body}\n\n{gaps}\n{footnotes.render()}"


class Footnotes:
    """Long notes as numbered footnotes under a table, so no cell is cut mid-sentence."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def mark(self, notes: Iterable[str]) -> str:
        """The cell for ``notes``: their footnote numbers, e.g. ``[1] [3]`` (a note met before keeps its number)."""
        marks = []
        for n in notes:
            if n not in self.notes:
                self.notes.append(n)
            marks.append(f"[{self.notes.index(n) + 1}]")
        return " ".join(marks)

    def render(self) -> str:
        return "".join(f"\n[{i}] {n}" for i, n in enumerate(self.notes, 1)) + ("\n" if self.notes else "")


def solver_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """(method, stages, solve_s) for every simulated plan: the data of the solver-time plot and table."""
    out = []
    for run in results.get("simulated", []):
        for r in run.get("results", []):
            if _isnum(r.get("solve_s")):
                out.append({"model": run.get("model"), "device": run.get("device"), "stages": run.get("stages"),
                            "method": r["method"], "solve_s": r["solve_s"]})
    return out


def solver_markdown(results: dict[str, Any]) -> str:
    rows = solver_rows(results)
    if not rows:
        return ""
    graphs = sorted({(r["stages"], r["model"]) for r in rows if r["stages"]})
    methods = [m for m in SIM_ORDER if any(r["method"] == m for r in rows)]
    out = []
    for stages, model in graphs:
        cells = []
        for m in methods:
            ts = [r["solve_s"] for r in rows if r["model"] == model and r["method"] == m]
            cells.append(f"{fmt_time(_median(ts))} / {fmt_time(max(ts))}" if ts else "—")
        out.append([model, stages, *cells])
    return ("### Solver time against graph size\n\nMedian / max wall time per plan on this machine's CPU, "
            "over all budgets and devices.\n\n" + table(["model", "stages", *methods], out) + "\n")


def _median(xs: Sequence[float]) -> float | None:
    xs = sorted(x for x in xs if _isnum(x))
    if not xs:
        return None
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def render_markdown(results: dict[str, Any], *, images: dict[str, str] | None = None) -> str:
    """The whole report; ``images`` maps plot keys to relative paths to embed."""
    env = results.get("env", {})
    parts = [f"# hybridmem benchmark{' (quick)' if results.get('quick') else ''}\n",
             f"Run {results.get('created', '?')} with `{results.get('command', 'hybridmem bench')}`: hybridmem "
             f"{env.get('hybridmem', '?')}, torch {env.get('torch', '?')}, {env.get('cpu', '?')} "
             f"({env.get('cores', '?')} cores), {fmt_time(results.get('wall_s'))} in all.\n"]
    images = images or {}
    if results.get("measured"):
        parts.append("## Measured on this CPU (real time, real peak)\n")
        if "measured" in images:
            parts.append(f"![measured]({images['measured']})\n")
        for run in results["measured"]:
            parts.append(measured_markdown(run))
    if results.get("simulated"):
        parts.append("## Simulated on device models (one cost model and simulator judge every plan)\n")
        for key, path in images.items():
            if key.startswith("overhead_"):
                parts.append(f"![{key}]({path})\n")
        for run in results["simulated"]:
            parts.append(simulated_markdown(run))
            key = f"memory_{run.get('model')}_{run.get('device')}"
            if key in images:
                parts.append(f"![{key}]({images[key]})\n")
        parts.append(solver_markdown(results))
        if "solver_time" in images:
            parts.append(f"![solver time]({images['solver_time']})\n")
    if results.get("missing"):
        parts.append("## Not run\n\n" + "".join(f"- {m}\n" for m in results["missing"]))
    return "\n".join(parts)


# ---- plots -----------------------------------------------------------------------------------------
def pick_timelines(results: dict[str, Any], choice: str | None = None) -> list[dict[str, Any]]:
    """The simulated runs whose memory-over-stages plot is drawn: one per device.

    ``choice``: ``MODEL`` or ``MODEL:DEVICE``, or ``all``; default: ResNet-101 where it was run (a paper
    headline), else the largest graph.
    """
    runs = [r for r in results.get("simulated", []) if (r.get("timeline") or {}).get("memory")]
    if choice == "all":
        return runs
    if choice:
        model, _, device = choice.partition(":")
        return [r for r in runs if r.get("model") == model and (not device or r.get("device") == device)]
    out = []
    for device in dict.fromkeys(r.get("device") for r in runs):
        mine = [r for r in runs if r.get("device") == device]
        pick = next((r for r in mine if r.get("model") == "resnet101"), None) or max(mine, key=lambda r: r.get("stages") or 0)
        out.append(pick)
    return out


def render_plots(results: dict[str, Any], out: Path, *, prefix: str = "", timeline: str | None = None) -> dict[str, Path]:
    """Write every plot the results support into ``out``; return {key: path}. Needs matplotlib."""
    from . import plots

    made: dict[str, Path] = {}
    sims = results.get("simulated", [])
    for device in dict.fromkeys(r.get("device") for r in sims):
        runs = [r for r in sims if r.get("device") == device and r.get("results")]
        if runs:
            made[f"overhead_{device}"] = plots.overhead_vs_budget(
                runs, out / f"{prefix}overhead_{device}.png",
                title=f"Simulated on {device}: step-time overhead against the memory budget")
    for run in pick_timelines(results, timeline):
        tl = run["timeline"]
        key = f"memory_{run.get('model')}_{run.get('device')}"
        made[key] = plots.memory_timeline(
            {**tl, "model": run.get("model"), "device": run.get("device")}, out / f"{prefix}{key}.png",
            title=(f"{run.get('model')} b{run.get('batch')} on {run.get('device')}: memory over one step, "
                   f"{tl.get('method')} at {fmt_bytes(tl.get('budget_bytes'))}"))
    if solver_rows(results):
        made["solver_time"] = plots.solver_time_vs_size(solver_rows(results), out / f"{prefix}solver_time.png")
    measured = [r for r in results.get("measured", []) if any(x.get("status") == "ok" for x in r.get("results", []))]
    if measured:
        made["measured"] = plots.measured_overview(measured, out / f"{prefix}measured.png")
    return made


def write_report(results: dict[str, Any], out: Path, *, stem: str = "results", quiet: bool = False,
                 timeline: str | None = None) -> tuple[Path, dict[str, Path]]:
    """Plots (if matplotlib is there) and ``<stem>.md`` in ``out``; returns the Markdown path and the plots."""
    from . import plots

    out.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    if plots.available():
        made = render_plots(results, out, timeline=timeline)
    elif not quiet:
        print("plots skipped: matplotlib is not installed (pip install 'hybridmem[plot]')", file=sys.stderr)
    md = render_markdown(results, images={k: p.name for k, p in made.items()})
    path = out / f"{stem}.md"
    path.write_text(md)
    return path, made


def merge_results(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One results dict from several runs (e.g. the measured and the simulated halves of a sweep).

    Runs of the same model (and device) in several files: the later file's wins.
    """
    if len(parts) == 1:
        return parts[0]
    out = {**parts[0], "missing": []}
    measured: dict[tuple, dict[str, Any]] = {}
    simulated: dict[tuple, dict[str, Any]] = {}
    for p in parts:  # a later file's run of the same model (and device) replaces an earlier one's
        measured.update({(r.get("model"), r.get("size")): r for r in p.get("measured", [])})
        simulated.update({(r.get("model"), r.get("device")): r for r in p.get("simulated", [])})
        out["missing"] += [m for m in p.get("missing", []) if m not in out["missing"]]
    out["measured"], out["simulated"] = list(measured.values()), list(simulated.values())
    out["command"] = " + ".join(str(p.get("command", "?")) for p in parts)
    out["wall_s"] = sum(p.get("wall_s") or 0 for p in parts)
    out["quick"] = all(p.get("quick") for p in parts)
    return out


def main(args: Any) -> int:
    """``hybridmem report RUN.json [-o DIR]``: print the tables, write the Markdown and PNGs.

    ``args.results`` may also be a list of files, merged into one report (``python -m bench.report``).
    """
    paths = args.results if isinstance(args.results, (list, tuple)) else [args.results]
    try:
        results = merge_results([load_results(p) for p in paths])
    except ResultsError as e:
        print(f"hybridmem report: error: {e}", file=sys.stderr)
        return 2
    src = Path(paths[0])
    src = src / "results.json" if src.is_dir() else src
    out = Path(getattr(args, "output", None) or src.parent)
    md, made = write_report(results, out, stem=src.stem, timeline=getattr(args, "timeline", None))
    print(render_markdown(results))
    print(f"wrote {md}" + "".join(f"\nwrote {p}" for p in made.values()))
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+", help="one or more results.json files (merged)")
    ap.add_argument("-o", "--output", type=Path)
    ap.add_argument("--timeline", help="memory-over-stages plot for MODEL[:DEVICE], or 'all' (default: resnet101)")
    sys.exit(main(ap.parse_args()))
